"""``timeline.png``: a run's step trace as a picture (host side, matplotlib).

Top panel: waiting, running and preempted request counts per step; bottom panel: free KV blocks
per step (and, when the audit ran, used blocks and free blocks still holding a cached prefix).
The crash step and the steps where the audit found a violation are marked and labelled.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_LABELS = 4  # violation codes labelled by name; every violation step is marked


def read_trace(path: Path) -> list[dict]:
    """The trace lines of ``trace.jsonl`` (one JSON object a step). A damaged last line (a
    worker killed mid-write) is skipped."""
    lines = []
    with open(path) as f:
        for raw in f:
            raw = raw.strip()
            if not raw:
                continue
            try:
                lines.append(json.loads(raw))
            except ValueError:
                break
    return lines


def marks(trace: list[dict], result: dict | None = None) -> list[tuple[int, str, str]]:
    """``(step, kind, label)`` to mark: ``crash`` (``crash AssertionError in schedule @3``),
    ``stall`` and ``violation`` (``REQ_STATE @3``), in step order; violations come from the
    trace lines and from ``result["violations"]`` (end-of-run findings have no trace line)."""
    out: list[tuple[int, str, str]] = []
    seen = set()
    for line in trace:
        step = line.get("step")
        if line.get("crash"):
            c = line["crash"]
            out.append((step, "crash", f"crash {c.get('type')} in {c.get('phase')} @{step}"))
        for v in line.get("violations") or ():
            key = (step, v.get("code"))
            if key not in seen:
                seen.add(key)
                out.append((step, "violation", f"{v.get('code')} @{step}"))
    result = result or {}
    for v in result.get("violations") or ():
        key = (v.get("step"), v.get("code"))
        if key not in seen and v.get("step") is not None:
            seen.add(key)
            out.append((v["step"], "violation", f"{v['code']} @{v['step']}"))
    if result.get("outcome") == "stall" and result.get("stall"):
        s = result["stall"]
        out.append((s["step"], "stall", f"stall @{s['step']} (no progress since {s.get('since')})"))
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


def write_timeline(run_dir: Path, result: dict | None = None) -> Path | None:
    """Draw ``run_dir/timeline.png`` from ``run_dir/trace.jsonl``; returns its path, or None
    when there is no trace (a run that failed before its first step).

    ``result``: the run's ``result.json`` mapping (scenario, vllm, outcome, violations), for
    the title and for marks without a trace line. Raises ``ImportError`` without matplotlib.
    """
    trace_path = Path(run_dir) / "trace.jsonl"
    if not trace_path.is_file():
        return None
    trace = read_trace(trace_path)
    if not trace:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    result = result or {}
    steps = [ln["step"] for ln in trace]
    count = lambda key: [len(ln.get(key) or ()) for ln in trace]  # noqa: E731
    free = [ln.get("free_blocks") for ln in trace]
    audit = [ln.get("audit") or {} for ln in trace]

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.8),
                                   gridspec_kw={"height_ratios": [1, 1]})
    marker = "o" if len(steps) <= 60 else None
    style = {"drawstyle": "steps-mid", "linewidth": 1.6, "marker": marker, "markersize": 3.5}
    # waiting drawn wide and pale underneath: preempted requests are waiting ones too
    ax1.plot(steps, count("waiting"), label="waiting", color="#1f77b4", alpha=0.45,
             **{**style, "linewidth": 4})
    ax1.plot(steps, count("running"), label="running", color="#2ca02c", **style)
    ax1.plot(steps, count("preempted"), label="preempted (waiting)", color="#d62728",
             linestyle="--", **style)
    ax1.set_ylabel("requests")
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)

    if any(f is not None for f in free):
        ax2.plot(steps, [f if f is not None else float("nan") for f in free], label="free blocks",
                 color="#9467bd", **style)
    if any("used" in a for a in audit):
        ax2.plot(steps, [a.get("used", float("nan")) for a in audit], label="used blocks",
                 color="#8c564b", linestyle=":", **style)
    if any("cached_free" in a for a in audit):
        ax2.plot(steps, [a.get("cached_free", float("nan")) for a in audit],
                 label="free, prefix cached", color="#17becf", linestyle="-.", **style)
    total = next((a["total"] for a in audit if "total" in a), None)
    ax2.set_ylabel("KV blocks" + (f" (pool {total}, 1 null)" if total else ""))
    ax2.set_xlabel("step (n-th schedule() call)")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    if ax2.get_legend_handles_labels()[0]:  # a start-up crash has no step to plot
        ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
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
                     xytext=(4, -4 - 14 * row), textcoords="offset points",
                     va="top", ha="left", fontsize=8, color=colors[kind], fontweight="bold",
                     bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": colors[kind],
                           "alpha": 0.9})
    lo, hi = min(steps), max(steps)
    if hi - lo < 4:
        for ax in (ax1, ax2):
            ax.set_xlim(lo - 0.5, hi + 2.5)

    title = f"{result.get('scenario', Path(run_dir).parent.name)} on vLLM " \
            f"{result.get('vllm', Path(run_dir).name)}"
    verdict = (result.get("verdict") or {}).get("observed") or result.get("outcome", "")
    fig.suptitle(title, fontsize=11)
    ax1.set_title(verdict, fontsize=8.5, color="#444")
    fig.tight_layout()
    out = Path(run_dir) / "timeline.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
