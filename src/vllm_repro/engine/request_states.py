"""The release's own worker-side state on the V2 model runner: ``RequestState`` and ``BlockTables``.

From 0.34.0 the model runner is ``vllm/v1/worker/gpu/model_runner.py`` (the V2 runner): the V1
``InputBatch`` is gone, and the runner keeps its per-request state in
``vllm/v1/worker/gpu/states.py:RequestState`` (a free list of ``max_num_reqs`` slots, prompt /
prefill lengths, ``total_len``, ``num_computed_tokens`` and its CPU mirror, ``all_token_ids``)
and its block ids in ``vllm/v1/worker/gpu/block_table.py:BlockTables`` (one
``[max_num_reqs, max_num_blocks]`` table per KV cache group and each row's block count). Each
``execute_model`` drives them in this order (``model_runner.py``): ``finish_requests``
(finished and preempted requests' slots freed, sorted), ``free_states`` (the encoder cache
only), ``add_requests`` (``req_states.add_request``, ``block_tables.append_block_ids(...,
overwrite=True)``, ``req_states.apply_staged_writes()``), ``update_requests`` (the CPU mirror
``num_computed_tokens_np`` set from the scheduler, new block ids appended,
``num_computed_prefill_tokens`` recomputed), ``block_tables.apply_staged_writes()``, then
``gather_batch_req_state`` maps the scheduled requests to their slots; after sampling
``postprocess_sampled`` calls ``input_batch.py:post_update`` (``num_computed_tokens``,
``total_len``, ``all_token_ids``, ``last_sampled_tokens`` advanced on the device).

:class:`ReleaseRequestStates` makes those calls on the release's own classes, built on CPU, so a
disagreement between what the scheduler reports and what the V2 runner's state needs fails in
vLLM's own code: ``RequestState.add_request``'s ``assert len(self.free_indices) > 0, "No free
indices"`` (recorded as the audit's ``WORKER_BATCH_OVERFLOW``, as V1's slot assert; the request
stays without a slot), ``BlockTables.append_block_ids``'s ``RuntimeError`` for block ids past a
row's capacity, ``add_request``'s ``prefill_len >= prompt_len`` assert, the runner's
``req_id_to_index[req_id]`` lookups (``KeyError``) for a request it holds no state for.

What is faked, and only that (the project's rule: what a GPU computes):

- the device tensors live on CPU (``device="cpu"``); the UVA buffers
  (``buffer_utils.UvaBuffer``: pinned host memory viewed from the device) are the same
  host tensor viewed as itself (:class:`_HostUvaBuffer`; this torch has no pinned allocator and
  no device), with ``buffer_utils.is_uva_available`` answering True, as vLLM's own
  ``is_uva_available`` does on a CPU platform (``vllm/utils/platform_utils.py``);
- the Triton kernels these calls launch (``buffer_utils._apply_write_kernel``: the staged
  writes; ``input_batch._post_update_kernel``: the post-sample update) are
  :class:`_CpuApplyWrite` / :class:`_CpuPostUpdate`: objects whose ``[grid](...)`` makes the
  kernel's stores with numpy, on the flat memory of the output tensor as the kernel addresses
  it (a store past the tensor raises, where the GPU would fault). ``MULTI_GROUP`` writes name
  their output tensors by ``data_ptr``; those are mapped back to the block tables.

The forward-pass input kernels (``BlockTables.gather_block_tables``,
``compute_slot_mappings``, ``prepare_inputs``' kernels) are not driven: they compute the
forward pass's inputs on the device and check nothing on the CPU.

:func:`build` probes the release for the classes and module attributes (never its version) and
returns None, with a one-line note, where they are missing or do not build on CPU; the lab then
keeps :class:`~vllm_repro.engine.fake_runner.PersistentBatch` (``docs/levels.md``).

Runs inside the release environment (standard library + vLLM + torch + numpy).
"""

from __future__ import annotations

import sys
import weakref
from itertools import chain
from typing import Any

import numpy as np

from .adapter import _try_import
from .worker_marks import _params, marked, scheduler_configs

#: the modules of the V2 runner this state needs
MODULES = ("vllm.v1.worker.gpu.states", "vllm.v1.worker.gpu.block_table",
           "vllm.v1.worker.gpu.buffer_utils", "vllm.v1.worker.gpu.input_batch")


