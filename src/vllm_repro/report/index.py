"""``reports/index.html``: every run's verdict, result and picture, one row each."""

from __future__ import annotations

import html
from pathlib import Path

from ..records import RecordError, ReportDir, RunResult


def write_index(reports: Path) -> Path | None:
    """(Re)write ``reports/index.html`` from the ``result.json`` files below ``reports``.
    Returns its path, or None when there is no report yet."""
    rows = []
    for res in ReportDir.results_under(reports):
        try:
            data = RunResult.from_json(res.read_text())
        except (OSError, RecordError):
            continue
        run_dir = res.parent
        rel = run_dir.relative_to(reports)
        verdict = data.verdict or {}
        ok = verdict.get("ok")
        ok_text = {True: "yes", False: "NO", None: "-"}.get(ok, "-")
        if data.outcome == "error":
            ok_text = "ERROR"
        links = [f'<a href="{html.escape(str(rel / ReportDir.RESULT))}">{ReportDir.RESULT}</a>']
        for name in (ReportDir.TRACE, ReportDir.TIMELINE):
            if (run_dir / name).is_file():
                links.append(f'<a href="{html.escape(str(rel / name))}">{name}</a>')
        pic = ""
        if (run_dir / "timeline.png").is_file():
            pic = f'<img src="{html.escape(str(rel / "timeline.png"))}" width="360">'
        rows.append(
            f"<tr><td>{html.escape(rel.parts[0])}</td><td>{html.escape(rel.parts[1])}</td>"
            f"<td>{html.escape(str(verdict.get('expected', '-')))}</td>"
            f"<td>{html.escape(str(verdict.get('observed', data.outcome)))}</td>"
            f"<td class='{ok_text}'>{ok_text}</td><td>{' '.join(links)}</td><td>{pic}</td></tr>")
    if not rows:
        return None
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>vllm-repro reports</title>"
        "<style>body{font-family:sans-serif}td,th{padding:4px 8px;border-bottom:1px solid #ddd;"
        "vertical-align:top}.yes{color:green}.NO,.ERROR{color:#b00}</style></head><body>"
        "<h1>vllm-repro reports</h1><table><tr><th>scenario</th><th>vllm</th><th>expect</th>"
        "<th>observed</th><th>ok</th><th>files</th><th>timeline</th></tr>"
        + "\n".join(rows) + "</table></body></html>\n")
    path = reports / "index.html"
    path.write_text(page)
    return path
