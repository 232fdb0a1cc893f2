"""Issue 46 on real releases: a livelock planted in a copy of 0.10.1.1's ``Scheduler.schedule``
ends as ``hang`` within the watchdog's time, naming the looping frame, with no process left;
vLLM's own refusal of a configuration judged as ``outcome: refused``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vllm_repro.engine.host import Worker
from vllm_repro.scenario.schema import Scenario
from vllm_repro.sources.prepare import prepare_release

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PLANTS = ROOT / "tests" / "integration" / "plant_faults.py"
RELEASE = "0.10.1.1"


def small(level: str, timeout_s: float) -> Scenario:
    return Scenario.model_validate({
        "name": f"livelock-{level}", "level": level,
        "config": {"block_size": 16, "num_gpu_blocks": 32, "max_num_seqs": 4,
                   "max_num_batched_tokens": 64, "max_model_len": 256},
        "requests": [{"id": "A", "prompt_len": 40, "max_tokens": 8},
                     {"id": "B", "prompt_len": 20, "max_tokens": 8}],
        "limits": {"max_steps": 30, "step_timeout_s": timeout_s}})


def _alive_in_group(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


@pytest.mark.parametrize("level", ["scheduler", "engine-core"])
def test_a_livelock_in_schedule_ends_as_hang_naming_the_loop(tmp_path, level):
    limit = 3.0
    env = prepare_release(RELEASE)
    with Worker(env, tmp_path / "engine.log") as worker:
        pid = worker.proc.pid
        t0 = time.monotonic()
        res = worker.run(small(level, limit).child_payload(), tmp_path / "out", audit=True,
                         keep_going=True, plant=f"{PLANTS}:livelock_in_schedule",
                         plant_args={"at_step": 3})
        took = time.monotonic() - t0
        # the worker lives on: a second, unplanted run is clean
        again = worker.run(small(level, limit).child_payload(), tmp_path / "again")
    assert res.outcome == "hang", (res.outcome, res.error, res.crash)
    h = res.hang
    assert h.step == 3 and h.limit_s == limit and h.stopped == "interrupted"
    assert h.where.where() == "vllm/v1/core/sched/scheduler.py:schedule"
    assert h.where.line in res.planted["notes"]["lines"]
    assert h.phase in ("schedule", "step")
    # the stacks are dumped a moment after the frame is read: either of the loop's two lines
    loop = res.planted["notes"]["lines"]
    assert any(f"line {n} in schedule" in h.stacks for n in loop), h.stacks[-3000:]
    assert h.stacks.lower().count("thread 0x") >= 2
    assert limit <= took < limit + 30, took
    assert again.outcome == "clean", (again.outcome, again.stall, again.crash)
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists() or _alive_in_group(pid) == []


REFUSED = """
name: {name}
vllm: {{reproduces_on: ["0.10.1.1"], clean_on: ["0.10.2"]}}
config: {config}
requests:
  - {{id: A, prompt_len: 20, max_tokens: 40}}
{more}
expect: {{outcome: crash}}
fixed: {fixed}
"""


def test_vllms_refusals_are_outcome_refused_where_expected(cli, tmp_path):
    """0.10.2's SchedulerConfig refuses max_num_seqs over max_num_batched_tokens (a pydantic
    ValidationError); its front door refuses a prompt longer than max_model_len, and takes a
    prompt plus max_tokens over it (vLLM caps the output). Where the scenario expects a run
    (0.10.1.1, expect: crash) the same refusal stays an input error: exit 2."""
    config = ("{num_gpu_blocks: 32, max_num_seqs: 64, max_num_batched_tokens: 32, "
              "max_model_len: 32}")
    (tmp_path / "cfg.yaml").write_text(REFUSED.format(
        name="refused-cfg", config=config, more="",
        fixed="{outcome: refused, exception: ValidationError, phase: config, "
              "message: 'max_num_batched_tokens \\(32\\) must be greater than or equal to "
              "max_num_seqs'}"))
    done = cli("run", str(tmp_path / "cfg.yaml"), "--vllm", "0.10.2", "--reports",
               str(tmp_path / "r"))
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads((tmp_path / "r" / "refused-cfg" / "0.10.2" / "result.json").read_text())
    assert res["outcome"] == "refused" and res["refusal"]["type"] == "ValidationError"
    assert "error" not in res
    done = cli("run", str(tmp_path / "cfg.yaml"), "--vllm", "0.10.1.1", "--reports",
               str(tmp_path / "r"))
    assert done.returncode == 2, done.stdout + done.stderr

    (tmp_path / "long.yaml").write_text(REFUSED.format(
        name="refused-long", config="{num_gpu_blocks: 32, max_model_len: 32}",
        more="  - {id: B, prompt_len: 40, max_tokens: 4}",
        fixed="{outcome: refused, phase: add_request, exception: ValueError, "
              "message: 'prompt \\(length 40\\) is longer than the maximum model length'}"))
    done = cli("run", str(tmp_path / "long.yaml"), "--vllm", "0.10.2", "--reports",
               str(tmp_path / "r"))
    assert done.returncode == 0, done.stdout + done.stderr
    # A alone (prompt 20 + max_tokens 40 > 32) is vLLM's to cap: it runs and finishes capped
    (tmp_path / "capped.yaml").write_text(REFUSED.format(
        name="capped", config="{num_gpu_blocks: 32, max_model_len: 32}", more="",
        fixed="{outcome: clean}").replace('reproduces_on: ["0.10.1.1"], ', ""))
    done = cli("run", str(tmp_path / "capped.yaml"), "--vllm", "0.10.2", "--reports",
               str(tmp_path / "r"))
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads((tmp_path / "r" / "capped" / "0.10.2" / "result.json").read_text())
    assert res["outcome"] == "clean" and res["finished"] == {"A": "FINISHED_LENGTH_CAPPED"}


def test_a_run_whose_every_request_the_release_refused_is_not_clean(cli, tmp_path):
    """The release's front door refuses the only request (0.34.0: an empty allowed_token_ids):
    nothing ran and nothing was checked, so the outcome is ``refused`` with that refusal, and a
    scenario expecting a clean run fails (exit 1); with a second request that runs, clean."""
    text = """
