"""The check registry: every audit check declares what it finds and when it runs.

A check is one function ``fn(auditor, moment) -> list[Violation]`` registered with
:func:`check`: its name, the codes it can record (:data:`vllm_repro.audit.codes.CODES`), its
phase (:data:`PHASES`), the levels whose auditor runs it, what it needs of the release or the run
(capabilities, a KV connector, a book), and one sentence saying what it verifies. The auditors
(:class:`vllm_repro.audit.auditor.Auditor`, :class:`vllm_repro.audit.v0.V0Auditor`) run, at each
phase, the checks registered for it and their level, in registration order (the order decides
which violation of a step is recorded first, and so where a run stops). ``docs/audit.md``'s
tables of codes and checks are :func:`code_table`'s and :func:`doc_table`'s output
(``python -m vllm_repro.audit`` rewrites them; ``tests/unit/test_audit_registry.py``
fails when the page is out of date). The checks are registered when :mod:`vllm_repro.audit` is
imported: its ``__init__`` imports every module that registers.

Adding a check: write the function in ``audit/checks.py`` (V1 levels) or ``audit/v0.py``
(``v0-engine``), decorate it with :func:`check`, add its code to ``audit/codes.py`` if it is new,
regenerate the tables, write its test (docs/architecture.md, "Adding a check").

Runs inside release environments: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .codes import CODES

#: found inside a vLLM call, by a hook on the release's own object (BlockPool, RefCounter)
IN_CALL = "in a vLLM call"
#: after each ``schedule()`` (V0: each ``Scheduler.schedule``)
AFTER_SCHEDULE = "after schedule"
#: after each ``update_from_output()`` (V0: each ``LLMEngine.step``)
AFTER_UPDATE = "after update"
#: once, when the run ended (which checks run depends on the outcome: ``Check.outcomes``)
END_OF_RUN = "end of run"
PHASES = (IN_CALL, AFTER_SCHEDULE, AFTER_UPDATE, END_OF_RUN)

V1_LEVELS = ("scheduler", "engine-core")
V0_LEVELS = ("v0-engine",)

#: the check groups an unknown book turns off (``Auditor._guarded``), as ``audit.off`` names them
KV_BOOKS = "KV book checks"
REQUEST_CHECKS = "request checks"


@dataclass
class Moment:
    """What a check is given: the step, the scheduler output (``so``, None at the end of a run
    and at level v0-engine), what was scheduled, the step's trace line (after update), the
    run's outcome (end of run) and values the auditor worked out once for the step
    (``extra``: e.g. the requests preempted inside ``schedule()``)."""

    step: int
    phase: str = AFTER_SCHEDULE
    so: Any = None
    scheduled: Any = None
    line: Any = None
    outcome: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """One registered check (see the module docstring): run at each of its ``phases``.

    ``outcomes``: for :data:`END_OF_RUN` checks, the ends they run after (``clean``: the run
    finished every request and was not stopped; ``stall``; ``crash``). ``group``: the group an
    unknown attribute of the release's books turns off for the rest of the run (None: never
    turned off). ``run`` is None for checks that are hooks (:data:`IN_CALL`): installed by the
    auditor's ``attach``, listed here for the table."""

    name: str
    codes: tuple[str, ...]
    phases: tuple[str, ...]
    levels: tuple[str, ...]
    text: str
    needs: str = ""
    group: str | None = None
    outcomes: tuple[str, ...] = ()
    run: Callable | None = None


CHECKS: list[Check] = []


def check(name: str, *, codes: tuple[str, ...] | str, phase: tuple[str, ...] | str, text: str,
          levels: tuple[str, ...] = V1_LEVELS, needs: str = "", group: str | None = None,
          outcomes: tuple[str, ...] = ()) -> Callable:
    """Register the decorated function ``fn(auditor, moment) -> list[Violation]`` as a check.

    Raises :class:`ValueError` for an unknown code or phase, an end-of-run check without
    outcomes, or a name already registered."""
    codes = (codes,) if isinstance(codes, str) else tuple(codes)
    phases = (phase,) if isinstance(phase, str) else tuple(phase)

    def register(fn: Callable | None) -> Callable | None:
        add(Check(name, codes, phases, tuple(levels), text, needs, group, tuple(outcomes), fn))
        return fn

    for c in codes:
        if c not in CODES:
            raise ValueError(f"check {name!r}: unknown code {c!r} (add it to audit/codes.py)")
    return register


def add(c: Check) -> Check:
    """Register ``c`` (see :func:`check`)."""
    if not c.phases or set(c.phases) - set(PHASES):
        raise ValueError(f"check {c.name!r}: phases {c.phases!r} are not among {PHASES}")
    if END_OF_RUN in c.phases and not c.outcomes:
        raise ValueError(f"check {c.name!r}: an end-of-run check names its outcomes")
    if any(x.name == c.name for x in CHECKS):
        raise ValueError(f"check {c.name!r} is registered twice")
    CHECKS.append(c)
    return c


def checks_for(phase: str, level: str, outcome: str | None = None) -> list[Check]:
    """The registered checks of ``phase`` that ``level``'s auditor runs (for
    :data:`END_OF_RUN`, those of ``outcome``), in registration order."""
    return [c for c in CHECKS if phase in c.phases and level in c.levels and c.run is not None
            and (outcome is None or outcome in c.outcomes)]


def registered_codes() -> set[str]:
    """Every code some registered check can record."""
    return {code for c in CHECKS for code in c.codes}


def doc_table() -> str:
    """``docs/audit.md``'s table of checks (markdown), from the registry: one row per check."""
    rows = ["| check | codes | phase | levels | needs | what it verifies |",
            "| --- | --- | --- | --- | --- | --- |"]
    for c in CHECKS:
        phase = ", ".join(c.phases) + (f" ({', '.join(c.outcomes)})" if c.outcomes else "")
        rows.append(f"| {c.name} | {', '.join(f'`{x}`' for x in c.codes)} | {phase} | "
                    f"{', '.join(c.levels)} | {c.needs or '-'} | {c.text} |")
    return "\n".join(rows) + "\n"


def code_table() -> str:
    """``docs/audit.md``'s table of codes (markdown), from :data:`~vllm_repro.audit.codes.CODES`."""
    rows = ["| code | the invariant that broke |", "| --- | --- |"]
    rows += [f"| `{code}` | {text} |" for code, text in CODES.items()]
    return "\n".join(rows) + "\n"


#: the markers around the generated tables in docs/audit.md
CODES_BEGIN, CODES_END = "<!-- codes: generated by vllm_repro.audit.registry -->", "<!-- /codes -->"
CHECKS_BEGIN, CHECKS_END = "<!-- checks: generated by vllm_repro.audit.registry -->", "<!-- /checks -->"


def render_page(text: str) -> str:
    """``docs/audit.md``'s text with both generated tables replaced by the registry's.
    Raises :class:`ValueError` when a marker is missing."""
    for begin, end, table in ((CODES_BEGIN, CODES_END, code_table()),
                              (CHECKS_BEGIN, CHECKS_END, doc_table())):
        head, sep, rest = text.partition(begin)
        if not sep:
            raise ValueError(f"docs/audit.md has no {begin} marker")
        _, sep2, tail = rest.partition(end)
        if not sep2:
            raise ValueError(f"docs/audit.md has no {end} marker")
        text = head + begin + "\n" + table + end + tail
    return text

