"""The seeds' scheduler state line, printed whenever the state changes.

``[SCHED] step=3 waiting=[L] running=[H] preempted=[L] free_blocks=0`` from ``trace.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def _ids(xs) -> str:
    return "[" + ",".join(xs or []) + "]"


def sched_log_lines(trace: Path) -> Iterator[str]:
    """One line per step whose waiting / running / preempted / free-block state differs from the
    previous step's, plus the step that crashed or broke an invariant."""
    last = None
    with open(trace) as f:
        for raw in f:
            line = json.loads(raw)
            state = (tuple(line.get("waiting") or ()), tuple(line.get("running") or ()),
                     tuple(line.get("preempted") or ()), line.get("free_blocks"))
            marker = ""
            if line.get("crash"):
                c = line["crash"]
                marker = f" CRASH {c['type']} in {c['phase']}"
            elif line.get("violations"):
                marker = " VIOLATION " + ",".join(v["code"] for v in line["violations"])
            if state != last or marker:
                yield (f"[SCHED] step={line['step']} waiting={_ids(state[0])} running={_ids(state[1])} "
                       f"preempted={_ids(state[2])} free_blocks={state[3]}{marker}")
            last = state
