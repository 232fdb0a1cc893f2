"""``timeline.png``: a run's step trace as a picture (host side, matplotlib).

Top panel: waiting, running and preempted request counts per step; bottom panel: free KV blocks
per step (and, when the audit ran, used blocks and free blocks still holding a cached prefix).
The crash step and the steps where the audit found a violation are marked and labelled.
"""

from __future__ import annotations

from pathlib import Path

from ..records import RecordError, ReportDir, RunResult, TraceLine

MAX_LABELS = 4  # violation codes labelled by name; every violation step is marked


def read_trace(path: Path) -> list[TraceLine]:
    """The :class:`~vllm_repro.records.TraceLine` records of ``trace.jsonl``. A damaged line
    (a worker killed mid-write) ends the trace there; what came before is drawn."""
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            raw = raw.strip()
            if not raw:
                continue
            try:
                lines.append(TraceLine.from_json(raw))
            except RecordError:
                break
    return lines


def marks(trace: list[TraceLine], result: RunResult | None = None) -> list[tuple[int, str, str]]:
    """``(step, kind, label)`` to mark: ``crash`` (``crash AssertionError in schedule @3``),
    ``stall`` and ``violation`` (``REQ_STATE @3``), in step order; violations come from the
    trace lines and from ``result.violations`` (end-of-run findings have no trace line)."""
    out: list[tuple[int, str, str]] = []
    seen = set()
    for line in trace:
        step = line.step
        if line.crash:
            out.append((step, "crash", f"crash {line.crash.type} in {line.crash.phase} @{step}"))
        for v in line.violations or ():
            if (step, v.code) not in seen:
                seen.add((step, v.code))
                out.append((step, "violation", f"{v.label()} @{step}"))
    if result is None:
        return sorted(out, key=lambda m: (m[0], m[1] != "crash"))
    for v in result.all_violations():
        if (v.step, v.code) not in seen and v.step is not None:
            seen.add((v.step, v.code))
            out.append((v.step, "violation", v.at()))
    if result.outcome == "stall" and result.stall:
        s = result.stall
        out.append((s.step, "stall", f"stall @{s.step} (no progress since {s.since})"))
    return sorted(out, key=lambda m: (m[0], m[1] != "crash"))


def labels(all_marks: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """One label per crash or stall, and one per violation code at its first step (``REQ_STATE
    @22 (11 steps, last @81)``), at most ``MAX_LABELS`` codes; every mark keeps its line."""
    out = []
    by_code: dict[str, list[int]] = {}
    for step, kind, label in all_marks:
        if kind == "violation":
            by_code.setdefault(label.rsplit(" @", 1)[0], []).append(step)
        else:
            out.append((step, kind, label))
    for code, steps in list(by_code.items())[:MAX_LABELS]:
        more = f" ({len(steps)} steps, last @{steps[-1]})" if len(steps) > 1 else ""
        out.append((steps[0], "violation", f"{code} @{steps[0]}{more}"))
    return sorted(out, key=lambda m: m[0])


def write_timeline(run_dir: Path, result: RunResult | None = None) -> Path | None:
    """Draw ``run_dir/timeline.png`` from ``run_dir/trace.jsonl``; returns its path, or None
    when there is no trace (a run that failed before its first step).

    ``result``: the run's :class:`~vllm_repro.records.RunResult` (scenario, vllm, outcome,
    violations, verdict), for
    the title and for marks without a trace line. Raises ``ImportError`` without matplotlib.
    """
    trace_path = Path(run_dir) / ReportDir.TRACE
    if not trace_path.is_file():
        return None
    trace = read_trace(trace_path)
    if not trace:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [ln.step for ln in trace]
    count = lambda key: [len(getattr(ln, key) or ()) for ln in trace]  # noqa: E731
    free = [ln.free_blocks for ln in trace]
    audit = [ln.audit or {} for ln in trace]

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.2),
                                   gridspec_kw={"height_ratios": [1, 1]})
    marker = "o" if len(steps) <= 60 else None
    style = {"drawstyle": "steps-mid", "linewidth": 1.6, "marker": marker, "markersize": 3.5}
    # waiting drawn wide and pale underneath: preempted requests are waiting ones too
    ax1.plot(steps, count("waiting"), label="waiting", color="#1f77b4", alpha=0.45,
             **{**style, "linewidth": 4})
    ax1.plot(steps, count("running"), label="running", color="#2ca02c", **style)
    ax1.plot(steps, count("preempted"), label="preempted", color="#d62728",
             linestyle="--", **style)
    ax1.set_ylabel("requests", fontsize=11)
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=11, frameon=False,
               handlelength=1.6)

    if any(f is not None for f in free):
        ax2.plot(steps, [f if f is not None else float("nan") for f in free], label="free",
                 color="#9467bd", **style)
    if any("used" in a for a in audit):
        ax2.plot(steps, [a.get("used", float("nan")) for a in audit], label="used",
                 color="#8c564b", linestyle=":", **style)
    if any("cached_free" in a for a in audit):
        ax2.plot(steps, [a.get("cached_free", float("nan")) for a in audit],
                 label="free, cached", color="#17becf", linestyle="-.", **style)
    total = next((a["total"] for a in audit if "total" in a), None)
    ax2.set_ylabel("KV blocks" + (f" (pool {total})" if total else ""), fontsize=11)
    ax2.set_xlabel("step (n-th schedule() call)", fontsize=11)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    if ax2.get_legend_handles_labels()[0]:  # a start-up crash has no step to plot
        ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=11, frameon=False,
                   handlelength=1.6)
    ax1.set_ylim(0, max([1, *count("waiting"), *count("running")]) * 1.35)
    ax2.set_ylim(bottom=0, top=(total or max([1] + [f or 0 for f in free])) * 1.15)

    colors = {"crash": "#d62728", "violation": "#ff7f0e", "stall": "#7f7f7f"}
    all_marks = marks(trace, result)
    for step, kind, _ in all_marks:
        for ax in (ax1, ax2):
            ax.axvline(step, color=colors[kind], linewidth=2 if kind == "crash" else 1.3,
                       linestyle="-" if kind != "violation" else "--", alpha=0.9)
    for row, (step, kind, label) in enumerate(labels(all_marks)):
        ax1.annotate(label, xy=(step, 1.0), xycoords=("data", "axes fraction"),
                     xytext=(4, -4 - 17 * row), textcoords="offset points",
                     va="top", ha="left", fontsize=10, color=colors[kind], fontweight="bold",
                     bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": colors[kind],
                           "alpha": 0.9})
    lo, hi = min(steps), max(steps)
    if hi - lo < 4:
        for ax in (ax1, ax2):
            ax.set_xlim(lo - 0.5, hi + 2.5)

    title = f"{(result and result.scenario) or Path(run_dir).parent.name} on vLLM " \
            f"{(result and result.vllm) or Path(run_dir).name}"
    verdict = ((result and result.verdict) or {}).get("observed") or (result and result.outcome) or ""
    fig.suptitle(title, fontsize=12)
    ax1.set_title(verdict, fontsize=10, color="#444")
    for ax in (ax1, ax2):
        ax.tick_params(labelsize=10)
    fig.tight_layout()
    out = Path(run_dir) / ReportDir.TIMELINE
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