def _flat(t):
    """``t``'s memory as the kernels address it: a flat numpy view (a contiguous tensor)."""
    return t.numpy().reshape(-1)


def _store(flat, offset: int, values, what: str) -> None:
    """``flat[offset:offset + len(values)] = values``; a store outside the tensor raises (on
    the GPU an illegal memory access)."""
    end = offset + len(values)
    if offset < 0 or end > flat.shape[0]:
        raise RuntimeError(f"{what}: a store at elements {offset}..{end} falls outside the "
                           f"tensor ({flat.shape[0]} elements; on the GPU an illegal memory "
                           "access)")
    flat[offset:end] = values


def _store_at(flat, offsets, values, what: str) -> None:
    """``flat[offsets] = values`` (element-wise); an offset outside the tensor raises."""
    if offsets.size and (int(offsets.min()) < 0 or int(offsets.max()) >= flat.shape[0]):
        raise RuntimeError(f"{what}: a store at element {int(offsets.max())} falls outside "
                           f"the tensor ({flat.shape[0]} elements; on the GPU an illegal "
                           "memory access)")
    flat[offsets] = values


class _CpuApplyWrite:
    """``buffer_utils._apply_write_kernel[grid](...)`` on CPU: program ``pid`` copies
    ``contents[cu_lens[pid-1]:cu_lens[pid]]`` to row ``indices[pid]`` of its output from
    column ``starts[pid]``, through the row stride (so a write past a row's end lands in the
    next row, as the kernel's stores do). ``MULTI_GROUP``: the output is a tensor of
    ``data_ptr`` values and one of row strides, indexed by ``group_ids[pid]``; the pointers are
    mapped back to the tensors :meth:`register` was given."""

    def __init__(self):
        # weak: a finished run's block tables are not kept alive by the module's kernel
        self.tensors: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def register(self, tensor) -> None:
        self.tensors[int(tensor.data_ptr())] = tensor

    def __getitem__(self, grid):
        n = int(grid[0])

        def launch(output, output_stride, indices, starts, contents, cu_lens, group_ids,
                   BLOCK_SIZE=None, MULTI_GROUP=False, **_):  # noqa: N803 - the kernel's names
            rows = indices[:n].numpy()
            cols = starts[:n].numpy()
            cu = cu_lens[:n].numpy()
            values = contents.numpy()
            if MULTI_GROUP:
                ptrs = output.tolist()
                strides = output_stride.tolist()
                groups = group_ids[:n].numpy()
                flats = {}
                for g in set(groups.tolist()):
                    t = self.tensors.get(int(ptrs[g]))
                    if t is None:
                        raise RuntimeError(f"_apply_write_kernel: output pointer {ptrs[g]:#x} "
                                           "of no registered tensor")
                    flats[g] = _flat(t)
            else:
                flat = _flat(output)
                stride = int(output_stride)
                if n and int(cu[n - 1]) == n:
                    # one element per write (stage_write_elem; a decode step's one new block):
                    # every program's store at once
                    offsets = rows.astype(np.int64) * stride + cols
                    _store_at(flat, offsets, values[:n], "_apply_write_kernel")
                    return
            prev = 0
            for pid in range(n):
                end = int(cu[pid])
                if MULTI_GROUP:
                    g = int(groups[pid])
                    flat, stride = flats[g], int(strides[g])
                _store(flat, int(rows[pid]) * stride + int(cols[pid]), values[prev:end],
                       "_apply_write_kernel")
                prev = end

        return launch


