"""The checks of issue 14 ("the audit sees more") over fake books: residue of finished requests,
starved running requests, unreported preemptions, the worker's persistent batch, and
num_computed_tokens past max_model_len. No release needed (tests/unit/fakes.py)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from vllm_repro.audit import Auditor
from vllm_repro.audit.checks import RequestChecks, StarvationCheck, check_residue
from vllm_repro.audit.codes import (BATCH_LIMIT, PREEMPT_UNREPORTED, REQ_OVER_MAX_LEN,
                                    REQ_RESIDUE, REQ_STARVED, WORKER_BATCH_OVERFLOW)
from vllm_repro.engine.fake_runner import PersistentBatch
from vllm_repro.records import TraceLine

from .fakes import RequestStatus, make_books, make_output, vf


def codes(found) -> list[str]:
    return [vf(v, "code") for v in found]


def attached(**kw):
    books, s = make_books(**kw)
    loop = SimpleNamespace(scheduler=s, step=0, finished={}, created=dict.fromkeys(s.requests))
    aud = Auditor(SimpleNamespace(computed_advanced_in_schedule=True, vllm_file=""),
                  keep_going=True)
    aud.attach(loop)
    return aud, books, s, loop


def finish_request(books, s, rid: str) -> None:
    """What Scheduler._free_request does in the fakes: blocks back, the request gone."""
    req = s.requests.pop(rid)
    s.running.remove(req)
    for m in books.managers:
        books.pool.free_blocks(m.req_to_blocks.pop(rid, []))


# ---- REQ_RESIDUE ----------------------------------------------------------------------------

def test_residue_walk_skips_the_reasoning_parsers_vocabulary():
    """0.9 to 0.11 keep one reasoning parser on the StructuredOutputManager, with the
    tokenizer's vocabulary as ``reasoner.vocab``: its key ``A`` is a token, not request A; a
    grammar backend of vLLM's is still walked."""
    from types import ModuleType

    from vllm_repro.engine.state import per_request_owners

    mod = ModuleType("vllm.reasoning.fake")
    ns: dict = {"__name__": mod.__name__}
    exec("class ReasoningParser:\n    pass\n"
         "class DeepSeekR1ReasoningParser(ReasoningParser):\n"
         "    def __init__(self):\n        self.vocab = {'A': 293, '</think>': 356}\n"
         "class Backend:\n    def __init__(self):\n        self.grammars = {'A': 1}\n", ns)
    som = type("StructuredOutputManager", (), {})()
    som.reasoner = ns["DeepSeekR1ReasoningParser"]()
    som.backend = ns["Backend"]()
    sched = type("Scheduler", (), {})()
    sched.structured_output_manager = som
    labels = [label for label, _ in per_request_owners(sched)]
    assert "StructuredOutputManager.backend" in labels
    assert "StructuredOutputManager.reasoner" not in labels


def test_residue_finds_keys_of_finished_requests_in_any_dict_or_set_attribute():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1], "B": [2]})
    a = s.requests["A"]
    s.per_step_ids = {"A"}  # a set keyed by id, any name
    s.by_request = {a: "stage"}  # a dict keyed by the request object
    books.managers[0].num_cached_block = defaultdict(int)
    finish_request(books, s, "A")
    books.managers[0].num_cached_block["A"]  # a defaultdict read after the free: the key stays
    found = check_residue(books, {"A", "B"}, {"A": 3}, before_step=5, end_step=9)
    (v,) = found
    assert (vf(v, "code"), vf(v, "step"), vf(v, "requests")) == (REQ_RESIDUE, 3, ["A"])
    msg = vf(v, "message")
    assert msg.startswith("A left the scheduler at step 3 but is still a key of")
    for where in ("Scheduler.per_step_ids (set)", "Scheduler.by_request (dict, value 'stage')",
                  "SingleTypeManager[g0].num_cached_block (dict, value 0)"):
        assert where in msg
    assert "(step 9)" in msg


def test_residue_leaves_the_last_steps_ids_and_unseen_keys_alone():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1]})
    finish_request(books, s, "A")
    s.finished_req_ids = {"A"}  # handed to the worker by the next schedule(): not a residue
    s.layer_names = {"model.layers.0": 1}  # keys that are no request id
    assert check_residue(books, {"A"}, {"A": 5}, before_step=5, end_step=5) == []
    assert codes(check_residue(books, {"A"}, {"A": 4}, before_step=5, end_step=5)) == [REQ_RESIDUE]


def test_the_auditor_reports_residue_at_the_end_of_a_clean_run_at_the_step_it_left():
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1], "B": [2]})
    finish_request(books, s, "A")
    books.managers[0].req_to_blocks["A"] = []  # an empty entry: no block held (no KV_LEAK)
    loop.finished = {"A": "FINISHED_STOPPED"}
    aud.after_update(2, make_output({}), TraceLine(2, finished=["A"]))
    s.requests["B"].num_computed_tokens = 1
    aud.after_schedule(3, make_output({"B": 1}, cached={"B": 0}), None)
    finish_request(books, s, "B")
    loop.finished["B"] = "FINISHED_STOPPED"
    aud.after_update(3, make_output({"B": 1}), TraceLine(3, finished=["B"]))
    loop.step = 3
    assert aud.finish(loop, "clean") is True
    (v,) = aud.violations
    assert (vf(v, "code"), vf(v, "step"), vf(v, "phase")) == (REQ_RESIDUE, 2, "end of run")
    assert ".req_to_blocks (dict, value [])" in vf(v, "message")


