"""``vllm-repro triage LOG --replay``: draft a scenario from vLLM's crash dump, run it on the
logged release, and compare the replay's last step with the dumped batch.

vLLM's ``dump_engine_exception`` (``vllm/logging_utils/dump_input.py``) logs the crashed step's
``SchedulerOutput`` and ``SchedulerStats``; :mod:`vllm_repro.triage.scenario` drafts a scenario
that rebuilds that batch. The replay runs it through the lab (:func:`vllm_repro.lab.run_pairs`,
vLLM's real code of that release) and :func:`compare` sets what the dump says next to what the
replay's last trace line and result show, field by field: the exception and its innermost vLLM
frame, the requests and tokens of the batch, the queues, the KV cache usage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..records import RunResult, TraceLine
from .analyze import TriageReport
from .dump import SchedulerOutputDump, read_scheduler_output, read_stats


@dataclass
class ReplayRow:
    """One compared field: what the log's dump says, what the replay shows, and whether they
    agree (``None``: one side does not say)."""

    field: str
    dumped: Any
    replayed: Any
    agree: bool | None


@dataclass
class ReplayReport:
    """A replay: the drafted ``scenario`` file, the ``release`` it ran on, the verdict's
    ``observed`` text and ``outcome``, whether the replay raised the log's exception
    (``reproduced``: same exception type and innermost vLLM frame), the comparison ``rows`` and
    the report folder of the run (which also holds it as ``replay.json``)."""

    scenario: str
    release: str
    outcome: str
    observed: str
    reproduced: bool
    rows: list[ReplayRow] = field(default_factory=list)
    report_dir: str | None = None
    exit_code: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _row(name: str, dumped: Any, replayed: Any) -> ReplayRow:
    agree = None if dumped is None or replayed is None else dumped == replayed
    return ReplayRow(name, dumped, replayed, agree)


def _usage_pct(line: TraceLine | None, result: RunResult) -> float | None:
    """The replay's KV cache usage at its last step, in percent of the usable blocks (the
    null block left out, as vLLM's ``BlockPool.get_usage`` does)."""
    if line is None:
        return None
    audit = line.audit or {}
    total = audit.get("total") or (result.engine.num_gpu_blocks if result.engine else None)
    free = line.free_blocks if line.free_blocks is not None else audit.get("free")
    if not total or free is None or total <= 1:
        return None
    return round((1 - free / (total - 1)) * 100, 1)


def compare(report: TriageReport, so: SchedulerOutputDump | None, stats: dict | None,
            result: RunResult, trace: list[TraceLine]) -> list[ReplayRow]:
    """The comparison table: dumped (the log) against replayed (the run's result and one trace
    line: the step that crashed, or, when the replay did not crash, its fullest batch: the first
    step with the most requests scheduled, which is where the draft rebuilds the dumped batch)."""
    crash = result.crash
    last = trace[-1] if trace else None
    if last is not None and not crash:
        last = max(trace, key=lambda ln: (len(ln.scheduled or {}), sum((ln.scheduled or {}).values()),
                                          -ln.step))
    frame = report.last_vllm_frame
    rows = [
        ReplayRow("step compared", "the crashed step",
                  f"{last.step} ({'the crash' if crash else 'the fullest batch'})" if last else None,
                  None),
        _row("exception", report.exception_type, crash.type if crash else result.outcome),
        _row("innermost vLLM frame", f"{frame['module']}:{frame['function']}" if frame else None,
             crash.where.where() if crash and crash.where else None),
    ]
    scheduled = (last.scheduled or {}) if last is not None else {}
    if so is not None:
        rows.append(_row("requests in the batch", len(so.requests), len(scheduled) if last else None))
        rows.append(_row("new requests in the batch", sum(1 for r in so.requests if r.new),
                         len(last.added or []) if last else None))
        rows.append(_row("total_num_scheduled_tokens", so.total_num_scheduled_tokens,
                         sum(scheduled.values()) if last else None))
    if stats:
        rows.append(_row("running", stats.get("running"),
                         len(last.running) if last and last.running is not None else None))
        rows.append(_row("waiting", stats.get("waiting"),
                         len(last.waiting) if last and last.waiting is not None else None))
        rows.append(_row("KV cache usage %", stats.get("kv_cache_usage_pct"), _usage_pct(last, result)))
    return rows


def replay(report: TriageReport, sc, *, version: str | None, reports: Path, scenario_path: Path,
           say: Callable[[str], None] = lambda s: None) -> ReplayReport:
    """Draft the scenario into ``scenario_path``, run it on ``version`` (default: the logged
    release) with its report under ``reports``, and compare. Raises
    :class:`~vllm_repro.errors.InputError` when no scenario can be drafted (no dump, no
    release) and what :func:`vllm_repro.lab.run_pairs` raises."""
    from ..lab import RunItem, run_pairs
    from ..records import read_trace
    from ..scenario import load_scenario
    from ..verdict import exit_code
    from .core import write_draft
    from .scenario import draft_release, draft_scenario

    text, _ = draft_scenario(report, sc, version=version)
    write_draft(scenario_path, text)
    scenario = load_scenario(scenario_path)
    release = draft_release(report, version)
    (item,) = run_pairs([RunItem(scenario, release)], reports, jobs=1, say=say)
    result = item.result
    trace = []
    if item.report is not None and item.report.trace_path.is_file():
        trace = read_trace(item.report.trace_path)
    dump = sc.dump
    so = read_scheduler_output(dump.scheduler_output) if dump and dump.scheduler_output else None
    stats = read_stats(dump.stats) if dump and dump.stats else None
    rows = compare(report, so, stats, result, trace)
    reproduced = bool(result.crash and rows[1].agree and rows[2].agree is not False)
    rep = ReplayReport(str(scenario_path), release, result.outcome, item.verdict.observed,
                       reproduced, rows, str(item.report_dir) if item.report_dir else None,
                       exit_code([item.verdict]))
    if item.report_dir is not None and item.report_dir.is_dir():
        (item.report_dir / "replay.json").write_text(json.dumps(rep.as_dict(), indent=1, default=str))
    return rep


__all__ = ["ReplayRow", "ReplayReport", "compare", "replay"]
