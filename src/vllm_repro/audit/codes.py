"""The invariant codes (docs/audit.md) and the violation record.

Runs inside release environments: standard library only.
"""

from __future__ import annotations

from ..records import Violation

KV_DOUBLE_FREE = "KV_DOUBLE_FREE"
KV_REFCOUNT = "KV_REFCOUNT"
KV_FREE_QUEUE = "KV_FREE_QUEUE"
KV_LEAK = "KV_LEAK"
KV_PREFIX_MAP = "KV_PREFIX_MAP"
REQ_STATE = "REQ_STATE"
BATCH_LIMIT = "BATCH_LIMIT"
NO_PROGRESS = "NO_PROGRESS"
REQ_RESIDUE = "REQ_RESIDUE"
REQ_STARVED = "REQ_STARVED"
PREEMPT_UNREPORTED = "PREEMPT_UNREPORTED"
WORKER_BATCH_OVERFLOW = "WORKER_BATCH_OVERFLOW"
REQ_OVER_MAX_LEN = "REQ_OVER_MAX_LEN"
KV_TRANSFER_FREED = "KV_TRANSFER_FREED"
DRAFT_OVER_LIMIT = "DRAFT_OVER_LIMIT"

#: code -> the invariant that broke (docs/audit.md's table of codes is generated from it:
#: ``python -m vllm_repro.audit``; markdown).
CODES: dict[str, str] = {
    KV_DOUBLE_FREE: 'a block freed while no one holds the reference given back: ref_cnt already 0, or the free would'
                    ' leave fewer references than block tables still holding it. Caught **inside** '
                    "`BlockPool.free_blocks`, before it decrements anything, with the caller's stack and the request"
                    ' it was freed for',
    KV_REFCOUNT: 'a ref_cnt below 0, or not equal to the number of block-table references to the block (all '
                 'requests, all KV cache groups, deferred frees)',
    KV_FREE_QUEUE: 'the free queue and the ref counts disagree: a held block in the queue (also caught when '
                   '`get_new_blocks` is about to hand it out), a ref-0 block outside it, a broken link, or free + '
                   'used != `num_gpu_blocks`',
    KV_LEAK: 'blocks still in the table of a finished, aborted or preempted request; at the end of a run, a block '
             'not back in the free queue',
    KV_PREFIX_MAP: "the prefix-cache hash map and the blocks' hashes disagree (a mapped block without that hash, a "
                   "hashed block not mapped, a request's cached block with another content hash, a prefix hit on a "
                   'block without a hash). At `level: v0-engine`: the worker is told to skip a block as a cached '
                   "prefix (`computed_block_nums`) that holds no KV of the sequence's tokens (the catalog's #18957)",
    REQ_STATE: 'a request in two queues; status and queue disagree; a scheduled request that is not running or is '
               'listed twice; `num_computed_tokens` out of bounds, moving backwards without a preemption or moving '
               'in a step that did not schedule it',
    BATCH_LIMIT: 'scheduled tokens over `max_num_batched_tokens`, running over `max_num_seqs`, a scheduled count <= '
                 '0, draft tokens (`scheduled_spec_decode_tokens`) for a request with no scheduled count or more of '
                 'them than its count, a total that is not the sum of its parts',
    NO_PROGRESS: 'a stall: nothing scheduled or finished for `stall_steps` steps; the record names the first step '
                 'without progress',
    REQ_RESIDUE: 'at the end of a clean run, a request that left the scheduler is still a key of a per-request dict '
                 'or set of the `Scheduler`, the KV cache manager, its coordinator and single-type managers, the '
                 'structured-output manager or the KV connector (and the objects those two hold directly). The '
                 "containers are found by walking the objects' attributes (any dict or set with a request id, or a "
                 "`Request`, among its keys), not from a list of names per release. Requests that left in the run's "
                 'last scheduled step are not judged (their ids wait for the next `schedule()`, as '
                 "`finished_req_ids` does). The record's step is the step the request left. At `level: v0-engine`: a"
                 ' child group of an `n > 1` request still a key of `LLMEngine.seq_id_to_seq_group` once it left '
                 "every queue and the engine collected its finish (the catalog's #14353)",
    REQ_STARVED: 'a running request with tokens pending gets nothing in a step that left room for it: token budget '
                 "under `max_num_batched_tokens` after the output's total (and every request's draft and lookahead "
                 'slots), and free blocks enough for all it could have asked for',
    PREEMPT_UNREPORTED: "a request preempted inside this step's `schedule()`, or between steps by an engine-core "
                        'event (`reset_prefix_cache(reset_running_requests=True)`, `pause`), is not in this (the '
                        "next) step's `SchedulerOutput.preempted_req_ids`, where the release's output has that field"
                        ' (0.12+; probed, absent before)',
    WORKER_BATCH_OVERFLOW: "the worker's persistent batch (`max_num_seqs` slots: the release's own `InputBatch` "
                           "where it runs on CPU, else the fake runner's model of it, see "
                           '[levels](levels.md#the-worker-side-the-releases-own-inputbatch)) has no free slot for a '
                           "scheduled request: the worker's `InputBatch.add_request` fails its assert",
    REQ_OVER_MAX_LEN: "a request's `num_computed_tokens` is over `max_model_len`",
    KV_TRANSFER_FREED: "with a KV connector: a block a transfer in flight uses is no longer in its request's block "
                       'table (freed, or handed to another request): an asynchronous load still writing it (not yet '
                       'reported in `finished_recving`; vLLM #32255: an abort freed it at once) or the send of a '
                       'delayed free still reading it (not yet reported in `finished_sending`; vLLM #25067: an abort'
                       " of the finished request freed it). The transfers are the scripted connector's worker half's",
    DRAFT_OVER_LIMIT: "a request scheduled with more draft tokens (`scheduled_spec_decode_tokens`) "
                      "than the scheduler's `num_spec_tokens` (`num_speculative_tokens`): the "
                      "drafter proposed more than the GPU model runner's verification slots hold",
}

#: codes about the KV cache's own books (checked again after a crash)
KV_CODES = (KV_DOUBLE_FREE, KV_REFCOUNT, KV_FREE_QUEUE, KV_LEAK, KV_PREFIX_MAP)


def make_violation(code: str, message: str, *, requests=(), blocks=(), step: int | None = None,
                   phase: str = "", stack: list[str] | None = None,
                   mechanism: str | None = None) -> Violation:
    """A :class:`~vllm_repro.records.Violation` (``result.json``'s ``violations[i]``).

    ``message`` says what was expected and what was found, e.g. ``block 7 ref_cnt 0 but held by
    A and B (expected 2)``; ``requests`` are request ids, ``blocks`` block ids (ints);
    ``phase`` the vLLM call it was found in or after (``schedule``, ``after schedule``...);
    ``stack`` the Python stack of the caller for violations caught inside a call (hooks);
    ``mechanism`` a short tag telling apart two ways to the same code (see the record).
    """
    if code not in CODES:
        raise ValueError(f"unknown violation code {code!r}")
    return Violation(code, message, step, phase, sorted(set(map(str, requests))),
                     sorted(set(int(b) for b in blocks)), stack, mechanism=mechanism)


def names(ids) -> str:
    """``A``, ``A and B``, ``A, B and C`` (at most 6 named, then ``and N more``)."""
    ids = [str(i) for i in ids]
    if not ids:
        return "nobody"
    if len(ids) > 6:
        return ", ".join(ids[:6]) + f" and {len(ids) - 6} more"
    if len(ids) == 1:
        return ids[0]
    return ", ".join(ids[:-1]) + " and " + ids[-1]
