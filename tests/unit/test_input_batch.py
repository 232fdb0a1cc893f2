"""The release's InputBatch driven as GPUModelRunner._update_states drives it (issue #45):
the order of the calls, the slot assert as WORKER_BATCH_OVERFLOW, other failures as vLLM's.

The batch here is a stand-in with InputBatch's slot rules (append at the end, reuse a removed
slot, ``assert new_req_index < self.max_num_reqs``); the release's own class is exercised by
tests/integration/test_audit_plants.py and the catalog."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from vllm_repro.engine.input_batch import WORKER_STATE_ATTR, ReleaseInputBatch, worker_state


@dataclass
class State:  # CachedRequestState's fields the mirror fills
    req_id: str
    prompt_token_ids: list
    sampling_params: object
    generator: object
    block_ids: tuple
    num_computed_tokens: int
    output_token_ids: list = field(default_factory=list)


class Batch:
    def __init__(self, max_num_reqs: int, width: int = 64):
        import numpy as np

        self.max_num_reqs = max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.removed: list[int] = []
        self.calls: list[tuple] = []
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.token_ids_cpu = np.zeros((max_num_reqs, width), dtype=np.int32)
        self.block_table = SimpleNamespace(append_row=lambda ids, i: self.calls.append(
            ("append_row", i, ids)))

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, st) -> int:
        index = self.removed.pop(0) if self.removed else self.num_reqs
        assert index < self.max_num_reqs
        self.req_id_to_index[st.req_id] = index
        n = len(st.prompt_token_ids)
        self.num_prompt_tokens[index] = n
        self.num_tokens_no_spec[index] = n + len(st.output_token_ids)
        self.calls.append(("add", st.req_id))
        return index

    def remove_request(self, rid):
        index = self.req_id_to_index.pop(rid, None)
        if index is not None:
            self.removed.append(index)
            self.calls.append(("remove", rid))
        return index

    def condense(self):
        self.calls.append(("condense",))
        self.removed.clear()
        self.req_id_to_index = {rid: i for i, rid in enumerate(self.req_id_to_index)}


def new(rid, n=4):
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(range(n)), sampling_params=None,
                           block_ids=([1],), num_computed_tokens=0)


def output(new_reqs=(), cached=(), finished=(), resumed=(), scheduled=None):
    ids = [c[0] for c in cached]
    sched = scheduled or {**{r.req_id: 4 for r in new_reqs}, **{rid: 1 for rid in ids}}
    return SimpleNamespace(
        finished_req_ids=set(finished), num_scheduled_tokens=sched,
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=ids, resumed_req_ids=set(resumed),
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[c[2] for c in cached], num_output_tokens=[c[3] for c in cached],
            all_token_ids={}),
        scheduled_spec_decode_tokens={})


def make(max_num_reqs=2, max_model_len=64):
    return ReleaseInputBatch(Batch(max_num_reqs), State, max_model_len, False)


def test_new_running_finished_and_unscheduled_requests_in_update_states_order():
    wb = make(max_num_reqs=3)
    wb.update(1, None, (), output([new("A"), new("B")]))
    wb.after_sample(["A", "B"], [[7], [8]])
    assert wb.batch.req_id_to_index == {"A": 0, "B": 1}
    assert wb.requests["A"].output_token_ids == [7]
    assert wb.batch.num_tokens_no_spec[0] == 5 and wb.batch.token_ids_cpu[0, 4] == 7
    wb.batch.calls.clear()
    # A finished, B not scheduled (stays in requests, leaves the batch), C new
    wb.update(2, None, (), output([new("C")], finished=["A"]))
    assert wb.batch.calls == [("remove", "A"), ("remove", "B"), ("add", "C"), ("condense",)]
    assert "A" not in wb.requests and "B" in wb.requests
    wb.batch.calls.clear()
    # B back: running data with a new block, added again (not resumed: its blocks appended)
    wb.update(3, None, (), output(cached=[("B", 5, ([9],), 1)], scheduled={"B": 1, "C": 1}))
    assert wb.requests["B"].block_ids == ([1, 9],)
    assert ("add", "B") in wb.batch.calls and wb.requests["B"].num_computed_tokens == 5


def test_a_request_past_the_slots_is_an_overflow_and_the_step_goes_on():
    wb = make(max_num_reqs=2)
    wb.update(1, None, (), output([new("A"), new("B"), new("C")]))
    assert wb.overflow == [(1, "C", 2, 2)]
    assert set(wb.batch.req_id_to_index) == {"A", "B"}


def test_a_resumed_request_takes_its_new_blocks_and_without_them_fails_as_vllm_fails():
    wb = make(max_num_reqs=2)
    wb.update(1, None, (), output([new("A")]))
    # resumed ids leave the batch first (_update_states counts them as unscheduled), then the
    # request's block ids are replaced and it is added again
    wb.update(2, None, (), output(cached=[("A", 0, ([2],), 0)], resumed=["A"],
                                  scheduled={"A": 4}))
    assert wb.requests["A"].block_ids == ([2],) and "A" in wb.batch.req_id_to_index
    # a resumed request without new block ids: _update_states' assert, marked as vLLM's
    with pytest.raises(AssertionError) as err:
        wb.update(3, None, (), output(cached=[("A", 0, None, 0)], resumed=["A"],
                                      scheduled={"A": 4}))
    assert getattr(err.value, WORKER_STATE_ATTR) is True


def test_tokens_past_max_model_len_fail_the_runners_assert():
    wb = make(max_num_reqs=1, max_model_len=5)
    wb.update(1, None, (), output([new("A")]))
    wb.after_sample(["A"], [[7]])
    with pytest.raises(AssertionError, match="exceed the max model length") as err:
        wb.after_sample(["A"], [[8]])
    assert getattr(err.value, WORKER_STATE_ATTR) is True


def test_the_environment_picks_the_lab_model_or_refuses_an_unknown_mode(monkeypatch):
    monkeypatch.setenv("VLLM_REPRO_WORKER_STATE", "lab")
    assert worker_state(SimpleNamespace(), {}) is None
    monkeypatch.setenv("VLLM_REPRO_WORKER_STATE", "gpu")
    with pytest.raises(ValueError, match="VLLM_REPRO_WORKER_STATE='gpu'"):
        worker_state(SimpleNamespace(), {})


def test_build_gives_the_release_inputbatch_the_runners_num_speculative_tokens(monkeypatch):
    """0.10.2 to 0.12's InputBatch takes ``num_speculative_tokens`` (its MultiGroupBlockTable
    sizes each row ``max(cdiv(max_model_len, block_size), 1 + num_speculative_tokens)``), which
    GPUModelRunner passes from the speculative config: the lab passes the same count."""
    import sys

    from vllm_repro.engine import input_batch as m

    built = {}

    class InputBatch:  # 0.11.0's signature (vllm/v1/worker/gpu_input_batch.py)
        def __init__(self, max_num_reqs, max_model_len, max_num_batched_tokens, device,
                     pin_memory, vocab_size, block_sizes, logitsprocs=None,
                     is_spec_decode=False, is_pooling_model=False, num_speculative_tokens=0):
            built.update(locals())
            self.max_num_reqs = max_num_reqs

    @dataclass
    class CachedRequestData:
        req_ids: list

    classes = {"vllm.v1.worker.gpu_input_batch:InputBatch": InputBatch,
               "vllm.v1.worker.gpu_input_batch:CachedRequestState": State,
               "vllm.v1.core.sched.output:CachedRequestData": CachedRequestData}
    monkeypatch.setattr(m, "_try_import", lambda *names: next(
        (classes[n] for n in names if n in classes), None))
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(device=lambda name: name))
    spec = SimpleNamespace(block_size=16)
    sched = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(
            max_model_len=16, get_vocab_size=lambda: 100)),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4))
    notes = []
    wb = m.build(sched, num_spec_tokens=4, note=notes.append)
    assert notes == [] and wb is not None
    assert built["num_speculative_tokens"] == 4 and built["is_spec_decode"] is True
    assert built["block_sizes"] == [16] and built["max_model_len"] == 16