class _CpuPostUpdate:
    """``input_batch._post_update_kernel[(num_reqs,)](...)`` on CPU, for each batch row whose
    slot (``idx_mapping``) is not negative: the row's drafts copied out (where given); where it
    sampled tokens, the last one into ``last_sampled_tokens``, ``total_len`` advanced by their
    count and the tokens stored at ``all_token_ids[slot, total_len:]`` (through the row stride,
    as the kernel); ``output_bin_counts`` counted; ``num_computed_tokens`` advanced by the
    row's query length less its rejected tokens."""

    def __getitem__(self, grid):
        def launch(idx_mapping, num_computed_tokens, last_sampled_tokens, output_bin_counts,
                   output_bin_counts_stride, sampled_tokens, sampled_tokens_stride,
                   num_sampled, num_rejected, query_start_loc, all_token_ids,
                   all_token_ids_stride, total_len, draft_tokens, draft_tokens_out,
                   num_draft_tokens, **_):
            slots = idx_mapping.numpy().astype(np.int64)
            n_sampled = num_sampled.numpy().astype(np.int64)
            rejected = num_rejected.numpy()
            live = slots >= 0
            if live.all():  # the usual batch: every row has a slot
                rows = np.arange(slots.shape[0])
            else:
                rows = np.flatnonzero(live)
                slots, n_sampled, rejected = slots[live], n_sampled[live], rejected[live]
            stride = int(sampled_tokens_stride)
            sampled = _flat(sampled_tokens)
            if draft_tokens is not None:
                k = int(num_draft_tokens)
                drafts_in, drafts_out = _flat(draft_tokens), _flat(draft_tokens_out)
                for i in range(k):
                    _store_at(drafts_out, slots * k + i, drafts_in[rows * k + i],
                              "_post_update_kernel")
            totals = total_len.numpy()
            total = totals[slots].astype(np.int64)
            tokens = _flat(all_token_ids)
            counts = _flat(output_bin_counts) if output_bin_counts is not None else None
            token_stride = int(all_token_ids_stride)
            for i in range(int(n_sampled.max()) if n_sampled.size else 0):
                has = n_sampled > i
                got = sampled[rows[has] * stride + i]
                _store_at(tokens, slots[has] * token_stride + total[has] + i, got,
                          "_post_update_kernel")
                if counts is not None:
                    np.add.at(counts, slots[has] * int(output_bin_counts_stride) + got, 1)
            some = n_sampled > 0
            _flat(last_sampled_tokens)[slots[some]] = \
                sampled[rows[some] * stride + n_sampled[some] - 1]
            totals[slots[some]] = total[some] + n_sampled[some]
            if query_start_loc is None:
                qlen = 0
            else:
                qsl = query_start_loc.numpy().astype(np.int64)
                qlen = qsl[rows + 1] - qsl[rows]
            delta = qlen - rejected
            computed = num_computed_tokens.numpy()
            computed[slots] += delta.astype(computed.dtype)

        return launch


def _host_uva_buffer(base):
    """A subclass of the release's ``UvaBuffer`` whose host tensor is unpinned and whose
    accelerator view is that tensor itself (a CPU is its own device); ``uva(n)`` stays
    vLLM's."""

    class _HostUvaBuffer(base):
        def __init__(self, size, dtype):
            torch = __import__("torch")
            self.cpu = torch.zeros(size, dtype=dtype, device="cpu")
            self.np = self.cpu.numpy()
            self._uva = self.cpu

    _HostUvaBuffer.__qualname__ = _HostUvaBuffer.__name__ = "UvaBuffer"
    return _HostUvaBuffer


def install_cpu_kernels(note) -> _CpuApplyWrite | None:
    """Set the V2 runner's buffer and kernel seams to their CPU stand-ins (module attributes,
    at runtime; idempotent). Returns the write kernel (for :meth:`_CpuApplyWrite.register`), or
    None with ``note(text)`` where a seam is missing (the release moved it)."""
    bu = sys.modules.get("vllm.v1.worker.gpu.buffer_utils")
    ib = sys.modules.get("vllm.v1.worker.gpu.input_batch")
    missing = [f"{mod.__name__ if mod else name}.{attr}" for mod, name, attr in (
        (bu, "buffer_utils", "_apply_write_kernel"), (bu, "buffer_utils", "UvaBuffer"),
        (bu, "buffer_utils", "is_uva_available"), (ib, "input_batch", "_post_update_kernel"),
        (ib, "input_batch", "post_update")) if mod is None or not hasattr(mod, attr)]
    if missing:
        note(f"the release's V2 model runner has no {', '.join(missing)} (the seams the lab "
             "runs its kernels on CPU through): the worker-side state is the lab's "
             "PersistentBatch")
        return None
    kernel = bu._apply_write_kernel
    if not isinstance(kernel, _CpuApplyWrite):
        kernel = _CpuApplyWrite()
        bu._apply_write_kernel = kernel
        bu.UvaBuffer = _host_uva_buffer(bu.UvaBuffer)
        bu.is_uva_available = lambda: True
    if not isinstance(ib._post_update_kernel, _CpuPostUpdate):
        ib._post_update_kernel = _CpuPostUpdate()
    return kernel


