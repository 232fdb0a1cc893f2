"""Merging a campaign's tasks into one :class:`~vllm_repro.records.CampaignReport`, and showing
it: ``campaign.json``, a rich table, ``heatmap.png`` (matplotlib) and each signature's shrunk
scenario per release (``findings/<release>/<slug>.yaml``, the YAML ``vllm-repro fuzz`` writes,
replayable with ``vllm-repro run``).

The merge is a pure function of the task records (:func:`merge`): the same tasks give the same
report whatever order they finished in and wherever they ran.
"""

from __future__ import annotations

from pathlib import Path

from packaging.version import Version

from ..records import CampaignFinding, CampaignReport, CampaignTaskResult, SignatureSpan


def merge(spec: dict, releases: list[str], seeds: list[int],
          tasks: list[CampaignTaskResult]) -> CampaignReport:
    """The campaign's report from its tasks (any order; a (release, seed) given twice keeps the
    last). ``table[signature][release]``: seeds whose task found it there; ``spans``: per
    signature its first and last release and the first searched release after the last one
    without it (``gone_from``). Only ``done`` tasks count as searched."""
    by_key = {(t.release, t.seed): t for t in tasks}
    order = {r: i for i, r in enumerate(sorted(releases, key=Version))}
    ordered = sorted(by_key.values(), key=lambda t: (order.get(t.release, len(order)), t.seed))
    table: dict[str, dict[str, int]] = {}
    for t in ordered:
        for sig in sorted({f.signature for f in t.findings}):
            row = table.setdefault(sig, {})
            row[t.release] = row.get(t.release, 0) + 1
    searched = [r for r in sorted(releases, key=Version)
                if any(t.status == "done" for t in ordered if t.release == r)]
    spans = []
    for sig in sorted(table):
        found = sorted(table[sig], key=Version)
        last = found[-1]
        after = [r for r in searched if Version(r) > Version(last)]
        spans.append(SignatureSpan(signature=sig, first=found[0], last=last, releases=found,
                                   gone_from=after[0] if after else None))
    return CampaignReport(spec=spec, releases=sorted(releases, key=Version), seeds=list(seeds),
                          tasks=ordered, table=dict(sorted(table.items())), spans=spans)


def smallest_findings(report: CampaignReport) -> dict[tuple[str, str], CampaignFinding]:
    """``{(signature, release): the smallest finding among the seeds}`` (fewest requests, then
    events, then tokens; the lower seed on a tie)."""
    from ..fuzz.search import size

    best: dict[tuple[str, str], CampaignFinding] = {}
    for t in report.tasks:
        for f in t.findings:
            key = (f.signature, f.release)
            old = best.get(key)
            if old is None or (size(f.scenario), f.seed) < (size(old.scenario), old.seed):
                best[key] = f
    return best


def write_scenarios(report: CampaignReport, folder: Path) -> None:
    """Write each (signature, release)'s smallest shrunk scenario under
    ``folder/findings/<release>/`` (:func:`vllm_repro.fuzz.search.write_finding`: the YAML and
    its pytest regression) and record the paths in ``report.scenarios``."""
    from ..fuzz.search import Finding, write_finding

    report.scenarios = {}
    for (sig, release), f in sorted(smallest_findings(report).items()):
        finding = Finding(sig, f.scenario, f.result, f.found_after_s or 0.0, f.examples, 0,
                          None, f.first_example)
        path, _ = write_finding(finding, release, folder / "findings" / release)
        report.scenarios.setdefault(sig, {})[release] = str(path.relative_to(folder))


def write_report(report: CampaignReport, folder: Path) -> Path:
    """``folder/campaign.json`` (written whole, then renamed into place); returns its path."""
    path = folder / "campaign.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(report.to_json(indent=1) + "\n")
    tmp.replace(path)
    return path


def short(sig: str, width: int = 60) -> str:
    """A signature shortened for a label: the vLLM file's directories dropped."""
    kind, _, rest = sig.partition(":")
    if kind == "crash" and "@" in rest:
        exc, _, where = rest.partition("@")
        rest = f"{exc}@{where.rsplit('/', 1)[-1]}"
    text = f"{kind}:{rest}" if rest else kind
    return text if len(text) <= width else text[: width - 1] + "…"


def status_of(report: CampaignReport, release: str) -> str:
    """``2 done``, ``1 done, 1 error``: the release's tasks by status."""
    counts: dict[str, int] = {}
    for t in report.tasks:
        if t.release == release:
            counts[t.status] = counts.get(t.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "not run"


def table(report: CampaignReport):
    """The rich table: a row per release (its tasks, examples), a column per signature (S1...:
    seeds that found it, of the seeds run), then a row per signature naming it, with its first
    and last release and where it is gone."""
    from rich.table import Table

    sigs = list(report.table)
    t = Table(title=f"campaign: {len(report.releases)} releases x {len(report.seeds)} seeds",
              box=None, pad_edge=False)
    t.add_column("release")
    t.add_column("tasks")
    t.add_column("examples", justify="right")
    for i, _ in enumerate(sigs, 1):
        t.add_column(f"S{i}", justify="center")
    for r in report.releases:
        runs = [x for x in report.tasks if x.release == r]
        cells = []
        for sig in sigs:
            n = report.table[sig].get(r, 0)
            cells.append(f"[red]{n}/{len(runs)}[/red]" if n else "·")
        t.add_row(r, status_of(report, r), str(sum(x.examples for x in runs)), *cells)
    return t


def span_lines(report: CampaignReport) -> list[str]:
    """One line a signature: ``S1 crash:AssertionError@...: first 0.10.0, last 0.10.1.1, gone
    from 0.10.2 (findings/0.10.0/....yaml)``."""
    lines = []
    for i, sp in enumerate(report.spans, 1):
        gone = f", gone from {sp.gone_from}" if sp.gone_from else ", still in the newest searched"
        example = report.scenarios.get(sp.signature, {}).get(sp.last)
        lines.append(f"S{i} {sp.signature}: first {sp.first}, last {sp.last}{gone}"
                     + (f" ({example})" if example else ""))
    return lines


def heatmap(report: CampaignReport, path: Path) -> Path:
    """``path``: a release x signature heat map (the share of seeds that found each signature;
    grey where no task of the release was searched). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    sigs = list(report.table) or ["(no finding)"]
    rels = report.releases
    data = np.full((len(sigs), len(rels)), np.nan)
    for j, r in enumerate(rels):
        done = [t for t in report.tasks if t.release == r and t.status == "done"]
        if not done:
            continue
        for i, sig in enumerate(sigs):
            data[i, j] = report.table.get(sig, {}).get(r, 0) / len(done)
    fig_w = max(6.0, 0.35 * len(rels) + 4)
    fig_h = max(2.0, 0.4 * len(sigs) + 1.6)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    cmap = matplotlib.colormaps["Reds"].copy()
    cmap.set_bad("#cccccc")
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(rels)), rels, rotation=70, fontsize=7)
    ax.set_yticks(range(len(sigs)), [short(s, 48) for s in sigs], fontsize=7)
    ax.set_title(f"findings per release ({len(report.seeds)} seed(s); grey: not searched)", fontsize=9)
    fig.colorbar(im, ax=ax, label="share of seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
