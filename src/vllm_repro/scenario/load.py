"""Load a scenario file: YAML -> :class:`~vllm_repro.scenario.schema.Scenario`.

Every failure is an :class:`~vllm_repro.errors.InputError` whose one-line message names the file,
the field (``requests[1].prompt_len``) and what to do.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic import ValidationError

from ..errors import InputError
from ..inputs import load_yaml, read_text
from ..engine.engine_args import yaml_word
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


def _choices(err: dict) -> list[str]:
    """The values a ``literal_error`` / ``enum`` error allows (pydantic's ``ctx.expected``:
    ``'scheduler', 'engine-core' or 'v0-engine'``)."""
    import re

    return re.findall(r"'([^']*)'", str((err.get("ctx") or {}).get("expected", "")))


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
    if kind in ("literal_error", "enum"):
        from .schema import close_field

        near = close_field(err.get("input"), _choices(err), cutoff=0.6) \
            if isinstance(err.get("input"), str) else None
        return f"did you mean {near!r}?" if near else "use one of the values listed"
    if kind == "finite_number":
        return "write a finite number (not .nan or .inf)"
    if kind == "string_type":
        got = err.get("input")
        if got is None or isinstance(got, (bool, int, float)):
            # YAML read 1, 1.5, true or null: the same text in quotes is the string
            return f'write it in quotes ("{yaml_word(got)}") so YAML reads it as a string'
        return "write a string value"
    if kind.startswith("bool_"):
        return "write true or false (no quotes)"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "write a whole number (no quotes)"
    if kind.endswith("_type"):
        plain = kind.removesuffix('_type').replace('_', ' ')
        return f"write a plain {plain} value (no quotes, no true/false for numbers)"
    return ""


@functools.cache
def _field_homes() -> dict[str, list[str]]:
    """Every field name of the scenario format (the candidates a misspelling is matched to),
    with where it lives, as dotted paths from the scenario's top level (``issue`` ->
    ``["vllm.issue"]``, ``prompt_len`` -> ``["requests[].prompt_len"]``): for a field written
    at the wrong level, the fix is where it goes, not its own name."""
    import typing

    from pydantic import BaseModel

    def models(tp) -> list[type]:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return [tp]
        return [m for a in typing.get_args(tp) for m in models(a)]

    homes: dict[str, list[str]] = {}
    todo: list[tuple[type, str]] = [(Scenario, "")]
    seen: set[type] = set()
    while todo:
        model, prefix = todo.pop(0)
        if model in seen:
            continue
        seen.add(model)
        for fname, f in model.model_fields.items():
            path = f"{prefix}{fname}"
            homes.setdefault(fname, []).append(path)
            listy = typing.get_origin(f.annotation) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(f.annotation))
            todo += [(m, f"{path}{'[]' if listy else ''}.") for m in models(f.annotation)]
    return homes


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
        near = close_field(loc[-1], _field_homes().keys())
        if near:
            return e, near, None
    return None


#: the problems of one scenario listed, at most (a generated file may have thousands)
MAX_LISTED = 20


def _line(path: str | Path, err: dict, msg: str | None = None, hint: str | None = None) -> str:
    """One problem on one line: ``FILE: FIELD: problem; fix`` (``msg`` and ``hint`` replace
    the error's own where given)."""
    if msg is None:
        msg = {"extra_forbidden": "unknown field", "missing": "missing required field"}.get(
            err.get("type", ""), err.get("msg", "invalid").removeprefix("Value error, "))
    hint = hint if hint is not None else _fix_hint(err)
    loc = _loc(tuple(err.get("loc", ())))
    # a validator's message that names its own field (config.num_gpu_blocks: ...) stands alone
    head = f"{path}: {loc}: " if loc and not msg.startswith((loc + ".", loc + ":")) \
        else f"{path}: "
    return head + msg + (f"; {hint}" if hint else "")


def validation_lines(path: str | Path, exc: ValidationError) -> list[str]:
    """Every problem of a scenario, one line each (``FILE: FIELD: problem; fix``), in
    pydantic's order, at most :data:`MAX_LISTED` and then a line counting the rest. An unknown
    field that misspells a field of the format (``promt_len``) comes first, with the field it
    likely means (and without the "missing" error of that field, when it is the one meant); a
    value outside a field's choices (``level: v0-engin``) names the nearest choice."""
    errs = list(exc.errors())
    lines = []
    typo = _typo(errs)
    if typo is not None:
        err, near, required = typo
        homes = _field_homes()[near] if near == tuple(err.get("loc", ()))[-1] else []
        if homes:  # a field of the format, at the wrong level
            lines.append(_line(path, err, f"not a field here; {near} goes under "
                               + " or ".join(h.rsplit(".", 1)[0] + ":" for h in homes)
                               + f" ({', '.join(homes)})", ""))
        else:
            lines.append(_line(path, err, f"unknown field; did you mean {near}?"
                               + (f" ({near} is required)" if required else ""), ""))
        errs = [e for e in errs if e is not err and not (
            required and e.get("type") == "missing" and tuple(e.get("loc", ()))[-1] == required)]
    lines.extend(_line(path, e) for e in errs)
    if len(lines) > MAX_LISTED:
        rest = len(lines) - MAX_LISTED
        lines = lines[:MAX_LISTED] + [f"{path}: ... and {rest} more problem(s) like these; fix "
                                      "the ones above and validate it again"]
    return lines


def parse_scenario(data: object, source: str | Path = "<scenario>") -> Scenario:
    """Validate already-parsed YAML/JSON data. Raises :class:`InputError`."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: the file must hold a mapping (name:, config:, requests: ...)")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        first, *more = validation_lines(source, exc)
        raise InputError(first, more) from None
    except RecursionError:
        raise InputError(f"{source}: nested too deep to validate; flatten it") from None


#: a scenario longer than this (characters) gets a progress line before it is read
LONG_LOAD_CHARS = 1_000_000


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file through the loading layer (:mod:`vllm_repro.inputs`).
    Raises :class:`InputError` for a missing, unreadable, oversized or non-UTF-8 file, invalid
    or too deeply nested YAML, or any schema violation."""
    p = Path(path)
    text = read_text(p, "scenario file", "give a scenario file such as scenarios/<name>.yaml")
    crash_log = InputError(f"{p}: a crash log, not a scenario file; read it with `vllm-repro "
                           f"triage {p}` (with `--scenario FILE.yaml` to draft a replay from its "
                           "crash dump)")
    if len(text) > LONG_LOAD_CHARS:  # seconds of YAML and validation: say so first
        from ..console import say

        say(f"{p}: reading {len(text) / 1e6:.1f} MB of YAML ...")
    try:
        data = load_yaml(text, p)
    except InputError as exc:
        if _looks_like_a_crash_log(p, text):
            raise crash_log from exc
        raise
    # (a log line such as "ERROR 01-01 engine.py: x" reads as a one-key mapping)
    if not (isinstance(data, dict) and _SCENARIO_KEYS & set(map(str, data))) \
            and _looks_like_a_crash_log(p, text):
        raise crash_log
    scenario = parse_scenario(data, p)
    scenario._source_text = text
    scenario._source_path = str(p)
    return scenario


#: top-level keys of which a scenario has some and a crash log that YAML reads as a mapping none
_SCENARIO_KEYS = {"name", "requests", "config", "vllm", "level", "expect", "events"}


def _looks_like_a_crash_log(path: Path, text: str) -> bool:
    """A file given as a scenario that is a vLLM crash log (a Python traceback, or named
    ``.log``): its YAML error would not say what to do with it."""
    return path.suffix in (".log", ".txt") or "Traceback (most recent call last)" in text


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
