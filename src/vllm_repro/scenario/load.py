"""Load a scenario file: YAML -> :class:`~vllm_repro.scenario.schema.Scenario`.

Every failure is an :class:`~vllm_repro.errors.InputError` whose one-line message names the file,
the field (``requests[1].prompt_len``) and what to do.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from ..errors import InputError
from .schema import Scenario


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a mapping with the same key twice (YAML would keep the last)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith(("function-after", "function-before", "model")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _fix_hint(err: dict) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "remove it or check its spelling against the scenario format (docs/scenarios.md)"
    if kind == "missing":
        return "add it"
    ctx = err.get("ctx") or {}
    if kind == "greater_than_equal":
        return f"use a value of at least {ctx.get('ge')}"
    if kind == "greater_than":
        return f"use a value above {ctx.get('gt')}"
    if kind == "literal_error":
        return "use one of the values listed"
    if kind.endswith("_type"):
        plain = kind.removesuffix('_type').replace('_', ' ')
        return f"write a plain {plain} value (no quotes, no true/false for numbers)"
    return ""


def format_validation_error(path: str | Path, exc: ValidationError) -> str:
    """One line: ``FILE: FIELD: problem (fix)`` for the first error, plus a count of the rest."""
    errs = exc.errors()
    err = errs[0]
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field"
    elif err.get("type") == "missing":
        msg = "missing required field"
    hint = _fix_hint(err)
    more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
    loc = _loc(tuple(err.get("loc", ())))
    head = f"{path}: {loc}: " if loc else f"{path}: "
    return head + msg + (f"; {hint}" if hint else "") + more


def parse_scenario(data: object, source: str | Path = "<scenario>") -> Scenario:
    """Validate already-parsed YAML/JSON data. Raises :class:`InputError`."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: the file must hold a mapping (name:, config:, requests: ...)")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise InputError(format_validation_error(source, exc)) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises :class:`InputError` for a missing or unreadable
    file, invalid YAML, or any schema violation."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a folder, not a scenario file; give a file such as scenarios/<name>.yaml")
    if not p.is_file():
        raise InputError(f"{p}: no such scenario file; give a path such as scenarios/<name>.yaml")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read the file as UTF-8 text ({exc.__class__.__name__})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{p}:{where}: invalid YAML: {problem}") from None
    return parse_scenario(data, p)


def unique_scenarios(paths: list[Path]) -> list[Scenario]:
    """Load each scenario file once (a file given twice runs once). Raises :class:`InputError`
    when two files share a ``name:``: their reports (reports/<name>/<version>/) would collide."""
    by_name: dict[str, tuple[Path, Scenario]] = {}
    seen: set[Path] = set()
    for p in paths:
        if Path(p).resolve() in seen:
            continue
        seen.add(Path(p).resolve())
        sc = load_scenario(p)
        if sc.name in by_name:
            raise InputError(f"{p}: name: {sc.name!r} is also the name of {by_name[sc.name][0]}; "
                             "reports/<name>/<version>/ would collide; rename one")
        by_name[sc.name] = (p, sc)
    return [sc for _, sc in by_name.values()]
