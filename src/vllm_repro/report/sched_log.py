"""The seeds' scheduler state line, printed whenever the state changes.

``[SCHED] step=3 waiting=[L] running=[H] preempted=[L] free_blocks=0`` from ``trace.jsonl``;
a step where the audit found a violation is always printed, followed by one
``[AUDIT] step=3 REQ_STATE (after schedule): L is in num_scheduled_tokens ...`` line per finding;
a run that stalled ends with ``[SCHED] STALL at step 28, no progress since step 9: huge in
waiting, needs 64 KV blocks ...`` (the run's :class:`~vllm_repro.records.Stall`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..records import TraceLine


def _ids(xs) -> str:
    return "[" + ",".join(xs or []) + "]"


def sched_log_lines(trace: Path, stall=None) -> Iterator[str]:
    """One line per step whose waiting / running / preempted / free-block state differs from the
    previous step's, plus the step that crashed or broke an invariant (with an ``[AUDIT]`` line
    per violation found at that step); with ``stall`` (the result's
    :class:`~vllm_repro.records.Stall`), a last ``[SCHED] STALL`` line saying where the requests
    are stuck."""
    last = None
    with open(trace, encoding="utf-8", errors="replace") as f:
        for raw in f:
            if not raw.strip():
                continue
            line = TraceLine.from_json(raw)
            state = (tuple(line.waiting or ()), tuple(line.running or ()),
                     tuple(line.preempted or ()), line.free_blocks)
            marker = ""
            if line.crash:
                marker = f" CRASH {line.crash.type} in {line.crash.phase}"
            vs = line.violations or []
            if vs and not marker:
                marker = " VIOLATION " + ",".join(dict.fromkeys(v.code for v in vs))
            if state != last or marker:
                yield (f"[SCHED] step={line.step} waiting={_ids(state[0])} running={_ids(state[1])} "
                       f"preempted={_ids(state[2])} free_blocks={state[3]}{marker}")
                for v in vs:
                    where = f" ({v.phase})" if v.phase else ""
                    yield f"[AUDIT] step={line.step} {v.code}{where}: {v.message}"
            last = state
    if stall is not None:
        why = f": {stall.message}" if getattr(stall, "message", None) else ""
        yield (f"[SCHED] STALL at step {stall.step}, no progress since step {stall.since}"
               f"{why}")
