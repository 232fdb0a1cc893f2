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
        todo, seen, fetched = [base], set(), {}
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
                if link.startswith(("data:", "https://github.com/")):
                    continue  # the empty favicon; the scenario's issue and fix (not fetched)
                target = urljoin(url, link)
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
