"""The report pages written from recorded results (tests/data/results: real runs' result.json):
the index's summary, date, versions and release order, and each run's page saying what happened
in sentences. The pages in a real browser: tests/integration/test_report_browser.py."""

from __future__ import annotations

import html
import json
import re
import shutil

from vllm_repro.records import RunResult, TraceLine
from vllm_repro.report.index import write_index
from vllm_repro.report.pages import (PageContext, explain, step_rows, steps_section,
                                     timeline_section, timeline_svg, write_run_page)

from ..conftest import ROOT

RESULTS = ROOT / "tests" / "data" / "results"


def catalog_text(name: str) -> str | None:
    """The catalog file of the scenario ``name``, as the lab would copy it into a report."""
    for f in sorted((ROOT / "scenarios").glob("*.yaml")):
        text = f.read_text()
        if f"name: {name}\n" in text:
            return text
    return None


#: an engine log of 60 lines (the page shows the last LOG_TAIL_LINES)
ENGINE_LOG = "".join(f"INFO 12-07 16:{i:02d}:00 [scheduler.py:{i}] line {i}\n" for i in range(60))


def reports_from_recorded(tmp_path):
    """A reports folder of the recorded runs, each with its page, its catalog scenario (where
    the catalog has it) and an engine log, as a run leaves them."""
    reports = tmp_path / "reports"
    for f in sorted(RESULTS.glob("*.json")):
        result = RunResult.from_json(f.read_text())
        run_dir = reports / result.scenario / result.vllm
        run_dir.mkdir(parents=True)
        shutil.copy(f, run_dir / "result.json")
        (run_dir / "engine.log").write_text(ENGINE_LOG)
        write_run_page(run_dir, result, catalog_text(result.scenario))
    return reports


