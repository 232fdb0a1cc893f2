"""Probing a release's API: imports that may not exist, the parameters a callable accepts.

Standard library only (runs inside release environments); no version comparisons.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable


class AdapterError(Exception):
    """The release's API could not be matched: a lab error (outcome ``error``), never a
    reproduction."""


class RefusedByRelease(Exception):
    """The release's own front door refuses the workload (e.g. priorities on 0.9.0): an input
    error naming the field and the release. ``vllm_exc``: the exception vLLM itself raised to
    refuse it (a config validator's ``ValidationError``, ``Processor.process_inputs``'
    ``ValueError``), ``None`` where the lab refuses on the release's behalf (a field or call the
    release lacks); ``phase``: where vLLM refused (``config``: ``EngineArgs`` / ``VllmConfig``
    / ``SchedulerConfig`` built, ``add_request``: the front door). What a scenario's
    ``outcome: refused`` is judged on (``RunResult.refusal``)."""

    vllm_exc: BaseException | None = None
    phase: str = "config"


def refused_by_vllm(message: str, exc: BaseException, phase: str = "config") -> RefusedByRelease:
    """A :class:`RefusedByRelease` for ``exc``, raised by vLLM's own code to refuse the scenario
    in ``phase`` (``config``, ``add_request``)."""
    refused = RefusedByRelease(message)
    refused.vllm_exc = exc
    refused.phase = phase
    return refused


class LevelMissing(RefusedByRelease):
    """The release has no engine of the scenario's ``level`` at all (``level: v0-engine`` on
    0.33.0, which has no ``vllm/engine/llm_engine.py``; ``level: scheduler`` on a release with
    only the V0 engine): the release refuses the scenario as a whole, not one of its fields.
    ``level``: that level; the message is ``level: <level>: <reason>``. Recorded as
    :class:`~vllm_repro.records.RunError` ``lacks_level``, which ``catalog run`` and ``matrix``
    read (an ``--also-on`` release or a matrix cell it says nothing about)."""

    def __init__(self, level: str, reason: str):
        super().__init__(f"level: {level}: {reason}")
        self.level = level


def _import(*candidates: str):
    """The first importable ``module:attr`` of ``candidates`` (``module`` alone for a module)."""
    errors = []
    for cand in candidates:
        mod_name, _, attr = cand.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            errors.append(f"{mod_name}: {exc}")
            continue
        if not attr:
            return mod
        if hasattr(mod, attr):
            return getattr(mod, attr)
        errors.append(f"{mod_name} has no {attr}")
    raise AdapterError("none of " + ", ".join(candidates) + " is importable: " + "; ".join(errors))


def _try_import(*candidates: str):
    try:
        return _import(*candidates)
    except AdapterError:
        return None


#: ``params_of`` / ``init_params`` answers per callable: the adapter asks on every request and
#: step (about 2,100 ``inspect.signature`` calls a flagship run), and a release's signatures do
#: not change while its worker runs
_PARAMS: dict = {}


def _cached(kind: str, fn, compute):
    try:
        return _PARAMS[(kind, fn)]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable: asked every time
        return compute(fn)
    answer = _PARAMS[(kind, fn)] = compute(fn)
    return answer


def params_of(fn: Callable) -> tuple[frozenset[str], bool]:
    """(names of the parameters ``fn`` accepts, whether it takes ``**kwargs``), asked once per
    callable in a worker."""
    return _cached("params", fn, _params_of)


def _params_of(fn: Callable) -> tuple[frozenset[str], bool]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset(), True
    names = frozenset(p.name for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def init_params(cls: type) -> tuple[frozenset[str], bool]:
    """``params_of`` for a class's constructor, looking through ``__init__(self, *args,
    **kwargs)`` wrappers to the first class in the MRO that names its parameters.

    vLLM's ``AsyncScheduler.__init__(self, *args, **kwargs)`` (0.17 onward) only forwards to
    ``Scheduler.__init__``: read as "takes any keyword", it made the lab pass the first V1
    generation's keywords, which ``Scheduler`` rejects (the async-scheduling defect)."""
    return _cached("init", cls, _init_params)


def _init_params(cls: type) -> tuple[frozenset[str], bool]:
    for klass in getattr(cls, "__mro__", (cls,)):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            sig = inspect.signature(init)
        except (TypeError, ValueError):
            continue
        kinds = {p.kind for p in list(sig.parameters.values())[1:]}
        if kinds and kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
            continue  # a pure forwarder: look at the base class
        return params_of(init)
    return params_of(cls)


def fields_of(cls) -> set[str]:
    """The field names of a vLLM params or config class: dataclass fields, msgspec struct
    fields, pydantic model fields and constructor parameters (private ``_`` names left out)."""
    names = set(getattr(cls, "__dataclass_fields__", None) or {})
    names |= set(getattr(cls, "__struct_fields__", None) or ())
    names |= set(getattr(cls, "model_fields", None) or {})
    names |= init_params(cls)[0]
    return {n for n in names if not n.startswith("_")}


def call_supported(fn: Callable, /, **kwargs):
    """Call ``fn`` with the subset of ``kwargs`` it accepts (drift in optional parameters).
    For a class, its effective constructor (:func:`init_params`) decides."""
    names, var_kw = init_params(fn) if isinstance(fn, type) else params_of(fn)
    if not var_kw:
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return fn(**kwargs)


def _source_has(fn, text: str) -> bool:
    """Whether the source of ``fn`` contains ``text`` (False when it has no readable source)."""
    try:
        return text in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def class_in_source(module: str, cls: str):
    """``(file, its text, the ast.ClassDef)`` of class ``cls`` in ``module``'s source file, read
    with :mod:`ast` (nothing imported); None when the file or the class is absent."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text, spec.origin)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return spec.origin, text, node
    return None
