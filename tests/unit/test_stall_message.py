"""A stall says where each unfinished request is stuck (``Stall.message``), and a scenario's
``expect.message`` tells two stalls apart by it: #35541's request needs more KV blocks than the
whole pool, the exact-fit pool (``num_gpu_blocks_override`` equal to max_model_len's blocks)
lacks only the null block, #42117's request sits in running with a placeholder for a token
that is not in flight."""

from __future__ import annotations

from vllm_repro.engine.state import stall_message
from vllm_repro.fuzz.search import failure_message
from vllm_repro.verdict import judge

from .builders import make_result, make_scenario
from .fakes import Request, RequestStatus, make_books

#: the catalog's #35541 and #42117 stall messages (their expect.message)
LARGER_THAN_POOL = r"needs \d+ KV blocks for its \d+ tokens, more than the pool's"
PLACEHOLDER = r"in running, \d+ output placeholder"


def _scheduler(num_gpu_blocks: int, *reqs: Request):
    _, s = make_books(num_gpu_blocks, requests=list(reqs))
    s.kv_cache_manager.block_pool.num_gpu_blocks = num_gpu_blocks  # BlockPool's own field
    return s


def _waiting(rid: str, prompt: int, max_tokens: int) -> Request:
    r = Request(rid, prompt)
    r.max_tokens = max_tokens
    return r


def test_a_request_larger_than_the_pool_and_one_short_of_the_null_block_read_differently():
    # #35541: 1002 + 8 tokens, 64 blocks of 16, a pool of 50
    s = _scheduler(50, _waiting("huge", 1002, 8))
    msg = stall_message(s, ["huge"], ["huge"], [], 16)
    assert msg == "huge in waiting, needs 64 KV blocks for its 1009 tokens, more than the pool's 50"
    # the exact fit: 230 + 10 tokens need 15 blocks, the pool has 15 with its null block
    s = _scheduler(15, _waiting("R0", 230, 10))
    msg = stall_message(s, ["R0"], ["R0"], [], 16)
    assert msg == ("R0 in waiting, needs 15 KV blocks for its 239 tokens, the pool's 15 with the "
                   "null block, 14 without")
    # a request that fits says only its queue
    assert stall_message(_scheduler(15, _waiting("R1", 100, 8)), ["R1"], ["R1"], [], 16) \
        == "R1 in waiting"


def test_a_running_request_with_a_placeholder_and_one_gone():
    a = Request("A", 20, RequestStatus.RUNNING)
    a.max_tokens, a.num_output_placeholders = 8, 1
    s = _scheduler(64, a)
    assert stall_message(s, ["A", "B"], [], ["A"], 16) == \
        "A in running, 1 output placeholder(s); B not in the scheduler"


def test_a_scheduler_without_a_pool_gets_the_queues_only():
    class V0Scheduler:  # no kv_cache_manager, no requests dict
        pass

    assert stall_message(V0Scheduler(), ["x"], ["x"], [], 16) == "x in waiting"


def _stall(message: str):
    return make_result("stall", stall={"step": 28, "since": 9, "unfinished": ["R0"],
                                       "message": message}, steps=28, unfinished=["R0"])


def test_expect_message_tells_two_stalls_apart_in_the_verdict_and_the_fuzzer():
    sc = make_scenario(level="engine-core", num_gpu_blocks=64, vllm={"reproduces_on": ["0.19.1"]},
                       expect={"outcome": "stall", "message": LARGER_THAN_POOL})
    larger = _stall("huge in waiting, needs 64 KV blocks for its 1009 tokens, more than the "
                    "pool's 50")
    exact = _stall("R0 in waiting, needs 15 KV blocks for its 239 tokens, the pool's 15 with "
                   "the null block, 14 without")
    assert judge(sc, "0.19.1", larger).ok is True
    v = judge(sc, "0.19.1", exact)
    assert v.ok is False and "does not match" in v.reason
    # the fuzzer's --target-message reads the same text
    assert failure_message(larger).endswith("more than the pool's 50")
    placeholder = _stall("A in running, 1 output placeholder(s)")
    sc42 = make_scenario(level="engine-core", num_gpu_blocks=64, vllm={"reproduces_on": ["0.21.0"]},
                         expect={"outcome": "stall", "message": PLACEHOLDER})
    assert judge(sc42, "0.21.0", placeholder).ok is True
    assert judge(sc42, "0.21.0", exact).ok is False


def test_a_stalls_cause_names_a_kv_load_and_blocks_held_by_others():
    """Issue 46: stalls that all read "A in waiting" before now say why, with a cause tag the
    fuzz signature carries (stall:CAUSE)."""
    from vllm_repro.engine.state import stall_cause, stall_clauses
    from vllm_repro.fuzz.search import signature

    loading = _waiting("L", 32, 4)
    loading.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    s = _scheduler(50, loading)
    s.connector = object()
    clauses = stall_clauses(s, ["L"], ["L"], [], 16)
    assert clauses == [("L in waiting, waits for its KV load (WAITING_FOR_REMOTE_KVS), which "
                        "the worker never reported finished", "kv-load-in-flight")]
    s.finished_recving_kv_req_ids = {"L"}
    ((text, cause),) = stall_clauses(s, ["L"], ["L"], [], 16)
    assert cause == "kv-load-not-promoted" and "never promoted" in text
    # a waiting request whose next tokens need more blocks than are free: who holds them
    books, s = make_books(8, tables={"A": [1, 2, 3, 4, 5, 6]}, requests=[_waiting("B", 40, 4)])
    s.kv_cache_manager.block_pool.num_gpu_blocks = 8
    ((text, cause),) = stall_clauses(s, ["B"], ["B"], ["A"], 16)
    assert cause == "no-free-blocks", text
    assert "needs 3 KV blocks for its next 40 tokens, 1 free (held by A (6))" in text
    # a step that scheduled it with 0 tokens
    ((text, cause),) = stall_clauses(s, ["A"], [], ["A"], 16, {"A": 0})
    assert cause == "zero-tokens" and text.endswith("scheduled with 0 tokens in the last step")
    assert stall_cause([("x", "zero-tokens"), ("y", "kv-load-in-flight")]) == "kv-load-in-flight"
    result = make_result("stall", stall={"step": 9, "since": 1, "cause": "kv-load-in-flight"})
    assert signature(result) == "stall:kv-load-in-flight"
