"""A scenario's pass-through ``config:`` fields checked against a release's source, before any
vLLM import.

A ``config:`` key that is not one of the lab's own fields is handed to the release's
``SchedulerConfig``, ``CacheConfig``, ``ParallelConfig``, ``SpeculativeConfig``, or
``StructuredOutputsConfig`` / ``DecodingConfig`` (``engine_args.PASSTHROUGH_CLASSES``; see
:class:`~vllm_repro.scenario.schema.SchedulerSettings`). The worker refuses a key none of them
has, but only after importing vLLM (seconds). Here the same question is answered from the
extracted tree with :mod:`ast` (``vllm/config.py`` or ``vllm/config/*.py``): the classes'
annotated fields and ``__init__`` parameters. The answer is conservative: when a class is not
found, takes ``**kwargs``, or inherits from a class not found, nothing is refused here and the
worker's own check decides. At ``level: v0-engine`` the keys go to the release's ``EngineArgs``
(``vllm/engine/arg_utils.py``), whose annotated fields are read the same way. Standard library
only.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ..engine.engine_args import (NGRAM_FLAT_FIELDS, OPTIONAL_PASSTHROUGH_CLASSES,
                                  PASSTHROUGH_CLASSES, engine_arg_refusal, passthrough_refusal)
from .schema import SchedulerSettings


def _config_sources(tree: Path) -> list[Path]:
    single = tree / "vllm" / "config.py"
    pkg = tree / "vllm" / "config"
    files = [single] if single.is_file() else []
    if pkg.is_dir():
        files += sorted(pkg.glob("*.py"))
    return files


def _class_fields(node: ast.ClassDef) -> tuple[set[str], bool]:
    """``(field names, open)``: annotated class attributes and ``__init__`` parameters;
    ``open`` when ``__init__`` takes ``**kwargs`` (any name is accepted)."""
    names: set[str] = set()
    open_ = False
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            a = stmt.args
            names |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]} - {"self"}
            open_ = open_ or a.kwarg is not None
    return names, open_


def release_config_fields(tree: Path) -> set[str] | None:
    """Every field name the pass-through classes of the release in ``tree`` take, or None when
    the source does not settle it (a class missing, open, or inheriting from one unseen; the
    structured-output classes may be missing: a release has one of them, or neither)."""
    found = release_config_classes(tree)
    return None if found is None else found[0]


def release_config_classes(tree: Path) -> tuple[set[str], tuple[str, ...]] | None:
    """:func:`release_config_fields` with the pass-through classes the release has."""
    classes: dict[str, ast.ClassDef] = {}
    for path in _config_sources(tree):
        try:
            mod = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError, ValueError, RecursionError):
            return None
        for node in ast.walk(mod):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)
    fields: set[str] = set()
    present = tuple(n for n in PASSTHROUGH_CLASSES
                    if n in classes or n not in OPTIONAL_PASSTHROUGH_CLASSES)
    for name in present:
        todo, seen = [name], set()
        while todo:
            cls = todo.pop()
            if cls in seen:
                continue
            seen.add(cls)
            node = classes.get(cls)
            if node is None:
                return None
            names, open_ = _class_fields(node)
            if open_:
                return None
            fields |= names
            for base in node.bases:
                base_name = base.id if isinstance(base, ast.Name) else (
                    base.attr if isinstance(base, ast.Attribute) else None)
                if base_name in (None, "object", "Generic", "Protocol"):
                    continue
                if base_name in ("BaseModel", "SupportsHash", "SupportsMetricsInfo", "ABC"):
                    continue  # framework / marker bases: they add no constructor field a user sets
                todo.append(base_name)
    return fields, present


def release_engine_args_fields(tree: Path) -> set[str] | None:
    """The field names of the release's V0 ``EngineArgs`` (a dataclass in
    ``vllm/engine/arg_utils.py``, 0.4 to 0.10: its annotated class attributes), or None when
    the source does not settle it (no such file or class, an ``__init__`` of its own taking
    ``**kwargs``, or a base class)."""
    path = tree / "vllm" / "engine" / "arg_utils.py"
    try:
        mod = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError, RecursionError):
        return None
    for node in mod.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            if node.bases:
                return None
            names, open_ = _class_fields(node)
            return None if open_ or not names else names
    return None


def unknown_passthrough(config: SchedulerSettings, version: str, tree: Path | None,
                        level: str = "scheduler") -> str | None:
    """The one-line refusal naming every pass-through key of ``config`` that the release in
    ``tree`` has in none of :data:`PASSTHROUGH_CLASSES` (each with the field it likely
    misspells: :func:`~vllm_repro.engine.engine_args.passthrough_refusal`), or None when every
    key is there or the source does not settle it. At ``level: v0-engine``
    the keys go to the release's ``EngineArgs`` (:func:`release_engine_args_fields`; the
    n-gram drafter's ``NGRAM_FLAT_FIELDS`` are left to the worker, which may fold them)."""
    extra = list(config.model_extra or {})
    if not extra or tree is None:
        return None
    if level == "v0-engine":
        return _unknown_engine_arg(extra, version, tree)
    found = release_config_classes(tree)
    if found is None:
        return None
    known, present = found
    # ``model``: ModelConfig's, a packaged folder the worker resolves (adapter/build.py)
    missing = [key for key in extra if key not in known and key != "model"]
    if not missing:
        return None
    return passthrough_refusal(missing, version, present,
                               set(SchedulerSettings.model_fields) | known)


def _unknown_engine_arg(extra: list[str], version: str, tree: Path) -> str | None:
    """:func:`unknown_passthrough` at ``level: v0-engine``: every one of ``extra`` the
    release's ``EngineArgs`` lacks, in the worker's words (``engine/v0.py:V0Adapter.engine_args``)."""
    known = release_engine_args_fields(tree)
    if known is None:
        return None
    missing = [key for key in extra if key not in known and key not in NGRAM_FLAT_FIELDS]
    return engine_arg_refusal(missing, version, known | set(NGRAM_FLAT_FIELDS)) if missing else None