class ReleaseRequestStates:
    """The V2 runner's ``req_states`` (``RequestState``) and ``block_tables``
    (``BlockTables``), driven as ``GPUModelRunner.execute_model`` / ``postprocess_sampled``
    drive them (``vllm/v1/worker/gpu/model_runner.py``).

    ``overflow``: ``(step, request id, slots in use, max_num_reqs)`` for each request whose
    ``add_request`` found no free slot (read by the audit, ``WORKER_BATCH_OVERFLOW``); such a
    request stays out of the state (its later steps are skipped) until it finishes or is
    preempted. ``kind``: ``"vllm-v2"``.
    """

    kind = "vllm-v2"
    #: what ``RunResult.worker_state`` says of it
    describe = "RequestState + BlockTables (vllm/v1/worker/gpu/states.py, block_table.py)"

    def __init__(self, req_states, block_tables, post_update, torch):
        self.req_states = req_states
        self.block_tables = block_tables
        self.max_num_reqs = req_states.max_num_reqs
        self.overflow: list[tuple[int, str, int, int]] = []
        self._post_update = post_update
        self._torch = torch
        self._left_out: set[str] = set()
        self._so = None

    # ---- GPUModelRunner.execute_model's state updates -----------------------------------
    def update(self, step: int, scheduled_ids, finished_ids=(), scheduler_output=None) -> None:
        """``finish_requests``, ``free_states``, ``add_requests``, ``update_requests`` and
        ``block_tables.apply_staged_writes()`` for ``scheduler_output``. Raises what the
        release's classes raise, marked with
        :data:`~vllm_repro.engine.input_batch.WORKER_STATE_ATTR`."""
        self._so = scheduler_output
        if scheduler_output is None:
            return
        with marked():
            self._update(step, scheduler_output)

    def _update(self, step: int, so) -> None:
        rs, bt, left_out = self.req_states, self.block_tables, self._left_out
        # finish_requests: finished and preempted requests' slots, sorted
        gone = set(getattr(so, "finished_req_ids", ()) or ())
        preempted = getattr(so, "preempted_req_ids", None)
        if preempted:
            gone |= set(preempted)
        for rid in sorted(gone):
            rs.remove_request(rid)
            left_out.discard(rid)
        # free_states: the encoder cache only (no multimodal inputs here)
        # add_requests
        new_reqs = so.scheduled_new_reqs
        for new in new_reqs:
            rid = new.req_id
            rs.remove_request(rid)  # _remove_request: a streaming input's earlier chunk
            left_out.discard(rid)
            params = new.sampling_params
            try:
                rs.add_request(req_id=rid, prompt_len=new.prompt_len,
                               all_token_ids=new.prefill_token_ids,
                               num_computed_tokens=new.num_computed_tokens,
                               max_tokens=params.max_tokens if params else 1)
            except AssertionError:
                if rs.free_indices:
                    raise
                # no free slot: WORKER_BATCH_OVERFLOW, the request stays out of the state
                self.overflow.append((step, rid, rs.num_reqs, rs.max_num_reqs))
                left_out.add(rid)
                continue
            bt.append_block_ids(rs.req_id_to_index[rid], new.block_ids, overwrite=True)
        if new_reqs:
            rs.apply_staged_writes()
        # update_requests
        reqs = so.scheduled_cached_reqs
        index_of = rs.req_id_to_index
        computed_np = rs.num_computed_tokens_np
        for rid, num_computed, new_block_ids in zip(reqs.req_ids, reqs.num_computed_tokens,
                                                    reqs.new_block_ids):
            if rid in left_out:
                continue
            index = index_of[rid]  # KeyError as in the runner: a request it holds no state for
            computed_np[index] = num_computed
            if new_block_ids is not None:
                bt.append_block_ids(index, new_block_ids, overwrite=False)
        np.minimum(computed_np, rs.prefill_len.np, out=rs.num_computed_prefill_tokens)
        bt.apply_staged_writes()
        # gather_batch_req_state's slot lookup of every scheduled request is after_sample's
        # (the same req_id_to_index[req_id], in the same lab step: phase execute_model)

    # ---- GPUModelRunner.postprocess_sampled ---------------------------------------------
    def after_sample(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """``gather_batch_req_state``'s slot lookup (``req_id_to_index[req_id]`` for every
        scheduled request: ``KeyError`` for one the runner holds no state for), then
        ``post_update`` (the release's function; its kernel :class:`_CpuPostUpdate`) for
        the batch: a row with no tokens (``[]``) is a partial prefill (nothing sampled,
        nothing rejected); else ``num_rejected`` is its logits (its scheduled drafts + 1) less
        its sampled tokens, and its query length is its scheduled count."""
        so = self._so
        if so is None or not req_ids:
            return
        with marked():
            self._after_sample(so, req_ids, sampled)

    def _after_sample(self, so, req_ids, sampled) -> None:
        torch, rs, left_out = self._torch, self.req_states, self._left_out
        index_of = rs.req_id_to_index
        n = len(req_ids)
        if left_out:
            slots = np.fromiter((-1 if rid in left_out else index_of[rid] for rid in req_ids),
                                dtype=np.int64, count=n)
        else:  # KeyError as in the runner's req_id_to_index lookups
            slots = np.fromiter(map(index_of.__getitem__, req_ids), dtype=np.int64, count=n)
        counts = np.fromiter(map(len, sampled), dtype=np.int32, count=n)
        width = max(1, int(counts.max()) if n else 1)
        if width == 1:
            rows = np.zeros(n, dtype=np.int64)
            some = counts > 0
            rows[some] = np.fromiter(chain.from_iterable(sampled), dtype=np.int64,
                                     count=int(some.sum()))
        else:
            rows = np.zeros((n, width), dtype=np.int64)
            for i, toks in enumerate(sampled):
                rows[i, :len(toks)] = toks
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        if spec:
            # the row's logits (its drafts + 1) less what it sampled; a partial prefill
            # (nothing sampled) rejects nothing
            drafts = np.fromiter((len(spec.get(rid, ())) for rid in req_ids), dtype=np.int32,
                                 count=n)
            rejected = np.where(counts > 0, drafts + 1 - counts, 0).astype(np.int32)
        else:
            rejected = np.zeros(n, dtype=np.int32)
        scheduled = so.num_scheduled_tokens
        starts = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.fromiter(map(scheduled.__getitem__, req_ids), dtype=np.int32, count=n),
                  out=starts[1:])
        self._post_update(torch.from_numpy(slots),
                          rs.num_computed_tokens.gpu, rs.last_sampled_tokens, None,
                          torch.from_numpy(rows.reshape(n, width)), torch.from_numpy(counts),
                          torch.from_numpy(rejected), torch.from_numpy(starts),
                          rs.all_token_ids.gpu, rs.total_len.gpu)

    def retract(self, req_id: str, n: int) -> None:
        """``n`` of ``req_id``'s last tokens taken back: the lab's grammar step rejected them
        after :meth:`after_sample` counted them (the GPU sampler applies the bitmask before
        ``post_update``): ``total_len`` and ``num_computed_tokens`` on the device go back by
        ``n`` (``n`` more rejected, ``n`` fewer sampled)."""
        slot = self.req_states.req_id_to_index.get(req_id)
        if slot is None or n <= 0 or req_id in self._left_out:
            return
        self.req_states.total_len.gpu[slot] -= n
        self.req_states.num_computed_tokens.gpu[slot] -= n


