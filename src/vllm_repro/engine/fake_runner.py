"""The fake model runner: what the GPU would have computed, for what the scheduler scheduled.

This is where the lab's fakes stop (the model-runner / executor boundary). Like
``vllm/v1/worker/gpu_model_runner.py:GPUModelRunner.execute_model`` it samples a token only for
requests whose prompt is fully computed after this step (a partial prefill chunk yields no token),
verifies draft tokens for spec decode (accepted drafts + one bonus token), and proposes the next
drafts. What it emits comes from the scenario's ``model`` section: the token id, EOS at a given
output length, empty outputs at given steps, draft tokens and how many are accepted (per
request, or per verification step of a request), how many drafts are proposed after each of a
request's steps, a scripted token list per request; and, for structured-output requests, the step's grammar
bitmask applied as the GPU sampler applies it (``apply_grammar``: the scheduler's
``get_grammar_bitmask`` rows, one per position of a request, drafts included).
"""

from __future__ import annotations

from .adapter import EOS_TOKEN_ID, Scheduled


class FakeModelRunner:
    """Builds the sampled token lists (and next drafts) for one step.

    ``model``: the scenario's ``model`` mapping; ``num_speculative_tokens``: drafts per request
    per step when spec decode is on (None: off).
    """

    def __init__(self, model: dict, num_speculative_tokens: int | None):
        self.token = model.get("token", 100)
        self.scripted = {rid: list(toks) for rid, toks in (model.get("tokens") or {}).items()}
        self.eos_at = model.get("eos_at") or {}
        self.empty_at = {rid: set(steps) for rid, steps in (model.get("empty_at") or {}).items()}
        self.num_spec = num_speculative_tokens
        drafts = model.get("draft_tokens")
        self.draft_tokens = list(drafts) if drafts else ([self.token] * (num_speculative_tokens or 0))
        spec = model.get("spec_decode") or {}
        #: request id -> drafts accepted: one count for every verification, or a list of counts
        #: for its successive verifications (then all)
        self.accept: dict[str, int | list[int]] = spec.get("accept") or {}
        #: request id -> drafts proposed after its successive sampling steps (then all)
        self.propose: dict[str, list[int]] = spec.get("propose") or {}
        #: steps after which the drafter does not run (``input_fits_in_drafter`` false in a
        #: runner that tests it inline): no draft token ids reach the scheduler
        self.drafter_skipped_at: set[int] = set(spec.get("drafter_skipped_at") or ())
        #: request id -> steps in which its drafts were verified / in which it sampled, so far
        self._verified: dict[str, int] = {}
        self._sampled: dict[str, int] = {}
        # the runner's own per-request books (GPUModelRunner.requests: CachedRequestState):
        # req_id -> [num_computed_tokens as last told by the scheduler, num_tokens it has seen]
        self.books: dict[str, list[int]] = {}
        #: the worker's persistent batch (set by the step loop: :class:`PersistentBatch`)
        self.slots: PersistentBatch | None = None
        #: a model-based drafter's release-side decisions (set by the step loop:
        #: :class:`~vllm_repro.engine.drafter.ReleaseDrafter`), None for the n-gram ones
        self.drafter = None
        #: the drafter's record of the last :meth:`execute` (``DraftRecord``), None without one
        self.draft_record = None

    def execute(self, step: int, scheduled: list[Scheduled], requests: dict,
                finished_ids=(), scheduler_output=None
                ) -> tuple[list[str], list[list[int]], list[list[int]] | None]:
        """``(req_ids, sampled_token_ids, next_draft_token_ids)`` for the scheduled requests.

        ``requests``: the scheduler's ``requests`` dict (``Request.num_tokens`` and
        ``num_output_tokens`` as of this step's ``schedule()``); ``finished_ids``: the output's
        ``finished_req_ids`` (the runner drops their books); ``scheduler_output``: the
        ``SchedulerOutput`` itself, for the worker-side state (:attr:`slots`: the release's
        ``InputBatch`` is brought in line with it, as ``GPUModelRunner._update_states`` does,
        and given the sampled tokens after, as ``_bookkeeping_sync``). Like ``GPUModelRunner``, a token is
        sampled only when ``num_computed_tokens + num_scheduled_tokens >= num_tokens`` by the
        runner's own books, which a request scheduled without new or cached data keeps stale.
        """
        req_ids, sampled, drafts, seq_lens = [], [], [], []
        self.draft_record = None
        if self.slots is not None:
            self.slots.update(step, [s.req_id for s in scheduled], finished_ids, scheduler_output)
        for rid in finished_ids:
            self.books.pop(rid, None)
        for s in scheduled:
            req = requests.get(s.req_id)
            req_ids.append(s.req_id)
            book = self.books.get(s.req_id)
            if s.num_computed_before is not None:
                # new or cached request data: the runner takes the scheduler's figures
                num_tokens = req.num_tokens if req is not None else (book[1] if book else 0)
                book = self.books[s.req_id] = [s.num_computed_before, num_tokens]
            elif book is None:
                # scheduled but neither new nor cached, and never seen: nothing to compute
                sampled.append([])
                drafts.append([])
                continue
            # else: scheduled without new/cached data (a stale entry): the runner's old books
            seq_len = book[0] + s.num_scheduled
            seq_lens.append(seq_len)
            if seq_len < book[1] or step in self.empty_at.get(s.req_id, ()) or req is None:
                # a partial prefill: the sampled token is discarded
                sampled.append([])
                drafts.append([])
                continue
            n_acc = self._accepted(s.req_id, len(s.spec_tokens))
            # async scheduling: tokens still in flight count as output (Request's placeholders)
            outputs = _num_output_tokens(req) + (getattr(req, "num_output_placeholders", 0) or 0)
            script = self.scripted.get(s.req_id, ())
            bonus = script[outputs + n_acc] if outputs + n_acc < len(script) else self.token
            tokens = list(s.spec_tokens[:n_acc]) + [bonus]
            eos = self.eos_at.get(s.req_id)
            if eos is not None:
                for i in range(len(tokens)):
                    if outputs + i + 1 == eos:
                        tokens = tokens[:i] + [EOS_TOKEN_ID]
                        break
            sampled.append(tokens)
            book[1] += len(tokens)
            drafts.append(self._proposed(s.req_id) if self.num_spec else [])
        after = getattr(self.slots, "after_sample", None)
        if after is not None:
            after(req_ids, sampled)
        if self.num_spec and step in self.drafter_skipped_at:
            # GPUModelRunner (0.11-0.22): the drafter not run, _draft_token_ids left None, so
            # take_draft_token_ids returns None and the scheduler keeps its spec_token_ids
            from ..records import DraftRecord

            self.draft_record = DraftRecord(
                getattr(self, "spec_method", None) or "ngram",
                skipped={rid: f"model.spec_decode.drafter_skipped_at: step {step} (no draft "
                              "token ids)" for rid in req_ids})
            return req_ids, sampled, None
        if self.drafter is not None and self.num_spec:
            drafts, self.draft_record = self.drafter.decide(req_ids, seq_lens, drafts, step)
        return req_ids, sampled, (drafts if self.num_spec else None)

    def _accepted(self, rid: str, num_drafts: int) -> int:
        """How many of the ``num_drafts`` drafts scheduled for ``rid`` the model accepts in
        this verification (``spec_decode.accept``: a count for all, or the next of a list;
        default and past the list: all). A step without drafts is no verification."""
        if not num_drafts:
            return 0
        if self.drafter is not None and rid in self.drafter.zeroed:
            # the drafter did not run: the runner's zeroed drafts, which the target rejects
            self._verified[rid] = self._verified.get(rid, 0) + 1
            return 0
        rule = self.accept.get(rid)
        i = self._verified.get(rid, 0)
        self._verified[rid] = i + 1
        if isinstance(rule, list):
            return min(rule[i], num_drafts) if i < len(rule) else num_drafts
        return num_drafts if rule is None else min(rule, num_drafts)

    def _proposed(self, rid: str) -> list[int]:
        """The drafts the drafter proposes for ``rid`` after this sampling step:
        ``model.draft_tokens``, cut to the next count of ``spec_decode.propose`` (0: none)."""
        counts = self.propose.get(rid)
        j = self._sampled.get(rid, 0)
        self._sampled[rid] = j + 1
        if counts is not None and j < len(counts):
            return list(self.draft_tokens[:counts[j]])
        return list(self.draft_tokens)


    # ---- structured outputs -------------------------------------------------------------------
    def apply_grammar(self, req_ids: list[str], sampled: list[list[int]],
                      rows: dict[str, list]) -> list[list[int]]:
        """``sampled`` with each structured-output request's tokens sampled through its
        bitmask rows (``rows``: request id -> the packed int32 rows of its positions, as the
        scheduler's ``get_grammar_bitmask`` lays them out: one per scheduled draft, then the
        bonus position). As the GPU sampler: the logits of a forbidden token are ``-inf``, so a
        draft the bitmask forbids is rejected and that position is sampled from the masked
        distribution, and a forbidden token gives way to the allowed choice (:meth:`choose`)."""
        out = []
        for rid, tokens in zip(req_ids, sampled):
            masks = rows.get(rid)
            if not masks or not tokens:
                out.append(tokens)
                continue
            kept: list[int] = []
            for i, tok in enumerate(tokens):
                if i >= len(masks):
                    break
                if allowed(masks[i], tok):
                    kept.append(tok)
                    continue
                kept.append(self.choose(masks[i], tok))
                break
            out.append(kept)
            retract = getattr(self.slots, "retract", None)
            if retract is not None and len(kept) < len(tokens):
                retract(rid, len(tokens) - len(kept))  # the worker-side state cached them
        return out

    def choose(self, row, preferred: int) -> int:
        """The token the masked sampler picks at a position whose row forbids ``preferred``:
        the model's ``token`` where allowed, else EOS where allowed, else the highest allowed
        token id; a row that allows nothing gives 0 (``argmax`` over all ``-inf`` logits)."""
        for cand in (preferred, self.token, EOS_TOKEN_ID):
            if allowed(row, cand):
                return cand
        return highest_allowed(row)


