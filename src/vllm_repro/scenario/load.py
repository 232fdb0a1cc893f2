"""Load a scenario file: YAML -> :class:`~vllm_repro.scenario.schema.Scenario`.

Every failure is an :class:`~vllm_repro.errors.InputError` whose one-line message names the file,
the field (``requests[1].prompt_len``) and what to do.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from ..errors import InputError
from ..inputs import load_yaml, read_text
from .schema import Scenario


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith(("function-after", "function-before", "model-", "model[")):
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
    if kind == "finite_number":
        return "write a finite number (not .nan or .inf)"
    if kind.endswith("_type"):
        plain = kind.removesuffix('_type').replace('_', ' ')
        return f"write a plain {plain} value (no quotes, no true/false for numbers)"
    return ""


def _all_field_names() -> set[str]:
    """Every field name of the scenario format (the candidates a misspelling is matched to)."""
    from pydantic import BaseModel

    from . import schema

    names: set[str] = set()
    for obj in vars(schema).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel:
            names |= set(obj.model_fields)
    return names


def _typo(errs: list[dict]) -> tuple[dict, str, str | None] | None:
    """An unknown field that misspells a field of the format: ``(its error, the field it
    misspells, the missing required field it stands for or None)``."""
    from .schema import close_field

    missing = {tuple(e.get("loc", ())): e for e in errs if e.get("type") == "missing"}
    for e in errs:
        if e.get("type") != "extra_forbidden":
            continue
        loc = tuple(e.get("loc", ()))
        siblings = [m[-1] for m in missing if m[:-1] == loc[:-1]]
        near = close_field(loc[-1], siblings) if siblings else None
        if near:
            return e, near, near
        near = close_field(loc[-1], _all_field_names())
        if near:
            return e, near, None
    return None


def format_validation_error(path: str | Path, exc: ValidationError) -> str:
    """One line: ``FILE: FIELD: problem; fix`` for the first error, plus a count of the rest.
    An unknown field that misspells a field of the format (``promt_len``) is named first, with
    the field it likely means."""
    errs = exc.errors()
    err = errs[0]
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    hint = _fix_hint(err)
    typo = _typo(errs)
    if typo is not None:
        err, near, required = typo
        msg = f"unknown field; did you mean {near}?" + (f" ({near} is required)" if required else "")
        hint = ""
        errs = [e for e in errs if e is not err and not (
            required and e.get("type") == "missing" and tuple(e.get("loc", ()))[-1] == required)]
        errs.insert(0, err)
    elif err.get("type") == "extra_forbidden":
        msg = "unknown field"
    elif err.get("type") == "missing":
        msg = "missing required field"
    more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
    loc = _loc(tuple(err.get("loc", ())))
    # a validator's message that names its own field (config.num_gpu_blocks: ...) stands alone
    head = f"{path}: {loc}: " if loc and not msg.startswith(loc + ".") else f"{path}: "
    return head + msg + (f"; {hint}" if hint else "") + more


def parse_scenario(data: object, source: str | Path = "<scenario>") -> Scenario:
    """Validate already-parsed YAML/JSON data. Raises :class:`InputError`."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: the file must hold a mapping (name:, config:, requests: ...)")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise InputError(format_validation_error(source, exc)) from None
    except RecursionError:
        raise InputError(f"{source}: nested too deep to validate; flatten it") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file through the loading layer (:mod:`vllm_repro.inputs`).
    Raises :class:`InputError` for a missing, unreadable, oversized or non-UTF-8 file, invalid
    or too deeply nested YAML, or any schema violation."""
    p = Path(path)
    text = read_text(p, "scenario file", "give a scenario file such as scenarios/<name>.yaml")
    data = load_yaml(text, p)
    scenario = parse_scenario(data, p)
    scenario._source_text = text
    return scenario


def unique_scenarios(paths: list[Path]) -> list[Scenario]:
    """Load each scenario file once (a file given twice runs once). Raises :class:`InputError`
    when two files share a ``name:``: their reports (reports/<name>/<version>/) would collide."""
    by_name: dict[str, tuple[Path, Scenario]] = {}
    seen: set[Path] = set()
    for p in paths:
        sc = load_scenario(p)  # first: a path that cannot be resolved is refused there
        key = Path(p).resolve()
        if key in seen:
            continue
        seen.add(key)
        if sc.name in by_name:
            raise InputError(f"{p}: name: {sc.name!r} is also the name of {by_name[sc.name][0]}; "
                             "reports/<name>/<version>/ would collide; rename one")
        by_name[sc.name] = (p, sc)
    return [sc for _, sc in by_name.values()]