def build(scheduler, num_spec_tokens: int = 0, note=None) -> ReleaseRequestStates | None:
    """The V2 runner's ``RequestState`` and ``BlockTables`` for ``scheduler``'s config and KV
    cache groups, as ``GPUModelRunner.__init__`` / ``initialize_kv_cache`` size them
    (``max_num_seqs`` slots, ``max_model_len``, ``max_num_batched_tokens``, each group's block
    size and ``max_num_blocks_per_req``), on CPU; None (and ``note(text)``) where the release
    has no such classes, a seam is missing, or they do not build here."""
    note = note or (lambda text: None)
    runtime = sys.modules.get("_vllm_slice")
    absent = set(getattr(runtime, "ABSENT", ()) or ())
    if absent & set(MODULES):
        note(f"the slice of vLLM {getattr(runtime, 'VERSION', '?')} leaves out "
             "vllm/v1/worker/gpu/: the worker-side state is the lab's PersistentBatch (slice "
             "the release again, or --tree full, for the release's own)")
        return None
    state_cls = _try_import("vllm.v1.worker.gpu.states:RequestState")
    tables_cls = _try_import("vllm.v1.worker.gpu.block_table:BlockTables")
    post_update = _try_import("vllm.v1.worker.gpu.input_batch:post_update")
    if state_cls is None or tables_cls is None or post_update is None:
        note("the release has neither V1's InputBatch (vllm/v1/worker/gpu_input_batch.py) nor "
             "the V2 runner's RequestState / BlockTables / post_update (vllm/v1/worker/gpu/): "
             "the worker-side state is the lab's PersistentBatch")
        return None
    kernel = install_cpu_kernels(note)
    if kernel is None:
        return None
    configs = scheduler_configs(scheduler, note)
    if configs is None:
        return None
    vcfg, kvc, sched_cfg, model_cfg = configs
    try:
        torch = __import__("torch")
        cpu = torch.device("cpu")
        max_model_len = int(model_cfg.max_model_len)
        max_reqs = int(sched_cfg.max_num_seqs)
        max_tokens = int(sched_cfg.max_num_batched_tokens)
        # GPUModelRunner.initialize_kv_cache's sizing (model_runner.py), where the release's
        # spec classes have the attributes it reads
        uniform = _try_import("vllm.v1.kv_cache_interface:UniformTypeKVCacheSpecs")
        sliding = _try_import("vllm.v1.kv_cache_interface:SlidingWindowSpec")
        width = _try_import("vllm.v1.kv_cache_interface:get_block_table_width")
        block_sizes, max_blocks, enabled, sharded, reach = [], [], [], [], []
        for group in kvc.kv_cache_groups:
            spec = group.kv_cache_spec
            layer = spec.first_spec if uniform is not None and isinstance(spec, uniform) \
                else spec
            block_sizes.append(spec.block_size)
            enabled.append(bool(getattr(layer, "uses_slot_mapping", True)))
            sharded.append(bool(getattr(spec, "dcp_sharded", True)))
            reach.append(int(getattr(layer, "num_retained_tokens", 0) or 0)
                         if sliding is not None and isinstance(layer, sliding) else 0)
            n = spec.max_num_blocks_per_req(vcfg, max_model_len)
            if width is not None:
                n = width(n, spec.block_size,
                          token_alignment=getattr(spec, "block_table_token_alignment", None))
            max_blocks.append(n)
        given = {"max_num_reqs": max_reqs, "max_model_len": max_model_len,
                 "max_num_batched_tokens": max_tokens, "num_speculative_steps": num_spec_tokens,
                 "vocab_size": model_cfg.get_vocab_size(), "device": cpu}
        params = _params(state_cls.__init__)
        req_states = state_cls(**{k: v for k, v in given.items() if k in params})
        tgiven = {"block_sizes": block_sizes, "max_num_reqs": max_reqs,
                  "max_num_batched_tokens": max_tokens, "max_num_blocks_per_group": max_blocks,
                  "device": cpu, "slot_mapping_enabled": enabled, "dcp_sharded": sharded,
                  "sliding_window_reach": reach}
        tparams = _params(tables_cls.__init__)
        tables = tables_cls(**{k: v for k, v in tgiven.items() if k in tparams})
        for t in tables.block_tables:
            kernel.register(t.gpu)
    except Exception as exc:  # noqa: BLE001 - classes that do not build on CPU: the fallback
        note(f"the release's V2 RequestState / BlockTables do not build on CPU "
             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): the "
             "worker-side state is the lab's PersistentBatch")
        return None
    return ReleaseRequestStates(req_states, tables, post_update, torch)


__all__ = ["ReleaseRequestStates", "build", "install_cpu_kernels", "MODULES"]
