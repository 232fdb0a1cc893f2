"""``reports/index.html``: a summary line, a status filter (all, failures, ok), then one
section per scenario, those with a failure (a mismatch or an error) first: the scenario's
description and, one row each, every run's verdict, page, files and picture, by release (as
versions: 0.6.6.post1 before 0.33.0). The page fits 1400 px wide (thumbnails 220 px) and works
without JavaScript (the filter is radio buttons and CSS). Writing it also fills each run page's
links to the same scenario's other releases (:func:`vllm_repro.report.pages.set_releases_nav`)."""

from __future__ import annotations

import html
import os
from datetime import datetime, timezone
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .. import __version__
from ..records import RecordError, ReportDir, RunResult, violation_label
from .diff_page import diff_links
from .pages import PAGE, SCENARIO_FILE, read_scenario, releases_nav, set_releases_nav

STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.2em 2em;color:#222;max-width:1320px}"
    "h1{font-size:1.4em;margin-bottom:.2em}.summary{font-size:1.05em}.meta{color:#555;font-size:.9em}"
    "h2{font-size:1.1em;margin:1.4em 0 .3em}h2 .chips{font-weight:normal;font-size:.85em;margin-left:.8em}"
    ".chips a,.chips span{margin-right:.4em;padding:1px 5px;border-radius:3px;text-decoration:none}"
    ".chips .yes{background:#e6f4e6}.chips .NO,.chips .ERROR{background:#fbe9e9}"
    ".desc{color:#444;font-size:.9em;max-width:90em;margin:.2em 0 .4em;display:-webkit-box;"
    "-webkit-line-clamp:2;-webkit-box-orient:vertical;overflow:hidden}"
    "table{border-collapse:collapse;width:100%;table-layout:fixed}"
    "td,th{padding:4px 8px;border-bottom:1px solid #ddd;vertical-align:top;text-align:left;"
    "overflow-wrap:anywhere}col.rel{width:7em}col.exp{width:13em}col.ok{width:4.5em}"
    "col.files{width:11em}col.pic{width:236px}"
    "td.yes{color:green}td.NO,td.ERROR{color:#b00;font-weight:bold}"
    ".also{color:#555;font-size:.85em}img{width:220px;height:auto}"
    ".filter{margin:.6em 0}.filter label{margin-right:1.2em;cursor:pointer}"
    "#f-bad:checked~main section:not(.bad),#f-bad:checked~main tr.run:not(.NO):not(.ERROR),"
    "#f-ok:checked~main section:not(.has-yes),#f-ok:checked~main tr.run:not(.yes){display:none}"
    "#f-all:checked~.filter label[for=f-all],#f-bad:checked~.filter label[for=f-bad],"
    "#f-ok:checked~.filter label[for=f-ok]{font-weight:bold;text-decoration:underline}"
)


def _version_key(release: str):
    try:
        return (0, Version(release), release)
    except InvalidVersion:  # a custom tree's name sorts after the releases
        return (1, Version("0"), release)


def _ok_text(data: RunResult) -> str:
    if data.outcome == "error":
        return "ERROR"
    return {True: "yes", False: "NO"}.get((data.verdict or {}).get("ok"), "-")


def _run_row(reports: Path, run_dir: Path, data: RunResult) -> str:
    """One run's row: release (its page), expect, observed (and the audit's other findings or
    the error), ok, the report's files, the timeline thumbnail."""
    rel = run_dir.relative_to(reports)
    verdict = data.verdict or {}
    ok_text = _ok_text(data)
    href = lambda name: html.escape((rel / name).as_posix(), quote=True)  # noqa: E731
    links = [f'<a href="{href(name)}">{name}</a>'
             for name in (SCENARIO_FILE, ReportDir.RESULT, ReportDir.TRACE, ReportDir.ENGINE_LOG,
                          ReportDir.TIMELINE) if (run_dir / name).is_file()]
    page = (run_dir / PAGE).is_file()
    name_cell = html.escape(rel.parts[0])
    release_cell = html.escape(rel.parts[1])
    if page:
        release_cell = f'<a href="{href(PAGE)}">{release_cell}</a>'
    also = "".join(f"<div class='also'>"
                   f"{html.escape(violation_label(str(a.get('code')), a.get('mechanism')))}"
                   f" @{a.get('step')}: {html.escape(str(a.get('message', '')))}</div>"
                   for a in verdict.get("also") or ())
    if data.outcome == "error" and data.error is not None:
        also += f"<div class='also'>{html.escape(data.error.message)}</div>"
    pic = ""
    if (run_dir / ReportDir.TIMELINE).is_file():
        img = (f'<img src="{href(ReportDir.TIMELINE)}" loading="lazy" alt="timeline of '
               f'{name_cell} on {html.escape(rel.parts[1])}">')
        pic = f'<a href="{href(PAGE)}">{img}</a>' if page else img
    return (f"<tr class='run {ok_text}'><td>{release_cell}</td>"
            f"<td>{html.escape(str(verdict.get('expected', '-')))}</td>"
            f"<td>{html.escape(str(verdict.get('observed', data.outcome)))}{also}</td>"
            f"<td class='{ok_text}'>{ok_text}</td><td>{' '.join(links)}</td><td>{pic}</td></tr>")


def _description(runs: list[tuple[Path, RunResult]]) -> str:
    """The scenario's description (its newest run's scenario.yaml), one paragraph, or ''."""
    for run_dir, _ in reversed(runs):
        try:
            doc = read_scenario((run_dir / SCENARIO_FILE).read_text(encoding="utf-8"))
        except OSError:
            continue
        if doc and doc.get("description"):
            return " ".join(str(doc["description"]).split())
    return ""


