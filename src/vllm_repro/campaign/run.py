"""The campaign's driver: its folder, resuming, dispatching the tasks, merging.

A campaign's folder (``--out``, default ``<reports>/_campaign/<campaign id>``) holds
``spec.json`` (the :class:`~vllm_repro.campaign.spec.CampaignSpec`), ``tasks/<release>-seed<N>.json``
(one :class:`~vllm_repro.records.CampaignTaskResult` each, written as each task ends),
``logs/`` (the engine workers' logs, where the task ran), and at the end ``campaign.json``,
``heatmap.png`` and ``findings/``. Run again with the same options, a campaign resumes: tasks
with a record ``done`` or ``refused`` are not run again; ``error`` ones (and those never
finished: interrupted) are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from ..records import CampaignReport, CampaignTaskResult, RecordError
from .spec import CampaignSpec

#: statuses a resumed campaign keeps (an ``error`` task is run again)
KEPT = ("done", "refused")


def task_path(folder: Path, release: str, seed: int) -> Path:
    return folder / "tasks" / f"{release}-seed{seed}.json"


def open_folder(folder: Path, spec: CampaignSpec) -> None:
    """Make ``folder`` the campaign's (``spec.json``). Raises InputError when it holds another
    campaign's spec."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tasks").mkdir(exist_ok=True)
    path = folder / "spec.json"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
        if old != spec.to_dict():
            raise InputError(f"{folder}: holds another campaign (spec.json differs from these "
                             "options); give --out another folder, or remove it to start over")
        return
    path.write_text(json.dumps(spec.to_dict(), indent=1, sort_keys=True) + "\n")


def load_done(folder: Path, releases: list[str], seeds: list[int]) -> dict[tuple[str, int], CampaignTaskResult]:
    """The task records already in ``folder`` that a resume keeps (status in :data:`KEPT`),
    for the matrix's (release, seed) pairs; an unreadable record is run again."""
    out = {}
    for r in releases:
        for s in seeds:
            p = task_path(folder, r, s)
            if not p.is_file():
                continue
            try:
                rec = CampaignTaskResult.from_json(p.read_text())
            except (OSError, RecordError):
                continue
            if rec.status in KEPT:
                out[(r, s)] = rec
    return out


def save_task(folder: Path, rec: CampaignTaskResult) -> None:
    """Write one task's record (whole, then renamed into place: an interrupt never leaves half
    a record that a resume would trust)."""
    p = task_path(folder, rec.release, rec.seed)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(rec.to_json(indent=1) + "\n")
    tmp.replace(p)


def task_order(releases: list[str], seeds: list[int], slots: int) -> list[tuple[str, int]]:
    """Every (release, seed), in the order they are handed out: releases in blocks of
    ``slots``, and within a block seed by seed (``r0 s0, r1 s0, r0 s1, r1 s1, r2 s0 ...`` for two
    slots), so that the slot that ran a release's seed is the next free one when that release's
    next seed comes up, and reuses its engine worker (``campaign/task.py``). Order changes no
    result, only how often vLLM is imported."""
    out = []
    for i in range(0, len(releases), max(1, slots)):
        block = releases[i:i + max(1, slots)]
        out += [(r, s) for s in seeds for r in block]
    return out


@dataclass
class Progress:
    """What the driver tells its ``on_event`` callback: tasks ``total``, ``skipped`` (kept from
    an earlier run), ``finished`` so far, the last task's record."""

    total: int
    skipped: int
    finished: int = 0
    last: CampaignTaskResult | None = None
    findings: set = field(default_factory=set)


def run_campaign(spec: CampaignSpec, releases: list[str], folder: Path, executor,
                 on_event: Callable[[Progress], None] = lambda p: None) -> CampaignReport:
    """Run the (release, seed) tasks not done yet on ``executor``
    (:mod:`vllm_repro.task_executor`), saving each record as it ends, and merge every record into
    the campaign's report (written to ``folder``: ``campaign.json``, ``heatmap.png``,
    ``findings/``). Returns the report."""
    from .report import heatmap, merge, write_report, write_scenarios
    from .task import run_task

    open_folder(folder, spec)
    seeds = list(spec.seeds)
    done = load_done(folder, releases, seeds)
    todo = [t for t in task_order(releases, seeds, executor.slots) if t not in done]
    prog = Progress(total=len(releases) * len(seeds), skipped=len(done))
    for rec in done.values():
        prog.findings |= {f.signature for f in rec.findings}
    on_event(prog)
    log_dir = str((folder / "logs").resolve())
    args = [{"spec": spec.to_dict(), "release": r, "seed": s, "log_dir": log_dir} for r, s in todo]
    for i, outcome in executor.run(run_task, args):
        release, seed = todo[i]
        if outcome.error is not None:
            rec = CampaignTaskResult(release=release, seed=seed, status="error",
                                     message=f"the task's process failed: {outcome.error.splitlines()[0]}")
        else:
            rec = CampaignTaskResult.from_dict(outcome.value)
        save_task(folder, rec)
        done[(release, seed)] = rec
        prog.finished += 1
        prog.last = rec
        prog.findings |= {f.signature for f in rec.findings}
        on_event(prog)
    report = merge(spec.to_dict(), releases, seeds, list(done.values()))
    report.backend = executor.name
    write_scenarios(report, folder)
    try:
        heatmap(report, folder / "heatmap.png")
    except ModuleNotFoundError:  # no plots extra: campaign.json and the table say it all
        pass
    write_report(report, folder)
    return report