# ---- REQ_STARVED ----------------------------------------------------------------------------

def running_pair(**kw):
    """A and B decoding (one token pending each), 32 blocks, a 64-token budget."""
    books, s = make_books(num_gpu_blocks=32, tables={"A": [1], "B": [2]}, **kw)
    for r in s.running:
        r.num_computed_tokens = r.num_tokens - 1
    return books, s


def test_a_running_request_skipped_in_a_step_with_room_is_starved():
    books, s = running_pair()
    (v,) = StarvationCheck(books).check(make_output({"A": 1}, cached={"A": 15}))
    assert (vf(v, "code"), vf(v, "requests")) == (REQ_STARVED, ["B"])
    assert vf(v, "message").startswith(
        "B is running with 1 token(s) pending (num_computed_tokens 15) but got none in a step "
        "that scheduled 1 of 64 tokens (63 left) and left 29 blocks free")


def test_no_starvation_where_the_scheduler_had_no_room_or_withholds():
    books, s = running_pair()
    check = StarvationCheck(books)
    b = s.requests["B"]
    assert check.check(make_output({"A": 64}, cached={"A": 0})) == []  # no budget left
    assert check.check(make_output({"A": 1}), paused=True) == []  # the scenario paused it
    s._pause_state = SimpleNamespace(name="PAUSED_ALL")
    assert check.check(make_output({"A": 1})) == []
    del s._pause_state
    s.connector = object()  # pending block frees may stop the running loop
    assert check.check(make_output({"A": 1})) == []
    del s.connector
    b.num_computed_tokens = b.num_tokens  # nothing pending
    assert check.check(make_output({"A": 1})) == []
    b.num_computed_tokens = b.num_tokens - 1
    b.num_output_placeholders = 1  # async: the token in flight may end it (no max_tokens known)
    assert check.check(make_output({"A": 1})) == []
    b.num_output_placeholders = 0
    s.scheduled_req_ids = {"B"}  # in flight in the batch queue
    assert check.check(make_output({"A": 1})) == []
    del s.scheduled_req_ids
    b.num_computed_tokens = s.max_model_len - 1  # at the max_model_len cap
    b.num_prompt_tokens = s.max_model_len
    assert check.check(make_output({"A": 1})) == []


def test_no_starvation_when_the_pool_could_not_serve_it():
    books, s = running_pair()
    books.pool.free_block_queue.num_free_blocks = 1  # B may need up to 2 blocks
    assert StarvationCheck(books).check(make_output({"A": 1})) == []


def test_the_auditor_skips_starvation_in_a_step_with_a_preemption():
    aud, books, s, loop = attached(num_gpu_blocks=32, tables={"A": [1], "B": [2], "C": [3]})
    for r in s.running:
        r.num_computed_tokens = r.num_tokens - 1
    c = s.requests["C"]
    s.running.remove(c)
    books.pool.free_blocks(books.managers[0].req_to_blocks.pop("C"))
    c.status, c.num_computed_tokens = RequestStatus.PREEMPTED, 0
    s.waiting.append(c)
    s.requests["A"].num_computed_tokens += 1
    aud.after_schedule(4, make_output({"A": 1}, cached={"A": 15}), None)
    assert REQ_STARVED not in codes(aud.violations)


# ---- PREEMPT_UNREPORTED ---------------------------------------------------------------------

def preempting_scheduler(report):
    """Fake books whose schedule() preempts C (the last running request) and reports
    ``report`` as preempted_req_ids (the attribute left out when ``report`` is ...)."""
    books, s = make_books(num_gpu_blocks=32, tables={"A": [1], "C": [3]})

    def schedule():
        c = s.running.pop()
        books.pool.free_blocks(books.managers[0].req_to_blocks.pop(c.request_id))
        c.status, c.num_computed_tokens = RequestStatus.PREEMPTED, 0
        s.waiting.appendleft(c)
        s.requests["A"].num_computed_tokens += 1
        so = make_output({"A": 1}, cached={"A": 0})
        if report is not ...:
            so.preempted_req_ids = report
        return so

    s.schedule = schedule
    return books, s


def run_one_step(books, s):
    loop = SimpleNamespace(scheduler=s, step=1, finished={}, created=dict.fromkeys(s.requests))
    aud = Auditor(SimpleNamespace(computed_advanced_in_schedule=True, vllm_file=""),
                  keep_going=True)
    aud.attach(loop)
    so = s.schedule()  # through the auditor's wrapper: it reads running first
    aud.after_schedule(1, so, None)
    return aud