name: all-refused
level: engine-core
config: {num_gpu_blocks: 64, max_model_len: 256}
requests:
  - {id: A, prompt_len: 20, max_tokens: 5, allowed_token_ids: []}
"""
    (tmp_path / "a.yaml").write_text(text)
    done = cli("run", str(tmp_path / "a.yaml"), "--vllm", "0.34.0", "--reports",
               str(tmp_path / "r"))
    assert done.returncode == 1, done.stdout + done.stderr
    res = json.loads((tmp_path / "r" / "all-refused" / "0.34.0" / "result.json").read_text())
    assert res["outcome"] == "refused" and res["finished"] == {}
    assert res["refusal"]["phase"] == "add_request" and "A: " in res["refusal"]["message"]
    (tmp_path / "b.yaml").write_text(text + "  - {id: B, prompt_len: 20, max_tokens: 5}\n")
    done = cli("run", str(tmp_path / "b.yaml"), "--vllm", "0.34.0", "--reports",
               str(tmp_path / "r"))
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads((tmp_path / "r" / "all-refused" / "0.34.0" / "result.json").read_text())
    assert res["outcome"] == "clean" and list(res["refused"]) == ["A"]


def test_the_crash_page_shows_the_asserts_operands_in_a_browser(cli, tmp_path):
    """#23347 on 0.10.1.1, its page as headless Chromium renders it: the assert's statement in
    full and its operands with their values above the traceback, what schedule() had built (L
    both scheduled and preempted), the scenario's description and issue link."""
    import re
    import threading

    from vllm_repro.report.serve import make_server

    from ..conftest import FLAGSHIP
    from .test_report_browser import browser, load

    chromium = browser()
    reports = tmp_path / "reports"
    proc = cli("run", str(FLAGSHIP), "--vllm", "0.10.1.1", "--reports", str(reports))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    server = make_server(reports, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = (f"http://127.0.0.1:{server.server_address[1]}/"
               "vllm-23347-priority-preempt-scheduled/0.10.1.1/index.html")
        dom, console = load(chromium, url, tmp_path / "profile")
    finally:
        server.shutdown()
        server.server_close()
    assert not console, console

    def value(expr: str) -> str:
        m = re.search(rf"<td><code>{re.escape(expr)}</code></td><td><code>([^<]*)</code>", dom)
        assert m, f"{expr} not on the page"
        return m.group(1)

    assert value("len(self.running)") == "1"
    assert value("len(scheduled_running_reqs)") == "2"
    assert value("len(scheduled_new_reqs) + len(scheduled_resumed_reqs) + "
                 "len(scheduled_running_reqs)") == "2"
    assert value("preempted_reqs") == "[&lt;Request L&gt;]"
    assert "&lt;Request L&gt;" in value("scheduled_running_reqs")
    assert "assert (len(scheduled_new_reqs) + len(scheduled_resumed_reqs) +" in dom
    assert dom.index("len(self.running)") < dom.index("<h2>Traceback</h2>")
    assert "Scheduler.schedule() walks the running queue" in dom
    assert "href=\"https://github.com/vllm-project/vllm/issues/23347\"" in dom


def test_diff_names_step_3_with_l_scheduled_and_preempted(cli, tmp_path):
    """#23347 on 0.10.1.1 and 0.10.2: the first step whose decisions differ is step 3, where
    0.10.1.1's schedule() raised and 0.10.2's scheduled L and preempted it in the same call."""
    from ..conftest import FLAGSHIP

    args = ("diff", str(FLAGSHIP), "--vllm", "0.10.1.1", "--vllm", "0.10.2", "--reports",
            str(tmp_path / "r"))
    done = cli(*args)
    assert done.returncode == 1, done.stdout + done.stderr  # a step differs
    text = done.stdout
    assert "first difference at step 3 (scheduled, crash)" in text, text
    row = next(ln for ln in text.splitlines() if "scheduled (tokens)" in ln)
    assert "(schedule() did not return)" in row and "L=1 H=1" in row
    row = next(ln for ln in text.splitlines() if "preempted (by)" in ln)
    assert row.count("L (schedule)") == 2
    assert "on 0.10.2: L scheduled and preempted in one schedule() call" in text
    # the diff's page beside the runs, and both run pages link to it
    sdir = tmp_path / "r" / FLAGSHIP.stem
    page = (sdir / "diff-0.10.1.1-0.10.2.html").read_text()
    assert "first difference at step 3" in page and "L (schedule)" in page
    assert json.loads((sdir / "diff-0.10.1.1-0.10.2.json").read_text())["step"] == 3
    for release in ("0.10.1.1", "0.10.2"):
        run_page = (sdir / release / "index.html").read_text()
        assert "href='../diff-0.10.1.1-0.10.2.html'" in run_page, release
    done = cli(*args, "--json")
    data = json.loads(done.stdout)
    assert data["step"] == 3 and data["releases"] == ["0.10.1.1", "0.10.2"]
    assert data["decisions"]["0.10.2"]["scheduled"] == {"L": 1, "H": 1}
    assert data["decisions"]["0.10.2"]["preempted"] == {"L": "schedule"}
    assert data["scheduled_and_preempted"] == {"0.10.2": ["L"]}
    assert data["decisions"]["0.10.1.1"]["crash"].startswith("AssertionError vllm/v1/core/sched/")


RESET = """
name: reset-steps
level: engine-core
vllm: {{reproduces_on: ["0.33.0"]}}
config: {{block_size: 16, num_gpu_blocks: 64, max_num_seqs: 4, max_num_batched_tokens: 256,
          max_model_len: 256, enable_prefix_caching: true}}
requests:
  - {{id: A, prompt_len: 40, max_tokens: 8}}
  - {{id: B, prompt_len: 40, max_tokens: 8, at_step: 2}}
events:
  - {{at_step: 3, reset_prefix_cache: true, reset_running_requests: true}}
expect:
  outcome: clean
  steps:
    - {{at_step: 3, preempted: [A, B], preempted_by: {cause}, not_scheduled: []}}
    - {{at_step: 8, finished: {{A: length}}}}       # (B arrived a step later)
    - {{at_step: 9, finished: {{B: length}}}}
  stats:
    - {{at_step: 3, prefix_cache_stats.reset: 1}}
"""


def test_step_expectations_read_preemptions_by_an_event_at_engine_core(cli, tmp_path):
    """0.33.0's reset_prefix_cache(reset_running_requests=True) before step 3 preempts A and B:
    the trace says so with the cause, and expect.steps / expect.stats are judged on it."""
    path = tmp_path / "reset.yaml"
    path.write_text(RESET.format(cause="reset_prefix_cache"))
    done = cli("run", str(path), "--reports", str(tmp_path / "r"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(ln) for ln in
             (tmp_path / "r" / "reset-steps" / "0.33.0" / "trace.jsonl").read_text().splitlines()]
    assert lines[2]["preemptions"] == {"A": "reset_prefix_cache", "B": "reset_prefix_cache"}
    assert lines[2]["stats"]["prefix_cache_stats.reset"] == 1
    path.write_text(RESET.format(cause="schedule"))
    done = cli("run", str(path), "--reports", str(tmp_path / "r"))
    assert done.returncode == 1
    assert "step 3: A preempted by reset_prefix_cache, not schedule" in done.stdout + done.stderr
