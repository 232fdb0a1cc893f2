"""Why a crash happened (issue 46): the innermost vLLM frame's statement, locals and a failed
assert's operands, as the worker records them (``engine/explain.py``), on a module under a
folder named ``vllm`` (no release)."""

from __future__ import annotations

import importlib.util
import textwrap

from vllm_repro.engine.explain import MAX_REPR, crash_context, short_repr
from vllm_repro.engine.loop import describe_exception
from vllm_repro.records import Crash

SOURCE = textwrap.dedent('''
    class Request:
        def __init__(self, request_id):
            self.request_id = request_id


    def schedule(running, calls):
        import time
        scheduled_timestamp = time.monotonic()
        num_steps = 3.5
        scheduled = [Request("L"), Request("H")]
        preempted = [scheduled[0]]
        big = "x" * 5000
        assert (len(scheduled) +
                len(preempted) <= len(running)
                and calls.pop()), "inconsistent"
''')


def _crash(tmp_path):
    (tmp_path / "vllm").mkdir()
    path = tmp_path / "vllm" / "sched.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("vllm_fake_sched2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = [1, 2]
    try:
        mod.schedule([mod.Request("L")], calls)
    except AssertionError as exc:
        return exc, calls
    raise AssertionError("the planted assert did not fail")


def test_an_asserts_operands_are_evaluated_in_its_frame(tmp_path):
    exc, calls = _crash(tmp_path)
    ctx = crash_context(exc.__traceback__, tmp_path / "vllm")
    assert ctx.statement.startswith("assert (len(scheduled) +\n")
    assert ctx.statement.endswith('and calls.pop()), "inconsistent"')
    assert ctx.operands["len(scheduled) + len(preempted)"] == "3"
    assert ctx.operands["len(scheduled)"] == "2"
    assert ctx.operands["len(preempted)"] == "1"
    assert ctx.operands["len(running)"] == "1"
    # a call that could change the frame's state is shown, not made
    assert ctx.operands["calls.pop()"].startswith("(not evaluated")
    assert calls == [1, 2]
    assert ctx.locals["scheduled"] == "[<Request L>, <Request H>]"
    assert ctx.locals["preempted"] == "[<Request L>]"
    assert len(ctx.locals["big"]) == MAX_REPR and ctx.locals["big"].endswith("...")
    # a clock reading differs run to run (a warm and a cold run must write the same result.json)
    assert ctx.locals["scheduled_timestamp"] == "<clock reading>"
    assert ctx.locals["num_steps"] == "3.5"


def test_the_crash_record_carries_it_and_survives_json(tmp_path):
    exc, _ = _crash(tmp_path)
    crash = describe_exception(exc, tmp_path / "vllm", 3, "schedule")
    assert crash.where.where() == "vllm/sched.py:schedule"
    back = Crash.from_json(crash.to_json())
    assert back.context.operands["len(running)"] == "1"
    assert back.brief().context is None  # the trace line's copy stays small


def test_no_vllm_frame_no_context(tmp_path):
    try:
        assert 1 > 2
    except AssertionError as exc:
        assert crash_context(exc.__traceback__, tmp_path / "vllm") is None


def test_short_repr_is_bounded_and_never_raises():
    class Bad:
        def __repr__(self):
            raise RuntimeError("no")

    assert short_repr(Bad()) == "<repr failed: RuntimeError>"
    assert short_repr(list(range(100))).endswith("... (100 in all)]")
    assert short_repr((1,)) == "(1,)"
