"""The engine's pure parts without any vLLM release: the adapter's probes (parameters through
``*args, **kwargs`` wrappers, calls with the supported keywords), the lab's prompt tokens, the
package's re-exports, and the fake model runner on fake requests."""

from __future__ import annotations

import pytest

from vllm_repro.engine.adapter import (EOS_TOKEN_ID, AdapterError, Scheduled, V1Adapter,
                                       _import, _source_has, _try_import, call_supported,
                                       init_params, iter_queue, params_of, token_stream)
from vllm_repro.engine.fake_runner import FakeModelRunner

from .fakes import Request


# ---- probes --------------------------------------------------------------------------------
def test_params_of_names_keywords_and_var_kw():
    def f(a, b=1, *args, c, **kw):
        pass

    assert params_of(f) == ({"a", "b", "c"}, True)
    assert params_of(lambda x: x) == ({"x"}, False)


class Base:
    def __init__(self, vllm_config, kv_cache_config, block_size=16):
        self.kw = dict(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                       block_size=block_size)


class Forwarder(Base):  # like AsyncScheduler.__init__(self, *args, **kwargs)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_init_params_looks_through_a_pure_forwarder():
    names, var_kw = init_params(Forwarder)
    assert names - {"self"} == {"vllm_config", "kv_cache_config", "block_size"} and not var_kw
    # read directly, the forwarder would say "takes any keyword"
    assert params_of(Forwarder.__init__)[1] is True


def test_call_supported_drops_what_the_constructor_does_not_take():
    obj = call_supported(Forwarder, vllm_config=1, kv_cache_config=2, scheduler_config=3)
    assert obj.kw == {"vllm_config": 1, "kv_cache_config": 2, "block_size": 16}

    def takes_all(**kw):
        return kw

    assert call_supported(takes_all, a=1, b=2) == {"a": 1, "b": 2}


def test_import_takes_the_first_that_exists_and_says_why_none_did():
    assert _import("no_such_mod_xyz:thing", "os.path:join") is __import__("os").path.join
    assert _import("json") is __import__("json")
    with pytest.raises(AdapterError, match="none of no_such_mod_xyz, os:no_such_attr"):
        _import("no_such_mod_xyz", "os:no_such_attr")
    assert _try_import("no_such_mod_xyz") is None


def test_source_has():
    def f():
        x = 0
        x += 1  # num_computed_tokens +=
        return x

    assert _source_has(f, "num_computed_tokens +=")
    assert not _source_has(f, "something else")
    assert not _source_has(len, "x")  # no readable source
    assert not _source_has(None, "x")


def test_token_stream_is_deterministic_and_never_eos():
    a = token_stream("A", 50)
    assert a == token_stream("A", 50) and a != token_stream("B", 50)
    assert token_stream("A", 10, offset=40) == a[40:]
    assert EOS_TOKEN_ID not in a and all(t >= 3 for t in a)


def test_adapter_package_reexports_and_composes():
    assert iter_queue([1, 2]) == [1, 2]
    for name in ("build", "make_request", "front_door", "abort", "scheduled", "model_output",
                 "deliver_drafts", "stat_logger", "scheduler_stats", "has_work", "block_pool",
                 "num_free_blocks", "queues"):
        assert hasattr(V1Adapter, name), name


def test_scheduler_stats_reads_every_output_shape():
    from types import SimpleNamespace as NS

    st = object()
    assert V1Adapter.scheduler_stats({0: NS(scheduler_stats=st), 1: NS()}) == [st]
    assert V1Adapter.scheduler_stats(NS(scheduler_stats=st)) == [st]
    assert V1Adapter.scheduler_stats([NS(scheduler_stats=st)]) == []


# ---- the fake model runner -----------------------------------------------------------------
def reqs(**prompt_lens):
    return {rid: Request(rid, n) for rid, n in prompt_lens.items()}


def test_runner_samples_only_after_the_prefill_completes():
    runner = FakeModelRunner({"token": 7}, None)
    r = reqs(A=10)
    ids, sampled, drafts = runner.execute(1, [Scheduled("A", 6, 0, [], True)], r)
    assert (ids, sampled, drafts) == (["A"], [[]], None)  # a partial prefill chunk
    ids, sampled, _ = runner.execute(2, [Scheduled("A", 4, 6, [], False)], r)
    assert sampled == [[7]]


def test_runner_emits_eos_at_the_asked_output_length_and_empty_steps():
    runner = FakeModelRunner({"token": 7, "eos_at": {"A": 2}, "empty_at": {"A": [3]}}, None)
    r = reqs(A=4)
    assert runner.execute(1, [Scheduled("A", 4, 0, [], True)], r)[1] == [[7]]
    r["A"].num_output_tokens = 1
    assert runner.execute(2, [Scheduled("A", 1, 4, [], False)], r)[1] == [[EOS_TOKEN_ID]]
    assert runner.execute(3, [Scheduled("A", 1, 5, [], False)], r)[1] == [[]]


def test_runner_verifies_drafts_and_proposes_more():
    runner = FakeModelRunner({"token": 7, "draft_tokens": [8, 9],
                              "spec_decode": {"accept": {"A": 1}}}, 2)
    r = reqs(A=4)
    ids, sampled, drafts = runner.execute(1, [Scheduled("A", 3, 4, [8, 9], False)], r)
    assert sampled == [[8, 7]]  # one accepted draft + the bonus token
    assert drafts == [[8, 9]]


def test_runner_accepts_per_verification_and_proposes_per_step():
    """``accept: {A: [2, 0, 1]}``: A's first verification accepts 2 drafts, the second none,
    the third 1, then all; a step without drafts is no verification. ``propose: {A: [2, 0]}``:
    after A's first sampling step 2 drafts, after the second none, then all of
    ``draft_tokens``."""
    runner = FakeModelRunner({"token": 7, "draft_tokens": [8, 9, 10],
                              "spec_decode": {"accept": {"A": [2, 0, 1]},
                                              "propose": {"A": [2, 0]}}}, 3)
    r = reqs(A=4)
    got = []
    for step, spec in enumerate(([8, 9, 10], [], [8, 9, 10], [8, 9, 10], [8, 9, 10]), 1):
        _, sampled, drafts = runner.execute(step, [Scheduled("A", 1 + len(spec), 4, spec, False)], r)
        got.append((sampled[0], drafts[0]))
    assert got == [([8, 9, 7], [8, 9]),         # verification 1: 2 accepted; 2 proposed
                   ([7], []),                   # no drafts scheduled; none proposed
                   ([7], [8, 9, 10]),           # verification 2: 0 accepted; list over: all
                   ([8, 7], [8, 9, 10]),        # verification 3: 1 accepted
                   ([8, 9, 10, 7], [8, 9, 10])]  # past the list: all accepted


def test_runner_skips_a_never_seen_request_without_data():
    runner = FakeModelRunner({}, None)
    assert runner.execute(1, [Scheduled("Z", 1, None, [], False)], reqs(Z=4))[1] == [[]]