def allowed(row, token: int) -> bool:
    """Whether a packed int32 bitmask row (xgrammar's layout: bit ``t % 32`` of word
    ``t // 32``) allows ``token``."""
    word = token >> 5
    if token < 0 or word >= len(row):
        return False
    return bool(int(row[word]) & (1 << (token & 31)))


def highest_allowed(row) -> int:
    """The highest token id a packed row allows, or 0 where it allows none."""
    for word in range(len(row) - 1, -1, -1):
        bits = int(row[word]) & 0xFFFFFFFF
        if bits:
            return word * 32 + bits.bit_length() - 1
    return 0


class PersistentBatch:
    """The worker's persistent batch: ``max_num_reqs`` slots (``max_num_seqs``), kept as
    ``GPUModelRunner._update_states`` keeps its ``InputBatch`` (``vllm/v1/worker/
    gpu_model_runner.py``, ``gpu_input_batch.py``): each step the finished requests
    (``finished_req_ids``) and those not scheduled in this step leave their slots, then every
    scheduled request not in the batch takes a free one. Where none is free the worker's
    ``InputBatch.add_request`` fails (``assert new_req_index < self.max_num_reqs``): that is
    recorded in ``overflow`` as ``(step, request id, slots in use, max_num_reqs)``, for the
    audit to report (``WORKER_BATCH_OVERFLOW``); the request is not given a slot and the step
    goes on, so that the run's other findings are still seen."""

    kind = "lab"
    #: what ``RunResult.worker_state`` says of it
    describe = "PersistentBatch (the lab's slot model)"

    def __init__(self, max_num_reqs: int | None):
        self.max_num_reqs = max_num_reqs
        self.slots: set[str] = set()
        self.overflow: list[tuple[int, str, int, int]] = []

    def update(self, step: int, scheduled_ids: list[str], finished_ids=(),
               scheduler_output=None) -> None:
        slots = self.slots
        slots.difference_update(finished_ids)
        slots.intersection_update(scheduled_ids)
        cap = self.max_num_reqs
        for rid in scheduled_ids:
            if rid in slots:
                continue
            if cap is not None and len(slots) >= cap:
                self.overflow.append((step, rid, len(slots), cap))
                continue
            slots.add(rid)


def _num_output_tokens(req) -> int:
    n = getattr(req, "num_output_tokens", None)
    if n is None:
        n = len(getattr(req, "output_token_ids", []))
    return n