def test_a_preemption_missing_from_preempted_req_ids_is_unreported():
    aud = run_one_step(*preempting_scheduler(set()))
    (v,) = [v for v in aud.violations if vf(v, "code") == PREEMPT_UNREPORTED]
    assert (vf(v, "step"), vf(v, "requests")) == (1, ["C"])
    assert "C was preempted in this step's schedule() but is not in its" in vf(v, "message")


def test_a_reported_preemption_and_a_release_without_the_field_are_fine():
    assert PREEMPT_UNREPORTED not in codes(run_one_step(*preempting_scheduler({"C"})).violations)
    books, s = preempting_scheduler(...)
    own = s.schedule
    aud = run_one_step(books, s)
    assert PREEMPT_UNREPORTED not in codes(aud.violations)
    assert s.schedule is own  # unwrapped at the first output without the field


def test_the_schedule_wrapper_is_removed_at_the_end_of_the_run():
    books, s = preempting_scheduler(set())
    own = s.schedule
    aud = run_one_step(books, s)
    aud.finish(SimpleNamespace(step=1, created={}, finished={}), "violation")
    assert s.schedule is own


# ---- WORKER_BATCH_OVERFLOW ------------------------------------------------------------------

def test_the_persistent_batch_frees_unscheduled_and_finished_slots_and_overflows_past_its_size():
    pb = PersistentBatch(2)
    pb.update(1, ["A", "B"])
    pb.update(2, ["B", "C"])  # A not scheduled: its slot is free again
    assert pb.slots == {"B", "C"} and pb.overflow == []
    pb.update(3, ["C", "D"], finished_ids=["B"])
    assert pb.slots == {"C", "D"} and pb.overflow == []
    pb.update(4, ["C", "D", "E"])
    assert pb.overflow == [(4, "E", 2, 2)]


def test_the_auditor_reports_the_runners_overflow_at_its_step():
    aud, books, s, loop = attached(num_gpu_blocks=8, tables={"A": [1]})
    loop.runner = SimpleNamespace(slots=PersistentBatch(1))
    loop.runner.slots.update(2, ["A", "X"])
    aud.after_update(2, make_output({}), TraceLine(2))
    (v,) = aud.violations
    assert (vf(v, "code"), vf(v, "step"), vf(v, "requests")) == (WORKER_BATCH_OVERFLOW, 2, ["X"])
    aud.after_update(3, make_output({}), TraceLine(3))
    assert len(aud.violations) == 1  # read once


# ---- REQ_OVER_MAX_LEN and BATCH_LIMIT's draft counts ----------------------------------------

def test_num_computed_tokens_past_max_model_len():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1]}, max_model_len=16)
    a = s.requests["A"]
    a.num_computed_tokens = 17
    found = RequestChecks(books).check("schedule", make_output({}), [])
    (v,) = [v for v in found if vf(v, "code") == REQ_OVER_MAX_LEN]
    assert vf(v, "requests") == ["A"]
    assert vf(v, "message").startswith("A num_computed_tokens 17 is over max_model_len 16")
    a.num_computed_tokens = 16
    found = RequestChecks(books).check("schedule", make_output({}), [])
    assert REQ_OVER_MAX_LEN not in codes(found)


def test_draft_tokens_must_belong_to_a_scheduled_count():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1], "B": [2]})
    for r in s.running:
        r.num_computed_tokens = 3
    so = make_output({"A": 3}, cached={"A": 0, "B": 3}, spec={"A": [7, 7, 7, 7], "B": [7]})
    s.requests["B"].num_computed_tokens = 3
    found = [v for v in RequestChecks(books).check("schedule", so, []) if vf(v, "code") == BATCH_LIMIT]
    msgs = sorted(vf(v, "message") for v in found)
    assert msgs == ["A is scheduled with 3 tokens but 4 draft tokens (expected the drafts to be "
                    "part of its scheduled count)",
                    "B has 1 draft tokens in scheduled_spec_decode_tokens but no "
                    "num_scheduled_tokens entry (expected drafts only for a scheduled request)"]


def test_residue_walks_vllm_objects_under_the_connector_but_not_a_tokenizer_or_a_script():
    books, s = make_books(num_gpu_blocks=8, tables={"A": [1]})
    finish_request(books, s, "A")
    half = type("SchedulerHalf", (), {"__module__": "vllm.distributed.kv_transfer.x"})()
    half.load_pending = {"A": 1}
    tok = type("Tokenizer", (), {"__module__": "transformers.tokenization"})()
    tok.encoder = {"A": 32}  # a vocabulary: keyed by strings, not by requests
    lab = type("ScriptedConnector", (), {"__module__": "vllm_repro.engine.connector",
                                        "audit_static_attrs": ("script",)})()
    lab.script, lab.half, lab.tok = {"A": {"hits": 16}}, half, tok
    s.connector = lab
    (v,) = check_residue(books, {"A"}, {"A": 1}, before_step=2, end_step=3)
    assert vf(v, "message").count(" (dict") == 1
    assert "KVConnector.half.load_pending (dict, value 1)" in vf(v, "message")
