"""The page of a ``vllm-repro diff``: ``reports/<scenario>/diff-<A>-<B>.html`` (and the
:class:`~vllm_repro.records.ReleaseDiff` as ``diff-<A>-<B>.json`` beside it), linked from both
releases' run pages by the index (:func:`diff_links`). Standard library only."""

from __future__ import annotations

import html
import re
from pathlib import Path

from ..diff import diff_lines
from ..records import ReleaseDiff
from .pages import PAGE, STYLE

#: a diff page's file name: ``diff-<A>-<B>.html`` (release names have no ``/``)
DIFF_PAGE = re.compile(r"^diff-(?P<a>[0-9A-Za-z.+_]+)-(?P<b>[0-9A-Za-z.+_]+)\.html$")


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def diff_page_name(a: str, b: str) -> str:
    """The file name of the diff of releases ``a`` and ``b`` (in that order)."""
    return f"diff-{a}-{b}.html"


def write_diff_page(scenario_dir: Path, diff: ReleaseDiff) -> Path:
    """Write the diff's page and JSON into ``scenario_dir`` (the folder holding each release's
    run folder); returns the page's path. Raises ``OSError``."""
    a, b = diff.releases
    head, rows, notes = diff_lines(diff)
    body = [f"<p class='nav'><a href='../{PAGE}'>&#8592; all runs</a> "
            f"<a href='{_e(a)}/{PAGE}'>{_e(a)}</a> <a href='{_e(b)}/{PAGE}'>{_e(b)}</a></p>",
            f"<h1>{_e(diff.scenario)}: vLLM {_e(a)} against {_e(b)}</h1>"]
    body += [f"<p class='sentence'>{_e(line)}</p>" for line in head]
    if rows:
        body.append("<table class='steps'><tr><th></th>"
                    f"<th>{_e(a)}</th><th>{_e(b)}</th></tr>"
                    + "".join("<tr" + (" class='mark'" if r[0].startswith("*") else "") + ">"
                              + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
                    + "</table>")
    body += [f"<p>{_e(n)}</p>" for n in notes if not n.startswith((f"{a}: ", f"{b}: "))]
    page = scenario_dir / diff_page_name(a, b)
    scenario_dir.mkdir(parents=True, exist_ok=True)
    page.with_suffix(".json").write_text(diff.to_json() + "\n", encoding="utf-8")
    page.write_text("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
                    f"<title>diff {_e(diff.scenario)} {_e(a)} {_e(b)}</title>"
                    f"<style>{STYLE}</style></head><body>\n" + "\n".join(body)
                    + "\n</body></html>\n", encoding="utf-8")
    return page


def diff_links(scenario_dir: Path, release: str) -> str:
    """The HTML links, for ``release``'s run page, to every diff page in ``scenario_dir`` that
    compares it with another release (empty when there is none)."""
    links = []
    for page in sorted(scenario_dir.glob("diff-*.html")):
        m = DIFF_PAGE.match(page.name)
        if m and release in (m.group("a"), m.group("b")):
            other = m.group("b") if m.group("a") == release else m.group("a")
            links.append(f"<a href='../{_e(page.name)}'>diff with {_e(other)}</a>")
    return f"<p class='releases'>{' '.join(links)}</p>" if links else ""


__all__ = ["write_diff_page", "diff_links", "diff_page_name", "DIFF_PAGE"]
