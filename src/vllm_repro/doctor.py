"""``vllm-repro doctor VERSION...``: does the lab run this release, seam by seam?

A fixed smoke set (:data:`SMOKE`: the flagship, a stress workload at each level, async
scheduling at both levels, spec decode, prefix caching, hybrid KV cache groups, partial-block
prefix hashes, structured outputs, a KV connector, the V0 engine) runs on each release through
:func:`vllm_repro.lab.run_pairs`, as ``run`` runs it, and each row reads:

- ``works``: the run finished with the whole audit on and nothing found;
- ``degraded``: it finished, but part of the audit could not run on the release (the
  capabilities record's ``audit_off``: e.g. ``KV hash checks off``);
- ``n/a``: the release lacks the mode (its :class:`~vllm_repro.engine.capabilities.Capabilities`
  say why: no V0 engine on 0.34, no engine-core level on 0.7), or refuses a field the workload
  needs (the release's own words); not a failure;
- ``finding``: the run finished but observed something other than ``clean`` on a workload that
  is clean on the releases it names (vLLM's own bug, or a seam the lab misreads: the report says
  which); the flagship is judged by its catalog expectation instead;
- ``fails``: a lab or environment error, with the seam it broke in (:func:`seam_of`: the lab
  file of the traceback's last lab frame).

Exit 0 only when every row works (or is n/a); 3 when a row fails; else 1. The smoke workloads are the repository's own
scenario files (``scenarios/``, see :data:`SMOKE`), overlaid with the row's level and fields.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import EXIT_ENV, EXIT_MISMATCH, EXIT_OK, InputError
from .scenario.schema import Scenario

Say = Callable[[str], None]

FLAGSHIP = "vllm-23347-priority-preempt-scheduled.yaml"

#: (mode, scenario file under the scenarios folder, None for :data:`STRUCTURED` or
#: ``partial`` for :data:`PARTIAL`, overlay:
#: top-level fields, ``config`` fields and ``matrix_mode`` (the release matrix's overlay,
#: :func:`vllm_repro.matrix.mode_scenario`: ``spec`` drafts 2 tokens a step, all accepted),
#: what the mode needs of the release: Capabilities features / generations, or ``structured
#: outputs``)
SMOKE: tuple[tuple[str, str | None, dict, tuple[str, ...]], ...] = (
    ("flagship (scheduler)", FLAGSHIP, {}, ("v1-engine", "priority")),
    ("stress, prefix caching (scheduler)", "stress/stress-fcfs-cache.yaml", {}, ("v1-engine",)),
    ("stress (engine-core)", "stress/stress-fcfs-nocache.yaml", {"level": "engine-core"},
     ("v1-engine", "engine-core")),
    ("async scheduling (scheduler)", "stress/stress-fcfs-cache.yaml",
     {"config": {"async_scheduling": True}}, ("v1-engine", "async scheduling")),
    ("async scheduling (engine-core)", "stress/stress-fcfs-nocache.yaml",
     {"level": "engine-core", "config": {"async_scheduling": True}},
     ("v1-engine", "engine-core", "async scheduling")),
    ("spec decode (scheduler)", "stress/stress-fcfs-nocache.yaml", {"matrix_mode": "spec"},
     ("v1-engine", "spec decode")),
    ("prefix caching (engine-core)", "stress/stress-fcfs-cache.yaml", {"level": "engine-core"},
     ("v1-engine", "engine-core")),
    ("hybrid kv cache groups", "stress/stress-fcfs-hybrid.yaml", {},
     ("v1-engine", "kv cache groups")),
    ("partial-block prefix hashes (engine-core)", "partial", {},
     ("v1-engine", "engine-core", "kv cache groups")),
    ("structured outputs (engine-core)", None, {}, ("v1-engine", "engine-core",
                                                    "structured outputs")),
    ("kv connector (engine-core)", "stress/stress-kv-connector.yaml", {},
     ("v1-engine", "engine-core", "kv connectors")),
    ("engine core process (engine-core)", "stress/stress-fcfs-nocache.yaml",
     {"level": "engine-core", "config": {"multiprocess_mode": True}},
     ("v1-engine", "engine-core", "engine core process")),
    ("data parallel engine cores (engine-core)", "topology/dp2-engine-core-proc.yaml", {},
     ("v1-engine", "engine-core", "engine core process", "data parallel engine cores")),
    ("reasoning parser (engine-core)", "reasoning/grammar-after-think.yaml", {},
     ("v1-engine", "engine-core", "structured outputs", "reasoning parser")),
    ("EAGLE drafter (scheduler)", "stress/stress-fcfs-nocache.yaml",
     {"matrix_mode": "spec", "config": {"speculative_method": "eagle", "num_speculative_tokens": 2}},
     ("v1-engine", "spec decode")),
    ("V0 engine", "stress/stress-fcfs-nocache.yaml", {"level": "v0-engine"}, ("v0-engine",)),
)

#: the structured-outputs row: two JSON-object requests through the release's own
#: StructuredOutputManager, sampled through its bitmask by the fake worker
STRUCTURED = {
    "level": "engine-core",
    "config": {"block_size": 16, "num_gpu_blocks": 64, "max_num_seqs": 4,
               "max_num_batched_tokens": 256, "max_model_len": 256},
    "requests": [
        {"id": "A", "at_step": 1, "prompt_len": 20, "max_tokens": 16,
         "structured_outputs": {"json": {"type": "object"}}},
        {"id": "B", "at_step": 3, "prompt_len": 20, "max_tokens": 16,
         "structured_outputs": {"json": {"type": "object"}}},
    ],
    "limits": {"max_steps": 60, "stall_steps": 20},
}

#: the partial-block prefix hashes row: a full-attention group of 16-token blocks beside a Mamba
#: group of 64 (align mode) and ``prefix_match_unit: 8`` (vLLM's CacheConfig field, 0.33+):
#: prefix hashes every 8 tokens, so a prompt whose last boundary falls inside a 16-token block
#: gets a partial entry there (``FullAttentionManager._cache_partial_tail_block``,
#: ``KVCacheBlock.block_hash_num_tokens``), and later prompts hit it
PARTIAL = {
    "level": "engine-core",
    "config": {"block_size": 16, "num_gpu_blocks": 200, "max_num_seqs": 8,
               "max_num_batched_tokens": 256, "max_model_len": 1024,
               "enable_prefix_caching": True, "mamba_cache_mode": "align",
               "prefix_match_unit": 8,
               "kv_cache_groups": [{"type": "full"}, {"type": "mamba", "block_size": 64}]},
    "requests": [
        {"id": "A", "at_step": 1, "prompt_len": 100, "max_tokens": 8, "prefix": "p",
         "prefix_len": 96},
        {"id": "B", "at_step": 6, "prompt_len": 110, "max_tokens": 8, "prefix": "p",
         "prefix_len": 96},
        {"id": "C", "at_step": 12, "prompt_len": 75, "max_tokens": 8, "prefix": "p",
         "prefix_len": 72},
        {"id": "D", "at_step": 18, "prompt_len": 130, "max_tokens": 8, "prefix": "p",
         "prefix_len": 96},
    ],
    "limits": {"max_steps": 200},
}

#: a lab file -> the seam it is (what to read and change when a release breaks it)
SEAMS = (
    ("audit/", "the audit's books (audit/books.py, audit/checks.py; engine/state.py reads "
               "the release's objects)"),
    ("engine/fake_executor.py", "the fake worker (engine/fake_executor.py FakeWorker)"),
    ("engine/core_loop.py", "the engine-core loop (engine/core_loop.py)"),
    ("engine/adapter/capability_probes.py",
     "the capabilities probe (engine/adapter/capability_probes.py)"),
    ("engine/adapter/", "the adapter (engine/adapter/)"),
    ("engine/state.py", "the scheduler state reader (engine/state.py)"),
    ("engine/v0.py", "the V0 adapter (engine/v0.py)"),
    ("engine/capabilities.py", "the capabilities record (engine/capabilities.py)"),
    ("engine/connector.py", "the scripted KV connector (engine/connector.py)"),
    ("engine/kv_worker.py", "the KV connector's worker half (engine/kv_worker.py)"),
    ("engine/", "the engine worker (engine/)"),
)


@dataclass
class DoctorRow:
    """One smoke row on one release: ``status`` ``works`` / ``degraded`` / ``n/a`` / ``finding``
    / ``fails``,
    ``detail`` its one line (what is degraded, why n/a, the seam and the error), ``seconds``
    the run's wall time (None where nothing ran), ``report`` its report folder."""

    release: str
    mode: str
    status: str
    detail: str = ""
    seconds: float | None = None
    report: str | None = None