def text_of(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_index_summary_versions_and_release_order(tmp_path):
    reports = reports_from_recorded(tmp_path)
    page = write_index(reports).read_text()
    words = " ".join(text_of(page).split())
    # 8 recorded runs: 7 as expected, one input error (0.7.0 refuses the flagship's config)
    assert "7 of 8 runs ok; 1 error" in words
    assert re.search(r"written \d{4}-\d\d-\d\d \d\d:\d\d UTC by vllm-repro \d", words)
    assert "vLLM releases: 0.6.6.post1, 0.7.0, 0.10.1.1, 0.10.2, 0.19.1, 0.20.2, 0.22.0, 0.24.0" in words
    # the flagship's rows by version (as strings 0.7.0 would come last)
    flagship = re.findall(r'<tr class=.run [^>]*><td><a href="vllm-23347-priority-preempt-'
                          r'scheduled/([^/]+)/index.html"', page)
    assert flagship == ["0.7.0", "0.10.1.1", "0.10.2"]
    # the audit finding's own sentence, not only "also: REQ_STATE @3"
    assert "REQ_STATE @3: L is in num_scheduled_tokens but was preempted in the same step" in words


def test_run_pages_explain_the_run_in_sentences(tmp_path):
    reports = reports_from_recorded(tmp_path)
    flagship = reports / "vllm-23347-priority-preempt-scheduled"
    crash = " ".join(text_of((flagship / "0.10.1.1" / "index.html").read_text()).split())
    assert "vLLM raised AssertionError (no message) in vllm/v1/core/sched/scheduler.py:530 (schedule), " \
           "at step 3 during schedule()." in crash
    page = (flagship / "0.10.1.1" / "index.html").read_text()
    assert "<pre class='traceback'>Traceback (most recent call last):\n" in page  # as lines
    fixed = " ".join(text_of((flagship / "0.10.2" / "index.html").read_text()).split())
    assert "The audit found REQ_STATE at step 3 (after schedule): L is in num_scheduled_tokens but " \
           "was preempted in the same step (status PREEMPTED, in waiting)." in fixed
    assert "The run went on to its end: 2 request(s) finished in 31 steps." in fixed
    stall = " ".join(text_of((reports / "vllm-35541-prompt-larger-than-kv-pool" / "0.19.1" /
                              "index.html").read_text()).split())
    assert "The run stalled: no request made progress from step 9 to step 28; unfinished: huge" in stall
    error = " ".join(text_of((flagship / "0.7.0" / "index.html").read_text()).split())
    assert "ERROR" in error and "Bad input (exit 2):" in error
    # no trace recorded: no timeline, no step table, and no link to a file that is not there
    assert "trace.jsonl" not in error and "<svg" not in error


def test_timeline_svg_names_each_request_and_finding_on_hover(tmp_path):
    result = RunResult.from_json((RESULTS / "violation-ran-to-end-23347-0.10.2.json").read_text())
    trace = [TraceLine.from_dict(d) for d in (
        {"step": 1, "added": ["L"], "scheduled": {"L": 30}, "running": ["L"], "free_blocks": 2},
        {"step": 2, "added": ["H"], "scheduled": {"L": 1, "H": 32}, "running": ["L", "H"]},
        {"step": 3, "scheduled": {"L": 1, "H": 1}, "waiting": ["L"], "running": ["H"],
         "preempted": ["L"], "violations": [result.violations[0].brief().to_dict()]},
        {"step": 4, "scheduled": {"H": 1}, "running": ["H"], "finished": ["L"]},
    )]
    svg = timeline_svg(trace, result)
    titles = re.findall(r"<title>([^<]*)</title>", svg)
    assert "L: running, steps 1-2; 31 token(s) scheduled" in titles
    assert "L: preempted (waiting), step 3; 1 token(s) scheduled" in titles
    assert "H: running, steps 2-4; 34 token(s) scheduled" in titles
    assert any(t.startswith("step 3: REQ_STATE: L is in num_scheduled_tokens") for t in titles)
    rows, left = step_rows(trace)
    assert [r.step for r in rows] == [1, 2, 3, 4] and left == 0


def test_a_data_parallel_run_gets_a_timeline_and_steps_per_engine_core():
    """Lines of two DP ranks (each engine core numbers its own steps): one timeline and one
    step table per DP rank, each with that rank's requests only; without ranks, one of each."""
    result = RunResult("clean", steps=2, finished={"a": "FINISHED_STOPPED", "b": "FINISHED_STOPPED"})
    trace = [TraceLine(step=1, dp_rank=1, added=["b"], scheduled={"b": 40}, running=["b"]),
             TraceLine(step=1, dp_rank=0, added=["a"], scheduled={"a": 100}, running=["a"]),
             TraceLine(step=2, dp_rank=0, scheduled={"a": 1}, finished=["a"],
                       throttle_prefills=True),
             TraceLine(step=2, dp_rank=1, scheduled={"b": 1}, finished=["b"])]
    page = PageContext(result, trace, [])
    timelines, steps = timeline_section(page), steps_section(page)
    assert re.findall(r"<h2>([^<]*)</h2>", timelines) == ["Timeline: DP rank 0",
                                                          "Timeline: DP rank 1"]
    assert re.findall(r"<h2>([^<]*)</h2>", steps) == ["Steps: DP rank 0", "Steps: DP rank 1"]
    rank0, rank1 = timelines.split("Timeline: DP rank 1")
    assert "a: " in rank0 and "b: " not in rank0 and "b: " in rank1 and "a: " not in rank1
    plain = PageContext(result, [TraceLine(step=1, added=["a"], scheduled={"a": 1})], [])
    assert re.findall(r"<h2>([^<]*)</h2>", steps_section(plain)) == ["Steps"]


def test_a_long_run_keeps_the_steps_where_something_changed():
    lines = [TraceLine(step=s, running=["A"], free_blocks=3) for s in range(1, 1001)]
    lines[499] = TraceLine(step=500, running=[], waiting=["A"], free_blocks=3)
    rows, left = step_rows(lines)
    assert [r.step for r in rows] == [1, 500, 501] and left == 997


def test_explain_a_clean_run():
    result = RunResult.from_json((RESULTS / "clean-engine-core-42117-0.22.0.json").read_text())
    [sentence] = explain(result)
    n = len(json.loads((RESULTS / "clean-engine-core-42117-0.22.0.json").read_text())["finished"])
    assert sentence == f"Every request finished ({n}) in {result.steps} steps, with no crash and no broken invariant."


def test_explain_a_clean_run_whose_kv_books_were_unread_says_so():
    """A V0 run whose block manager the audit cannot read (audit.unread): the page does not
    claim the KV cache's invariants held."""
    result = RunResult.from_json((RESULTS / "clean-engine-core-42117-0.22.0.json").read_text())
    result.audit.unread = ["PlaceholderBlockSpaceManager"]
    sentences = explain(result)
    assert sentences[1] == ("The audit could not read the KV books of PlaceholderBlockSpaceManager:"
                            " only the queues were checked, so the KV cache's invariants are "
                            "unknown.")


def test_the_index_groups_runs_by_scenario_failures_first_with_a_filter(tmp_path):
    reports = reports_from_recorded(tmp_path)
    page = write_index(reports).read_text()
    sections = re.findall(r"<section class='([^']*)' id=\"([^\"]+)\">", page)
    names = [n for _, n in sections]
    assert len(names) == len(set(names)) == len({d.name for d in reports.iterdir() if d.is_dir()})
    # the flagship has a failure (0.7.0 refuses its config: an error), so it comes first; the
    # rest, all as expected, follow by name
    bad = [n for c, n in sections if "bad" in c.split()]
    assert bad == ["vllm-23347-priority-preempt-scheduled"] and names[0] == bad[0]
    assert names[1:] == sorted(names[1:])
    # the filter: radio buttons whose CSS hides the sections and rows a choice leaves out
    assert "id='f-bad'" in page and "#f-bad:checked~main section:not(.bad)" in page
    flagship = page[page.index('id="vllm-23347'):].split("</section>")[0]
    assert re.findall(r"<tr class='run (\S+)'>", flagship) == ["ERROR", "yes", "yes"]
    # the scenario's description under its name, from its scenario.yaml
    assert "preempts the lowest-priority running request" in flagship


def test_a_run_page_shows_its_scenario_issue_links_other_releases_and_log_tail(tmp_path):
    reports = reports_from_recorded(tmp_path)
    flagship = reports / "vllm-23347-priority-preempt-scheduled"
    before = (flagship / "0.10.1.1" / "index.html").read_text()
    assert "<!-- releases --><!-- /releases -->" in before  # filled by the index
    write_index(reports)
    page = (flagship / "0.10.1.1" / "index.html").read_text()
    words = " ".join(text_of(page).split())
    # the issue and the fix, as links to GitHub
    assert "href='https://github.com/vllm-project/vllm/issues/23347'" in page
    assert "href='https://github.com/vllm-project/vllm/issues/23713'" in page
    # the same scenario on the other releases, this one marked
    nav = re.search(r"<p class='releases'>.*?</p>", page).group(0)
    assert re.findall(r"href='\.\./([^/]+)/index.html'", nav) == ["0.7.0", "0.10.1.1", "0.10.2"]
    assert "class='yes here'" in nav and "class='ERROR'" in nav
    # the scenario: its description, config (vLLM's names) and one row per request
    assert "In 0.9.2 to 0.10.1.1 that victim may be a request already scheduled" in words
    assert "config.policy priority" in words and "config.num_gpu_blocks 5" in words
    requests = re.search(r"<table class='requests'>.*?</table>", page, re.S).group(0)
    assert len(re.findall("<tr>", requests)) == 3  # the header, L and H
    # the engine log's last lines, not its first
    assert "Engine log (last 40 of 60 lines)" in words
    assert "line 59" in words and "line 19" not in words.split("Engine log")[1]
    # a run without a scenario file or engine log has neither section (and no empty heading)
    bare = tmp_path / "bare"
    bare.mkdir()
    result = RunResult.from_json((RESULTS / "clean-engine-core-42117-0.22.0.json").read_text())
    text = write_run_page(bare, result).read_text()
    assert "<h2>Scenario</h2>" not in text and "Engine log" not in text
