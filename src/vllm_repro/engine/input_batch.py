"""The release's own worker-side request state: V1 ``InputBatch`` and its ``MultiGroupBlockTable``.

``GPUModelRunner`` keeps, besides the scheduler's books, its own per-request state
(``requests: dict[str, CachedRequestState]``) and a persistent batch
(``vllm/v1/worker/gpu_input_batch.py:InputBatch``, slots of token ids, computed-token counts,
sampling parameters and a ``MultiGroupBlockTable`` of block ids per KV cache group). Each step
``GPUModelRunner._update_states(scheduler_output)`` brings them in line with the
``SchedulerOutput`` (finished requests removed, unscheduled ones taken out of the batch, new and
resumed ones added, cached ones' computed counts and new block ids appended, the batch
condensed), and after sampling ``_bookkeeping_sync`` appends the sampled tokens to the batch.

:class:`ReleaseInputBatch` makes those same calls on the release's own classes (built on CPU:
``device="cpu"``, ``pin_memory=False``), in ``_update_states``' order, so a disagreement between
what the scheduler reports and what the worker-side state needs fails with vLLM's own assertion
or error (``InputBatch.add_request``'s ``assert new_req_index < self.max_num_reqs``,
``MultiGroupBlockTable.append_row`` past ``max_num_blocks_per_req``, a cached request the
runner never saw, a resumed request still in the batch, tokens past ``max_model_len``). Only the
forward pass and sampling are the lab's (:class:`~vllm_repro.engine.fake_runner.FakeModelRunner`).

It answers the interface of :class:`~vllm_repro.engine.fake_runner.PersistentBatch`
(``update``, ``overflow``, ``max_num_reqs``), so the audit's ``WORKER_BATCH_OVERFLOW`` reads it
the same way: ``add_request``'s slot assertion is recorded as an overflow and the request is left
out of the batch (the step goes on). Any other error raised inside the release's classes, or by
the mirrored ``_update_states`` lines, is marked (:data:`WORKER_STATE_ATTR`) so that the loops
report it as vLLM's crash, not as a lab error.

:func:`build` probes the release for the classes and their signatures (never its version) and
returns None, with a one-line note, where they are missing or do not build on CPU; the lab then
keeps :class:`~vllm_repro.engine.fake_runner.PersistentBatch` (see ``docs/levels.md``).

Runs inside the release environment (standard library + vLLM + torch).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from typing import Any

from .adapter import _try_import
from .worker_marks import WORKER_STATE_ATTR, _params, marked, scheduler_configs

#: ``worker.input_batch`` values a scenario may give: the release's classes, or the lab's
#: slot model (:class:`~vllm_repro.engine.fake_runner.PersistentBatch`)
MODES = ("vllm", "lab")

#: the environment variable that picks the worker-side state (one of :data:`MODES`; default
#: ``vllm``)
ENV = "VLLM_REPRO_WORKER_STATE"


class ReleaseInputBatch:
    """The release's ``InputBatch`` and the runner's ``requests`` dict, driven as
    ``GPUModelRunner._update_states`` / ``_bookkeeping_sync`` drive them.

    ``batch``: the release's ``InputBatch``; ``state_cls``: its ``CachedRequestState``;
    ``max_model_len``: the runner's (``model_config.max_model_len``);
    ``async_scheduling``: the runner caches ``-1`` placeholders for sampled tokens, as there.
    ``overflow``: ``(step, request id, slots in use, max_num_reqs)`` for each request whose
    ``add_request`` failed the slot assertion (read by the audit, ``WORKER_BATCH_OVERFLOW``).
    """

    kind = "vllm"
    #: what ``RunResult.worker_state`` says of it
    describe = "InputBatch (vllm/v1/worker/gpu_input_batch.py)"

    def __init__(self, batch, state_cls, max_model_len: int, async_scheduling: bool,
                 num_spec_tokens: int = 0):
        self.batch = batch
        self.state_cls = state_cls
        self.max_num_reqs = batch.max_num_reqs
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.requests: dict[str, Any] = {}
        self.overflow: list[tuple[int, str, int, int]] = []
        self._state_fields = set(getattr(state_cls, "__dataclass_fields__", {}) or
                                 _params(state_cls))
        # update_req_spec_token_ids with spec decode off only clears an empty draft list and
        # sets prev_num_draft_len to 0 (its default): skipped then, the state is the same
        self._spec = hasattr(batch, "update_req_spec_token_ids") and num_spec_tokens > 0
        self._refresh = getattr(batch, "refresh_metadata", None)

    # ---- GPUModelRunner._update_states -----------------------------------------------------
    def update(self, step: int, scheduled_ids, finished_ids=(), scheduler_output=None) -> None:
        """``_update_states(scheduler_output)`` on the release's classes (the lab's
        ``scheduled_ids`` / ``finished_ids`` are read from ``scheduler_output`` itself). Raises
        what the release's classes raise, marked with :data:`WORKER_STATE_ATTR`."""
        if scheduler_output is None:
            return
        with marked():
            self._update(step, scheduler_output)

    def _update(self, step: int, so) -> None:
        ib = self.batch
        finished = getattr(so, "finished_req_ids", ()) or ()
        for rid in finished:
            self.requests.pop(rid, None)
        for rid in finished:
            ib.remove_request(rid)
        scheduled = so.num_scheduled_tokens.keys()
        cached_data = so.scheduled_cached_reqs
        resumed = set(getattr(cached_data, "resumed_req_ids", ()) or ())
        if not resumed and hasattr(cached_data, "resumed_from_preemption"):
            resumed = {rid for rid, r in zip(cached_data.req_ids,
                                             cached_data.resumed_from_preemption) if r}
        for rid in list(ib.req_id_to_index.keys() - (scheduled - resumed)):
            ib.remove_request(rid)
        spec_tokens = getattr(so, "scheduled_spec_decode_tokens", {}) or {}
        to_add = []
        for new in so.scheduled_new_reqs:
            state = self._new_state(new)
            self.requests[new.req_id] = state
            to_add.append(state)
        nums_out = getattr(cached_data, "num_output_tokens", None)
        all_tokens = getattr(cached_data, "all_token_ids", None) or {}
        requests, index_of = self.requests, ib.req_id_to_index
        # num_computed_tokens_cpu[index] = n for each cached request in the batch, written in
        # one numpy assignment after the loop (the same cells; nothing in between reads them)
        rows: list[int] = []
        computed: list[int] = []
        for i, rid in enumerate(cached_data.req_ids):
            state = requests[rid]  # KeyError as in the runner: a request it never saw
            num_computed = cached_data.num_computed_tokens[i]
            new_block_ids = cached_data.new_block_ids[i]
            index = index_of.get(rid)
            state.num_computed_tokens = num_computed
            if nums_out is not None and nums_out[i] < len(state.output_token_ids):
                # output tokens discarded (a sync KV load failure): the runner aligns its state
                del state.output_token_ids[nums_out[i]:]
                if index is not None:
                    ib.num_tokens_no_spec[index] = ib.num_prompt_tokens[index] + nums_out[i]
            if rid not in resumed:
                if new_block_ids is not None:
                    for ids, more in zip(state.block_ids, new_block_ids):
                        ids.extend(more)
            else:
                assert index is None
                assert new_block_ids is not None
                state.block_ids = new_block_ids
            if index is None:
                if self.async_scheduling and nums_out is not None and nums_out[i] > 0 \
                        and rid in all_tokens:
                    state.output_token_ids = all_tokens[rid][-nums_out[i]:]
                to_add.append(state)
                continue
            rows.append(index)
            computed.append(num_computed)
            if new_block_ids is not None:
                ib.block_table.append_row(new_block_ids, index)
            if self._spec:
                ib.update_req_spec_token_ids(state, spec_tokens)
        if rows:
            ib.num_computed_tokens_cpu[rows] = computed
        for state in to_add:
            try:
                ib.add_request(state)
            except AssertionError:
                if ib.num_reqs < ib.max_num_reqs:
                    raise
                # no free slot: WORKER_BATCH_OVERFLOW, the request stays out of the batch
                self.overflow.append((step, state.req_id, ib.num_reqs, ib.max_num_reqs))
                continue
            if self._spec:
                ib.update_req_spec_token_ids(state, spec_tokens)
        ib.condense()
        if self._refresh is not None:
            self._refresh()

    def _new_state(self, new):
        """The runner's ``CachedRequestState`` for a ``NewRequestData`` (the fields the
        release's dataclass has; no generator, no multimodal features, no LoRA)."""
        f = self._state_fields
        kw: dict[str, Any] = {"req_id": new.req_id,
                              "prompt_token_ids": new.prompt_token_ids,
                              "sampling_params": getattr(new, "sampling_params", None),
                              "generator": None,
                              "block_ids": tuple(list(ids) for ids in new.block_ids),
                              "num_computed_tokens": new.num_computed_tokens,
                              "output_token_ids": []}
        for name in ("mm_features", "mm_kwargs", "mm_positions", "mm_hashes", "mm_inputs"):
            if name in f:
                kw[name] = []
        for name in ("pooling_params", "lora_request", "prompt_embeds", "prompt_is_token_ids"):
            if name in f:
                kw[name] = getattr(new, name, None)
        return self.state_cls(**{k: v for k, v in kw.items() if k in f})

    # ---- GPUModelRunner._bookkeeping_sync ---------------------------------------------------
    def after_sample(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """The sampled tokens cached in the batch and the runner's request states, as
        ``_bookkeeping_sync`` does (``-1`` placeholders under async scheduling); a request whose
        tokens are discarded (``[]``: a partial prefill) gets none. Raises the runner's
        ``assert end_idx <= self.max_model_len`` (marked) where a request's tokens pass it."""
        ib = self.batch
        index_of = ib.req_id_to_index
        requests, max_len, placeholder = self.requests, self.max_model_len, self.async_scheduling
        # the usual case, one token per request, is written in one numpy assignment per array
        # (the runner's per-row slice writes, batched: same cells, same values); requests with
        # several tokens (accepted drafts) are written row by row, as there
        rows: list[int] = []
        firsts: list[int] = []
        states: list = []
        several: list[tuple[int, Any, list[int]]] = []
        with marked():
            for rid, toks in zip(req_ids, sampled):
                if not toks:
                    continue
                idx = index_of.get(rid)
                if idx is None:
                    continue  # not in the batch (an overflow): nothing was computed for it
                if placeholder:
                    toks = [-1]
                if len(toks) == 1:
                    rows.append(idx)
                    firsts.append(toks[0])
                    states.append(requests[rid])
                else:
                    several.append((idx, requests[rid], toks))
            if rows:
                self._write_one_each(rows, firsts, states, max_len)
            for idx, state, ids in several:
                self._write_row(idx, state, ids, max_len)

    def _write_one_each(self, rows: list[int], tokens: list[int], states: list,
                        max_len: int) -> None:
        """One sampled token per row: ``token_ids_cpu[row, start] = token``,
        ``is_token_ids[row, start] = True``, ``num_tokens_no_spec[row] += 1`` for every row at
        once; raises the runner's ``end_idx <= max_model_len`` assertion for the first row that
        passes it (nothing written then, as the runner dies at that row)."""
        ib = self.batch
        num_tokens = ib.num_tokens_no_spec
        starts = num_tokens[rows]
        ends = starts + 1
        over = ends > max_len
        if over.any():
            end = int(ends[int(over.argmax())])
            assert end <= max_len, (
                "Sampled token IDs exceed the max model length. "
                f"Total number of tokens: {end} > max_model_len: {max_len}")
        ib.token_ids_cpu[rows, starts] = tokens
        is_token = getattr(ib, "is_token_ids", None)
        if is_token is not None:
            is_token[rows, starts] = True
        num_tokens[rows] = ends
        for state, token in zip(states, tokens):
            state.output_token_ids.append(token)

    def _write_row(self, idx: int, state, ids: list[int], max_len: int) -> None:
        """Several sampled tokens for one row, as ``_bookkeeping_sync`` writes them."""
        ib = self.batch
        start = int(ib.num_tokens_no_spec[idx])
        end = start + len(ids)
        assert end <= max_len, (
            "Sampled token IDs exceed the max model length. "
            f"Total number of tokens: {end} > max_model_len: {max_len}")
        ib.token_ids_cpu[idx, start:end] = ids
        is_token = getattr(ib, "is_token_ids", None)
        if is_token is not None:
            is_token[idx, start:end] = True
        ib.num_tokens_no_spec[idx] = end
        state.output_token_ids.extend(ids)

    def retract(self, req_id: str, n: int) -> None:
        """``n`` of ``req_id``'s last cached tokens taken back: the lab's grammar step
        (:meth:`~vllm_repro.engine.fake_runner.FakeModelRunner.apply_grammar`) rejected them
        after :meth:`after_sample` cached them (the GPU runner samples through the bitmask
        before its bookkeeping). Under async scheduling the one placeholder stays."""
        idx = self.batch.req_id_to_index.get(req_id)
        state = self.requests.get(req_id)
        if self.async_scheduling or idx is None or state is None or n <= 0:
            return
        self.batch.num_tokens_no_spec[idx] -= n
        del state.output_token_ids[-n:]


def build(scheduler, num_spec_tokens: int = 0, async_scheduling: bool = False,
          note=None):
    """The release's ``InputBatch`` for ``scheduler``'s config and KV cache groups, as
    ``GPUModelRunner.may_reinitialize_input_batch`` builds it (one block size and
    ``max_num_blocks_per_req`` per group), on CPU; where the release has no V1 ``InputBatch``
    / ``CachedRequestState``, the V2 runner's ``RequestState`` / ``BlockTables``
    (:func:`vllm_repro.engine.request_states.build`); None (and ``note(text)``) where neither
    is there or builds here."""
    note = note or (lambda text: None)
    # a slice tree (slicing/slice_runtime.py, imported as _vllm_slice) cut before the worker
    # drove the release's InputBatch leaves that module out: importing it there would be a run
    # that left the slice (exit 3), so the slice's runs keep the lab's PersistentBatch, as the
    # slice was proven with
    runtime = sys.modules.get("_vllm_slice")
    absent = getattr(runtime, "ABSENT", ()) or ()
    if "vllm.v1.worker.gpu_input_batch" in absent or "vllm.v1.worker.block_table" in absent:
        note(f"the slice of vLLM {getattr(runtime, 'VERSION', '?')} leaves out "
             "vllm/v1/worker/gpu_input_batch.py: the worker-side state is the lab's "
             "PersistentBatch (slice the release again, or --tree full, for the release's own)")
        return None
    ib_cls = _try_import("vllm.v1.worker.gpu_input_batch:InputBatch")
    state_cls = _try_import("vllm.v1.worker.gpu_input_batch:CachedRequestState")
    if ib_cls is None or state_cls is None:
        # no V1 InputBatch (0.34 on): the V2 runner's RequestState / BlockTables, where they
        # import and build on CPU (request_states.build notes why not)
        from . import request_states

        return request_states.build(scheduler, num_spec_tokens, note=note)
    cached_cls = _try_import("vllm.v1.core.sched.output:CachedRequestData")
    if "req_ids" not in (getattr(cached_cls, "__dataclass_fields__", None) or {}):
        note("the release's SchedulerOutput lists one CachedRequestData per request (no "
             "batched req_ids), which the lab's _update_states mirror does not read: the "
             "worker-side state is the lab's PersistentBatch")
        return None
    configs = scheduler_configs(scheduler, note)
    if configs is None:
        return None
    vcfg, kvc, sched_cfg, model_cfg = configs
    # the fake platform reports a GPU, so vLLM's module-level PIN_MEMORY (from
    # is_pin_memory_available()) is True; on this host torch has no pinned allocator: the
    # batch's CPU tensors are built unpinned, as on the CPU platform
    for name in ("vllm.v1.worker.gpu_input_batch", "vllm.v1.worker.block_table"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "PIN_MEMORY", False):
            mod.PIN_MEMORY = False
    try:
        torch = __import__("torch")
        max_model_len = int(model_cfg.max_model_len)
        mamba = _try_import("vllm.v1.kv_cache_interface:MambaSpec")
        encoder_only = _try_import("vllm.v1.kv_cache_interface:EncoderOnlyAttentionSpec")
        modes_enum = _try_import("vllm.v1.worker.block_table:SlotMappingMode",
                                 "vllm.v1.worker.utils:SlotMappingMode")
        block_sizes, max_blocks, modes = [], [], []
        for group in kvc.kv_cache_groups:
            spec = group.kv_cache_spec
            if encoder_only is not None and isinstance(spec, encoder_only):
                continue
            block_sizes.append(spec.block_size)
            is_mamba = mamba is not None and isinstance(spec, mamba)
            if modes_enum is not None:
                modes.append(modes_enum.NONE if is_mamba else modes_enum.TOKEN_TO_KV_SLOT)
            fn = getattr(spec, "max_num_blocks_per_req", None)
            if is_mamba and not callable(fn):
                # up to 0.25 GPUModelRunner.may_reinitialize_input_batch sizes a Mamba group's
                # row itself (1 or the full length, plus MambaSpec.num_speculative_blocks with
                # spec decode); the lab does not guess that size
                note("the release's MambaSpec has no max_num_blocks_per_req (the model runner "
                     "sizes a Mamba group's block table itself): the worker-side state is the "
                     "lab's PersistentBatch")
                return None
            max_blocks.append(fn(vcfg, max_model_len) if callable(fn)
                              else math.ceil(max_model_len / spec.block_size))
        vocab = model_cfg.get_vocab_size()
        max_tokens = int(sched_cfg.max_num_batched_tokens)
        max_reqs = int(sched_cfg.max_num_seqs)
        given = {"max_num_reqs": max_reqs, "max_model_len": max_model_len,
                 "max_num_batched_tokens": max_tokens, "device": torch.device("cpu"),
                 "pin_memory": False, "vocab_size": vocab, "block_sizes": block_sizes,
                 "kernel_block_sizes": list(block_sizes),
                 "max_num_blocks_per_req": max_blocks, "num_spec_tokens": num_spec_tokens,
                 # 0.10.2 to 0.12's name: their MultiGroupBlockTable sizes each row
                 # max(cdiv(max_model_len, block_size), 1 + num_speculative_tokens), as
                 # GPUModelRunner.may_reinitialize_input_batch passes it there
                 "num_speculative_tokens": num_spec_tokens,
                 "is_spec_decode": num_spec_tokens > 0,
                 "is_pooling_model": False, "slot_mapping_modes": modes or None}
        params = _params(ib_cls.__init__)
        missing = [n for n, p in params.items() if n != "self" and n not in given
                   and p.default is inspect.Parameter.empty
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if missing:
            note(f"the release's InputBatch wants {', '.join(missing)}, which the lab does not "
                 "know: the worker-side state is the lab's PersistentBatch")
            return None
        if "slot_mapping_modes" in params and not modes:
            given.pop("slot_mapping_modes")
        batch = ib_cls(**{k: v for k, v in given.items() if k in params})
    except Exception as exc:  # noqa: BLE001 - a class that does not build on CPU: the fallback
        note(f"the release's InputBatch does not build on CPU ({type(exc).__name__}: "
             f"{str(exc).splitlines()[0] if str(exc) else ''}): the worker-side state is the "
             "lab's PersistentBatch")
        return None
    return ReleaseInputBatch(batch, state_cls, max_model_len, async_scheduling, num_spec_tokens)


def worker_state(scheduler, cfg: dict):
    """The worker-side state a run drives: the release's ``InputBatch``, or on the V2 model
    runner its ``RequestState`` / ``BlockTables`` (:func:`build`), unless
    the environment variable :data:`ENV` says ``lab`` (the lab's
    :class:`~vllm_repro.engine.fake_runner.PersistentBatch`, e.g. for ``bench/engine_core.py``'s
    comparison) or the release's classes are missing / do not build (None; the note goes to
    stderr, one line)."""
    mode = os.environ.get(ENV, "vllm").strip() or "vllm"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "lab":
        return None
    sched_cfg = getattr(scheduler, "scheduler_config", None)
    async_sched = bool(getattr(sched_cfg, "async_scheduling", False)) or \
        type(scheduler).__name__ == "AsyncScheduler"
    return build(scheduler, int(cfg.get("num_speculative_tokens") or 0), async_sched,
                 note=lambda text: print(f"vllm-repro: note: {text}", file=sys.stderr))


__all__ = ["ReleaseInputBatch", "build", "worker_state", "WORKER_STATE_ATTR", "MODES", "ENV"]
