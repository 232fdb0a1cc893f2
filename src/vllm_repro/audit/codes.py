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

#: code -> what it means (docs/audit.md says the same).
CODES: dict[str, str] = {
    KV_DOUBLE_FREE: "a block freed while no one holds the reference being given back "
                    "(ref_cnt already 0, or the free would drop ref_cnt below the number of "
                    "block tables still holding it); caught inside BlockPool.free_blocks",
    KV_REFCOUNT: "a block's ref_cnt below 0, or not equal to the number of block-table "
                 "references across requests and KV cache groups",
    KV_FREE_QUEUE: "the free queue and the ref counts disagree: a held block in the queue, a "
                   "ref-0 block outside it, a broken link, or free + used != num_gpu_blocks",
    KV_LEAK: "blocks held by a finished, aborted or preempted request; at the end of a run, "
             "a block not back in the free queue",
    KV_PREFIX_MAP: "the prefix-cache hash map and the blocks' hashes disagree; at level "
                   "v0-engine also a block the worker is told to skip as a cached prefix "
                   "(computed_block_nums) that holds no KV of the sequence's tokens",
    REQ_STATE: "a request in two queues, status and queue disagree, a scheduled request that "
               "is not running or is scheduled twice, num_computed_tokens out of bounds or "
               "moving backwards without a preemption",
    BATCH_LIMIT: "scheduled tokens over max_num_batched_tokens, running over max_num_seqs, a "
                 "scheduled count <= 0 (also: draft tokens of a request not scheduled, or more "
                 "of them than its scheduled count), or a total that is not the sum of its parts",
    NO_PROGRESS: "unfinished requests and nothing scheduled or finished for stall_steps steps",
    REQ_RESIDUE: "at the end of a run, a request that left the scheduler is still a key of a "
                 "per-request dict or set of the scheduler, the KV cache manager (and its "
                 "coordinator and single-type managers), the structured-output manager or the "
                 "KV connector; at level v0-engine, a finished child group of an n > 1 request "
                 "still a key of LLMEngine.seq_id_to_seq_group after the engine collected it",
    REQ_STARVED: "a running request with tokens pending gets nothing in a step that left token "
                 "budget and free blocks enough for it",
    PREEMPT_UNREPORTED: "a request preempted inside schedule() is missing from that step's "
                        "SchedulerOutput.preempted_req_ids (where the release reports them)",
    WORKER_BATCH_OVERFLOW: "the worker's persistent batch (max_num_seqs slots, as the GPU model "
                           "runner's InputBatch keeps them) has no free slot for a scheduled "
                           "request",
    REQ_OVER_MAX_LEN: "a request's num_computed_tokens is over max_model_len",
    KV_TRANSFER_FREED: "a block a KV connector transfer in flight uses (an asynchronous load "
                       "not yet in finished_recving, or the send of a delayed free not yet in "
                       "finished_sending) is no longer in that request's block table: freed, "
                       "or handed to another request",
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
