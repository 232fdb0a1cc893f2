"""``reports/index.html``: a summary line, then every run's verdict, page, files and picture,
one row each, sorted by scenario and then by release (as versions: 0.6.6.post1 before 0.33.0)."""

from __future__ import annotations

import html
import os
from datetime import datetime, timezone
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .. import __version__
from ..records import RecordError, ReportDir, RunResult, violation_label
from .pages import PAGE, SCENARIO_FILE

STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.2em 2em;color:#222}"
    "h1{font-size:1.4em;margin-bottom:.2em}.summary{font-size:1.05em}.meta{color:#555;font-size:.9em}"
    "table{border-collapse:collapse}td,th{padding:4px 8px;border-bottom:1px solid #ddd;"
    "vertical-align:top;text-align:left}.yes{color:green}.NO,.ERROR{color:#b00}"
    ".also{color:#555;font-size:.85em;max-width:40em}img{width:520px;height:auto}"
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


def write_index(reports: Path) -> Path | None:
    """(Re)write ``reports/index.html`` from the ``result.json`` files below ``reports``: the
    summary (``N of M runs ok``, mismatches and errors), the date (UTC), the lab's version and the
    releases run, then one row per run linking its page, its files and its ``timeline.png``.
    Returns its path, or None when there is no report yet."""
    runs: list[tuple[Path, RunResult]] = []
    for res in ReportDir.results_under(reports):
        try:
            runs.append((res.parent, RunResult.from_json(res.read_text())))
        except (OSError, RecordError):
            continue
    if not runs:
        return None
    runs.sort(key=lambda r: (r[0].parent.name, _version_key(r[0].name)))
    rows = []
    counts = {"yes": 0, "NO": 0, "ERROR": 0, "-": 0}
    for run_dir, data in runs:
        rel = run_dir.relative_to(reports)
        verdict = data.verdict or {}
        ok_text = _ok_text(data)
        counts[ok_text] += 1
        href = lambda name, rel=rel: html.escape((rel / name).as_posix(), quote=True)  # noqa: E731
        links = []
        for name in (SCENARIO_FILE, ReportDir.RESULT, ReportDir.TRACE, ReportDir.ENGINE_LOG,
                     ReportDir.TIMELINE):
            if (run_dir / name).is_file():
                links.append(f'<a href="{href(name)}">{name}</a>')
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
            img = f'<img src="{href(ReportDir.TIMELINE)}" alt="timeline of {name_cell} on {html.escape(rel.parts[1])}">'
            pic = f'<a href="{href(PAGE)}">{img}</a>' if page else img
        rows.append(
            f"<tr><td>{name_cell}</td><td>{release_cell}</td>"
            f"<td>{html.escape(str(verdict.get('expected', '-')))}</td>"
            f"<td>{html.escape(str(verdict.get('observed', data.outcome)))}{also}</td>"
            f"<td class='{ok_text}'>{ok_text}</td><td>{' '.join(links)}</td><td>{pic}</td></tr>")
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
    page = (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>vllm-repro reports</title>"
        f"<link rel='icon' href='data:,'><style>{STYLE}</style></head><body>"
        "<h1>vllm-repro reports</h1>"
        f"<p class='summary'><b>{'; '.join(parts)}</b></p>"
        f"<p class='meta'>written {when} by vllm-repro {__version__}; vLLM releases: "
        f"{', '.join(html.escape(r) for r in releases)}</p>"
        "<table><tr><th>scenario</th><th>vllm</th><th>expect</th>"
        "<th>observed</th><th>ok</th><th>files</th><th>timeline</th></tr>\n"
        + "\n".join(rows) + "</table></body></html>\n")
    path = reports / "index.html"
    tmp = reports / f".index.html.{os.getpid()}.tmp"
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
