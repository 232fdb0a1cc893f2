"""The report pages in a real headless browser (Debian's chromium), as a user opens them: the
flagship run on its two releases (real vLLM), its reports served by the lab's reports server
(compose's ``reports`` service), then every page reached from ``index.html`` loaded in Chromium:
each loads, logs nothing to the console, and every link and picture on it answers 200; the
trace, the engine log and the scenario come back as text. Skips, saying why, where no Chromium
is installed (``.ci/run`` installs it: apt-get install chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import urllib.request
from html.parser import HTMLParser
from urllib.parse import urljoin, urlparse

import pytest

from vllm_repro.report.serve import make_server

from ..conftest import FLAGSHIP

pytestmark = pytest.mark.slow
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no headless browser here (Debian: apt-get install chromium); "
                f"looked for {', '.join(BROWSERS)} on PATH")


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "img", "link", "script"):
                self.urls.append(a[key])


def load(chromium: str, url: str, profile) -> tuple[str, list[str]]:
    """The page's DOM after it loaded, and what it logged to the console."""
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", f"--user-data-dir={profile}",
                           "--enable-logging=stderr", "--v=0", "--dump-dom", url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    return proc.stdout, console


def test_report_pages_load_and_every_link_resolves(cli, tmp_path):
    chromium = browser()
    reports = tmp_path / "reports"
    proc = cli("run", str(FLAGSHIP), "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    server = make_server(reports, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        todo, seen, fetched, outside = [base], set(), {}, set()
        pages = {}
        while todo:
            url = todo.pop(0)
            if url in seen:
                continue
            seen.add(url)
            dom, console = load(chromium, url, tmp_path / "profile")
            assert not console, f"{url} logged to the console: {console}"
            assert "</html>" in dom and "404" not in dom.split("<body", 1)[0], url
            pages[url] = dom
            parser = Links()
            parser.feed(dom)
            for link in parser.urls:
                if link.startswith("data:"):
                    continue  # the empty favicon
                target = urljoin(url, link)
                if urlparse(target).netloc == "github.com":  # the issue and fix: not fetched
                    outside.add(target)
                    continue
                assert urlparse(target).netloc == urlparse(base).netloc, f"{url} links away: {link}"
                if target.endswith((".html", "/")):
                    todo.append(target)
                elif target not in fetched:
                    with urllib.request.urlopen(target, timeout=10) as resp:  # raises on a 404
                        fetched[target] = (resp.status, resp.headers.get_content_type())
    finally:
        server.shutdown()
        server.server_close()
    run = "vllm-23347-priority-preempt-scheduled"
    assert {f"{base}{run}/0.10.1.1/index.html", f"{base}{run}/0.10.2/index.html"} <= set(pages)
    assert "2 of 2 runs ok" in pages[base]
    for release in ("0.10.1.1", "0.10.2"):
        for name, kind in (("trace.jsonl", "text/plain"), ("engine.log", "text/plain"),
                           ("scenario.yaml", "text/plain"), ("result.json", "application/json"),
                           ("timeline.png", "image/png")):
            assert fetched.get(f"{base}{run}/{release}/{name}") == (200, kind), (name, fetched)
    fixed = pages[f"{base}{run}/0.10.2/index.html"]
    # the timeline's hover text: L preempted from step 3 on, the finding's sentence at step 3
    assert re.search(r"<title>L: preempted \(waiting\), steps? 3\b", fixed), fixed
    assert "<title>step 3: REQ_STATE: L is in num_scheduled_tokens" in fixed
    # the run page: the issue and its fix, the other release's page, the engine log's tail
    assert {"https://github.com/vllm-project/vllm/issues/23347",
            "https://github.com/vllm-project/vllm/issues/23713"} <= outside, outside
    crash = pages[f"{base}{run}/0.10.1.1/index.html"]
    assert "href=\"../0.10.2/index.html\"" in crash or "href='../0.10.2/index.html'" in crash
    assert "Engine log (last" in crash and "<pre class=\"log\">" in crash


def measured(chromium: str, page, profile, script: str, checked: str | None = None) -> str:
    """What ``script`` (an expression) evaluates to in ``page`` as Chromium lays it out in a
    1400 px wide window, with the radio button ``checked`` chosen (a copy of the page is loaded,
    the expression's value written into its body's data-m attribute)."""
    html_ = page.read_text()
    if checked:
        html_ = html_.replace("id='f-all' checked", "id='f-all'").replace(
            f"id='{checked}'", f"id='{checked}' checked")
    probe = page.with_name(f".probe-{page.name}")
    probe.write_text(html_.replace("</body>", f"<script>document.body.setAttribute('data-m', "
                                              f"String({script}))</script></body>"))
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", "--window-size=1400,900",
                           "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    probe.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return re.search(r'data-m="([^"]*)"', proc.stdout).group(1)


@pytest.mark.parametrize("n_runs", [57])
def test_the_index_fits_1400_px_and_its_filter_shows_failures_only(tmp_path, n_runs):
    """A catalog-sized index (the recorded runs copied to 57 runs) in Chromium at 1400 px:
    nothing wider than the window, and the failures filter leaves only the failing sections
    and rows on screen. A run page fits too."""
    from ..unit.test_report_pages import reports_from_recorded
    from vllm_repro.report.index import write_index

    chromium = browser()
    reports = reports_from_recorded(tmp_path)
    runs = sorted(p.parent for p in reports.rglob("result.json"))
    for i in range(n_runs - len(runs)):
        src = runs[i % len(runs)]
        shutil.copytree(src, reports / f"{src.parent.name}-copy{i // len(runs)}" / src.name)
    index = write_index(reports)
    width = "document.documentElement.scrollWidth"
    assert int(measured(chromium, index, tmp_path / "p", width)) <= 1400
    shown = ("[...document.querySelectorAll('tr.run')].filter(r => r.offsetParent !== null)"
             ".map(r => r.className).join(',')")
    every = measured(chromium, index, tmp_path / "p", shown).split(",")
    assert len(every) == n_runs
    failures = measured(chromium, index, tmp_path / "p", shown, checked="f-bad").split(",")
    assert failures and set(failures) <= {"run NO", "run ERROR"}
    assert len(failures) == sum(c in ("run NO", "run ERROR") for c in every)
    ok = measured(chromium, index, tmp_path / "p", shown, checked="f-ok").split(",")
    assert set(ok) == {"run yes"} and len(ok) == every.count("run yes")
    # the failing scenario's section comes first on screen
    first = "document.querySelector('main section').id"
    assert measured(chromium, index, tmp_path / "p", first) == "vllm-23347-priority-preempt-scheduled"
    page = reports / "vllm-23347-priority-preempt-scheduled" / "0.10.1.1" / "index.html"
    assert int(measured(chromium, page, tmp_path / "p", width)) <= 1400