@dataclass
class DoctorReport:
    """The rows of every release, and the whole wall time in seconds."""

    rows: list[DoctorRow] = field(default_factory=list)
    seconds: float = 0.0

    def exit_code(self) -> int:
        """0 when every row works or is n/a; 3 when one fails (the lab cannot run the mode);
        else 1 (a row degraded, or a finding where the workload is clean elsewhere)."""
        if any(r.status == "fails" for r in self.rows):
            return EXIT_ENV
        return EXIT_OK if all(r.status in ("works", "n/a") for r in self.rows) else EXIT_MISMATCH


def smoke_scenarios(directory: Path) -> list[tuple[str, Scenario, tuple[str, ...]]]:
    """``(mode, scenario, needs)`` of :data:`SMOKE`, read from ``directory`` (the scenarios
    folder) and overlaid; each named ``doctor-<n>-<file stem>`` and expecting nothing (the
    row's status is the doctor's, not a verdict). Raises :class:`InputError` naming a missing
    file."""
    from .inputs import load_yaml, read_text

    if not directory.is_dir():
        raise InputError(f"--directory {directory}: not a folder; give the repository's "
                         "scenarios/ folder (the smoke set's workloads)")
    out = []
    for n, (mode, rel, overlay, needs) in enumerate(SMOKE, 1):
        if rel is None:
            d = {"name": "structured-outputs", **STRUCTURED}
        elif rel == "partial":
            d = {"name": "partial-block-hashes", **PARTIAL}
        else:
            path = directory / rel
            if not path.is_file():
                raise InputError(f"--directory {directory}: no {rel} there; the smoke set reads "
                                 "the repository's scenarios/ folder: give it as --directory")
            d = load_yaml(read_text(path, "scenario", "give --directory"), path)
        d = {**d, **{k: v for k, v in overlay.items() if k not in ("config", "matrix_mode")}}
        d["config"] = {**d.get("config", {}), **overlay.get("config", {})}
        d["name"] = f"doctor-{n:02d}-{d['name']}"
        d.pop("description", None)
        if rel != FLAGSHIP:  # (the flagship keeps its catalog expectation, judged as `run` does)
            d["vllm"] = {}
            d.pop("expect", None)
            d.pop("fixed", None)
        sc = Scenario.model_validate(d)
        if overlay.get("matrix_mode"):
            from .matrix import mode_scenario

            sc = mode_scenario(sc, overlay["matrix_mode"]) or sc
        out.append((mode, sc, needs))
    return out