def _group(reports: Path, name: str, runs: list[tuple[Path, RunResult]]) -> str:
    """A scenario's section: its name, a chip per release (its verdict, linking its page), the
    description and the runs' table."""
    oks = [_ok_text(d) for _, d in runs]
    bad = any(o in ("NO", "ERROR") for o in oks)
    chips = []
    for (run_dir, _), ok in zip(runs, oks):
        label = html.escape(run_dir.name)
        if (run_dir / PAGE).is_file():
            href = html.escape(run_dir.relative_to(reports).joinpath(PAGE).as_posix(), quote=True)
            chips.append(f"<a class='{ok}' href=\"{href}\" title='{ok}'>{label}</a>")
        else:
            chips.append(f"<span class='{ok}' title='{ok}'>{label}</span>")
    desc = _description(runs)
    # two lines here (the whole of it on hover, and on each run page)
    desc = (f"<p class='desc' title=\"{html.escape(desc, quote=True)}\">{html.escape(desc)}</p>"
            if desc else "")
    classes = " ".join(c for c in ("bad" if bad else "", "has-yes" if "yes" in oks else "") if c)
    anchor = html.escape(name, quote=True)
    return (f"<section class='{classes}' id=\"{anchor}\"><h2>{html.escape(name)}"
            f"<span class='chips'>{' '.join(chips)}</span></h2>{desc}"
            "<table><colgroup><col class='rel'><col class='exp'><col><col class='ok'>"
            "<col class='files'><col class='pic'></colgroup>"
            "<tr><th>vllm</th><th>expect</th><th>observed</th><th>ok</th><th>files</th>"
            "<th>timeline</th></tr>\n"
            + "\n".join(_run_row(reports, d, r) for d, r in runs) + "</table></section>")


def _fill_releases_nav(runs: list[tuple[Path, RunResult]]) -> None:
    """Each run page's links to the same scenario's pages on its other releases, and to the
    ``vllm-repro diff`` pages that compare its release with another (``report/diff_page.py``)."""
    pairs = [(d.name, _ok_text(r)) for d, r in runs if (d / PAGE).is_file()]
    for run_dir, _ in runs:
        if (run_dir / PAGE).is_file():
            try:
                set_releases_nav(run_dir / PAGE, releases_nav(run_dir.name, pairs)
                                 + diff_links(run_dir.parent, run_dir.name))
            except OSError:  # a page being replaced by a run right now: the next index fills it
                pass


def write_index(reports: Path) -> Path | None:
    """(Re)write ``reports/index.html`` from the ``result.json`` files below ``reports``: the
    summary (``N of M runs ok``, mismatches and errors), the date (UTC), the lab's version and the
    releases run, the status filter, then a section per scenario (failures first, then by name)
    with a row per run linking its page, its files and its ``timeline.png``; and fill each run
    page's links to its scenario's other releases. Returns its path, or None when there is no
    report yet."""
    runs: list[tuple[Path, RunResult]] = []
    for res in ReportDir.results_under(reports):
        try:
            runs.append((res.parent, RunResult.from_json(res.read_text())))
        except (OSError, RecordError):
            continue
    if not runs:
        return None
    runs.sort(key=lambda r: (r[0].parent.name, _version_key(r[0].name)))
    groups: dict[str, list[tuple[Path, RunResult]]] = {}
    for run_dir, data in runs:
        groups.setdefault(run_dir.relative_to(reports).parts[0], []).append((run_dir, data))
    counts = {"yes": 0, "NO": 0, "ERROR": 0, "-": 0}
    for _, data in runs:
        counts[_ok_text(data)] += 1
    failing = {n for n, g in groups.items() if any(_ok_text(d) in ("NO", "ERROR") for _, d in g)}
    order = sorted(groups, key=lambda n: (n not in failing, n))
    for name in order:
        _fill_releases_nav(groups[name])
    total = len(runs)
    parts = [f"{counts['yes']} of {total} runs ok"]
    if counts["NO"]:
        parts.append(f"{counts['NO']} mismatch{'es' if counts['NO'] > 1 else ''}")
    if counts["ERROR"]:
        parts.append(f"{counts['ERROR']} error{'s' if counts['ERROR'] > 1 else ''}")
    if counts["-"]:
        parts.append(f"{counts['-']} without an expectation")
    releases = sorted({d.name for d, _ in runs}, key=_version_key)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    n_bad = counts["NO"] + counts["ERROR"]
    filter_ = (
        "<input type='radio' name='f' id='f-all' checked hidden>"
        "<input type='radio' name='f' id='f-bad' hidden>"
        "<input type='radio' name='f' id='f-ok' hidden>"
        f"<p class='filter'>show: <label for='f-all'>&#9673; all {total} runs</label>"
        f"<label for='f-bad'>&#9673; failures ({n_bad}, in {len(failing)} scenario(s))</label>"
        f"<label for='f-ok'>&#9673; ok ({counts['yes']})</label></p>")
    page = (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>vllm-repro reports</title>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<link rel='icon' href='data:,'><style>{STYLE}</style></head><body>"
        "<h1>vllm-repro reports</h1>"
        f"<p class='summary'><b>{'; '.join(parts)}</b></p>"
        f"<p class='meta'>written {when} by vllm-repro {__version__}; {len(groups)} scenario(s); "
        f"vLLM releases: {', '.join(html.escape(r) for r in releases)}</p>"
        + filter_ + "<main>\n"
        + "\n".join(_group(reports, n, groups[n]) for n in order) + "</main></body></html>\n")
    path = reports / "index.html"
    tmp = reports / f".index.html.{os.getpid()}.tmp"
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