def seam_of(error_message: str, traceback: str | None) -> str:
    """The seam a lab error broke in: the :data:`SEAMS` entry of the last lab file in the
    traceback (``vllm_repro/<file>``), else of the message's ``Class.method`` / worker call."""
    if "worker call" in error_message:
        return dict(SEAMS)["engine/fake_executor.py"]
    files = re.findall(r"vllm_repro/([\w/]+\.py)", traceback or "")
    for f in reversed(files):
        for prefix, seam in SEAMS:
            if f.startswith(prefix):
                return seam
    if error_message.startswith(("Auditor.", "PoolHooks.")):
        return dict(SEAMS)["audit/"]
    return "the lab (see result.json's error.traceback)"


def row_of(version: str, mode: str, needs: tuple[str, ...], item, caps) -> DoctorRow:
    """The row of one smoke run (``item``: a :class:`~vllm_repro.lab.RunItem` after
    :func:`~vllm_repro.lab.run_pairs`; ``caps``: the release's capabilities record, None where
    the worker never started). A run the release refused (an input error: a field or report
    it lacks) is ``n/a`` with the release's words; the flagship, a catalog entry, is judged by
    its own expectation where its ranges name the release (``works`` when ``run`` says ok)."""
    from .verdict import describe_observed

    res = item.result
    report = str(item.report_dir) if item.report_dir is not None else None
    t = res.timing if res is not None else None
    secs = round((t.build_s or 0) + (t.run_s or 0), 1) if t is not None else None
    if caps is not None:
        for need in needs:
            if need == "structured outputs":
                why = None if caps.structured_outputs else \
                    f"vLLM {version} has no V1 StructuredOutputManager (vllm/v1/structured_output)"
            else:
                why = caps.refusal(need)
            if why:
                return DoctorRow(version, mode, "n/a", why, None, None)
    if res is None:
        return DoctorRow(version, mode, "fails", "the run never started", None, report)
    if res.outcome == "error":
        err = res.error
        msg = " ".join((err.message if err else "unknown").split())
        if err is not None and err.kind == "input":
            return DoctorRow(version, mode, "n/a", f"the release refuses it: {msg}", secs, report)
        if err is not None and err.kind == "env":
            return DoctorRow(version, mode, "fails", f"environment: {msg}", secs, report)
        return DoctorRow(version, mode, "fails",
                         f"{seam_of(msg, err.traceback if err else None)}: {msg}", secs, report)
    observed = describe_observed(res)
    off = res.audit.off if res.audit is not None else []
    if off:
        return DoctorRow(version, mode, "degraded", "; ".join(off), secs, report)
    verdict = getattr(item, "verdict", None)
    if item.scenario.expect is not None and verdict is not None \
            and item.scenario.vllm.expectation_for(version) is not None:
        if verdict.ok:
            also = f" (+{len(verdict.also)} audit finding(s) outside its bug)" if verdict.also \
                else ""
            return DoctorRow(version, mode, "works", f"as the catalog expects: {observed}{also}",
                             secs, report)
        return DoctorRow(version, mode, "finding", f"observed {observed}, expected "
                         f"{verdict.expected}: {verdict.reason}", secs, report)
    if res.outcome != "clean":
        return DoctorRow(version, mode, "finding", f"observed {observed} on a workload clean on "
                         "the releases it names (vLLM's bug, or a seam the lab misreads: see the "
                         "report)", secs, report)
    return DoctorRow(version, mode, "works", "", secs, report)


def run(versions: list[str], directory: Path, reports: Path, say: Say = lambda s: None,
        jobs: int | None = None) -> DoctorReport:
    """Prepare each release and run the smoke set on it (one worker per release, as ``run``
    does); the rows, release by release in :data:`SMOKE` order."""
    from .engine import capabilities
    from .lab import RunItem, run_pairs
    from .settings import cache_dir

    t0 = time.perf_counter()
    smoke = smoke_scenarios(directory)
    items = [(mode, needs, RunItem(sc, v)) for v in versions for mode, sc, needs in smoke]
    run_pairs([it for _, _, it in items], reports, jobs=jobs, say=say, timelines=False)
    report = DoctorReport()
    caps_of: dict = {}
    for mode, needs, item in items:
        v = item.version
        if v not in caps_of:
            caps_of[v] = capabilities.load(cache_dir(), v)
        row = row_of(v, mode, needs, item, caps_of[v])
        if row.status == "n/a" and row.report is None and item.report_dir is not None:
            # refused before anything ran, for a mode the release lacks (as matrix does)
            shutil.rmtree(item.report_dir, ignore_errors=True)
        report.rows.append(row)
    report.seconds = round(time.perf_counter() - t0, 1)
    return report


def table(report: DoctorReport):
    """The doctor's table: release, mode, status, its one line."""
    from .console import table as plain

    t = plain(["release", "mode", "status", "what"], no_wrap=False)
    for r in report.rows:
        t.add_row(r.release, r.mode, r.status, r.detail)
    return t


__all__ = ["SMOKE", "DoctorRow", "DoctorReport", "smoke_scenarios", "seam_of", "row_of", "run",
           "table"]
