"""The auditor: the step loop's observer that checks every invariant after every vLLM call.

Protocol (``vllm_repro.engine.loop.StepLoop``): ``attach(loop)`` once the scheduler is built;
``after_schedule(step, scheduler_output, scheduled)`` and ``after_update(step,
scheduler_output, trace_line)`` return True to stop the run; ``annotate(line)`` adds the audit's
figures and the step's violations to each trace line; ``finish(loop, outcome)`` returns True if
violations were found; ``violations`` and ``summary()`` go into ``result.json``.
``stop_exception`` is raised from inside a vLLM call when a hook catches a violation and the run
is not ``keep_going``: the loop ends the run there with outcome ``violation``.

Runs inside release environments: standard library + the release's own objects.
"""

from __future__ import annotations

import os
import re
import traceback
from collections import Counter
from itertools import compress
from operator import attrgetter

from ..records import AuditSummary, TraceLine, Violation
from .books import Books, HeldIds
from ..engine import state
from .checks import (PrefixMapCheck, RequestChecks, RequestHashCheck, StarvationCheck,
                     check_free_queue, check_leaks, check_refcounts, self_preempted_and_after,
                     used_blocks)
from .codes import NO_PROGRESS, make_violation, names
from .hooks import PoolHooks
from .registry import (AFTER_SCHEDULE, AFTER_UPDATE, END_OF_RUN, KV_BOOKS, REQUEST_CHECKS, Moment,
                       checks_for)

_AUDIT_DIR = os.path.dirname(os.path.abspath(__file__))
#: the levels whose runs this auditor observes (the registry's checks of these levels run)
LEVEL = "scheduler"
__all__ = ["Auditor", "AuditStop", "KV_BOOKS", "REQUEST_CHECKS", "self_preempted_and_after"]
_rid = attrgetter("request_id")
_npre = attrgetter("num_preemptions")


class AuditStop(BaseException):
    """Raised inside a vLLM call to stop the run at a violation. A ``BaseException``, so that
    vLLM's own ``except Exception`` handlers never swallow it."""

    def __init__(self, violation: Violation):
        super().__init__(violation.message)
        self.violation = violation


class Auditor:
    """Checks a run's live vLLM objects every step (see :mod:`vllm_repro.audit.checks`).

    ``adapter``: the engine adapter (for the release's ``RequestStatus`` and the vLLM root, so
    that stacks name ``vllm/...`` files). ``keep_going``: collect every violation instead of
    stopping at the first. ``max_records``: distinct violations kept (repeats of the same code,
    requests and blocks are counted on the first record, not stored again).
    """

    stop_exception = AuditStop
    #: every ``full_every``-th check compares the KV books block by block (see _kv_checks)
    full_every = 16

    def __init__(self, adapter, keep_going: bool = False, max_records: int = 200):
        self.adapter = adapter
        self.keep_going = keep_going
        self.max_records = max_records
        self.violations: list[Violation] = []
        self._keys: dict[tuple, Violation] = {}
        self._step_new: list[Violation] = []
        self._figures: dict | None = None  # a trace line's audit figures (_compute_figures)
        self._fig_step: int | None = None  # the step whose books _figures describe
        self._fingerprint: tuple | None = None  # (hook calls/free/map keys, refs, held ids, hashes)
        self.dropped = 0
        self.checks = 0
        self.stopped: dict | None = None
        self.loop = None
        self.books: Books | None = None
        self.hooks: PoolHooks | None = None
        self.hook_names: list[str] = []
        self._last_progress = 0
        self._vllm_root = str(getattr(adapter, "vllm_file", "") or "")
        self.off: list[str] = []
        self._off_names: set[str] = set()  # checks turned off during the run (_guarded)
        self.loop_ended = None  # the loop finish() was given (the end-of-run checks read it)

    # ---- observer protocol ----------------------------------------------------------------
    def attach(self, loop) -> None:
        self.loop = loop
        caps = getattr(self.adapter, "caps", None)
        if caps is not None:
            self.books = Books(loop.scheduler, caps.kv_block_hash, caps.kv_block_hash_tokens)
            #: the checks this release's books keep from running (Capabilities.audit_off)
            self.off = caps.audit_off()
        else:
            self.books = Books(loop.scheduler)
        self.req_checks = RequestChecks(
            self.books, getattr(self.adapter, "computed_advanced_in_schedule", True))
        self.hash_check = RequestHashCheck(self.books)
        self.map_check = PrefixMapCheck(self.books)
        self.hooks = PoolHooks(self.books, self._hook_report)
        self.hook_names = list(self.hooks.install())
        #: why the blocks are read one by one at every check (None: the mirror keeps them)
        self.mirror_off = self.books.install_mirror()
        self.starve_check = StarvationCheck(self.books)
        self._left_at: dict[str, int] = {}  # request id -> the step it left the scheduler
        self._last_schedule_step = 0
        self._overflow_seen = 0  # entries of the fake runner's PersistentBatch.overflow read
        self._pre_running: list | None = None  # (id, num_preemptions) of running, before schedule
        self._schedule_wrapped = None
        self._wrap_schedule(loop.scheduler)

    def after_schedule(self, step: int, so, scheduled) -> bool:
        pre = self._pre_running
        in_schedule = self._preempted_in_schedule(so)
        found = self._run_checks(Moment(step, AFTER_SCHEDULE, so, scheduled, extra={
            "running_before": pre, "preempted_in_schedule": in_schedule}))
        self._last_schedule_step = step
        return self._record_all(found, step, "after schedule")

    def after_update(self, step: int, so, line: TraceLine) -> bool:
        found = self._run_checks(Moment(step, AFTER_UPDATE, so, line=line))
        for rid in line.finished or ():
            self._left_at.setdefault(rid, step)
        if line.progressed():
            self._last_progress = step
        return self._record_all(found, step, "after update_from_output")

    def annotate(self, line: TraceLine) -> None:
        """Set ``line.audit`` (figures, blocks) and ``line.violations`` (this step's)."""
        if self.books is not None and KV_BOOKS not in self._off_names:
            if self._figures is None or self._fig_step != line.step or line.crash \
                    or self._step_new:
                # the books moved since the last full comparison (frees verified inside
                # free_blocks) or the step ended inside a vLLM call (a crash, a hook's stop):
                # read them as they are now
                self._figures = self._figures_now()
            line.audit = dict(self._figures)
            self._fig_step = None
        if self._step_new:
            line.violations = [v.brief() for v in self._step_new]
        self._step_new = []

    def finish(self, loop, outcome: str) -> bool:
        """End-of-run checks: after a clean run where every request finished, every block is
        back (``KV_LEAK``); after a stall, a ``NO_PROGRESS`` record; after a crash, the KV
        cache's books as vLLM left them. Returns True if any violation was recorded."""
        if self.hooks is not None:
            self.hooks.uninstall()
        self._unwrap_schedule()
        if self.books is None:
            return bool(self.violations)
        try:
            self._end_checks(loop, outcome)
        finally:
            self.books.uninstall_mirror()
        return bool(self.violations)

    def _end_checks(self, loop, outcome: str) -> None:
        """The registry's end-of-run checks of ``outcome`` (``clean`` only where every request
        finished and the audit did not stop the run), recorded without stopping."""
        step = getattr(loop, "step", 0)
        unfinished = [rid for rid in loop.created if rid not in loop.finished]
        if outcome == "clean" and (unfinished or self.stopped is not None):
            return
        self.loop_ended = loop
        found = self._run_checks(Moment(step, END_OF_RUN, outcome=outcome))
        if outcome == "clean":
            self._record_all(found, step, "end of run", stop=False)
        elif outcome == "stall":
            self._record_all(found, self._stalled_since, "stall", stop=False)
        elif outcome == "crash":
            self._record_all(found, step, "after crash", stop=False)

    def _run_checks(self, moment: Moment) -> list[Violation]:
        """Every registered check of ``moment.phase`` for this auditor's levels, in registration
        order (a check's ``group`` through :meth:`_guarded`)."""
        found: list[Violation] = []
        for c in checks_for(moment.phase, LEVEL, moment.outcome):
            if c.group is None:
                found += c.run(self, moment)
            else:
                found += self._guarded(c.group, c.run, self, moment)
        return found

    def summary(self) -> AuditSummary:
        """The ``audit`` section of ``result.json``."""
        by_code = Counter(v.code for v in self.violations)
        return AuditSummary(self.keep_going, self.stopped, self.checks, dict(by_code),
                            len(self.violations), self.dropped, list(self.hook_names),
                            dict(self.hooks.calls) if self.hooks else {}, off=list(self.off))

    # ---- checks ---------------------------------------------------------------------------
    def _guarded(self, name: str, fn, *args, **kwargs) -> list[Violation]:
        """``fn(*args, **kwargs)``'s findings, or none once ``name``'s checks are off. An
        ``AttributeError`` on one of the release's own objects (a book a release the lab does
        not know has renamed) turns ``name`` off for the rest of the run, with one line in
        :attr:`off` naming the class, the attribute and the checks, instead of failing the run
        (its verdict then reads ``clean (audit partial: ...)``). Any other error propagates."""
        if name in self._off_names:
            return []
        try:
            return fn(*args, **kwargs)
        except AttributeError as exc:
            obj = getattr(exc, "obj", None)
            if obj is None or not type(obj).__module__.startswith("vllm."):
                raise
            self._off_names.add(name)
            self.off.append(f"vLLM {getattr(self.adapter, 'version', '?')}'s "
                            f"{type(obj).__name__} has no attribute {exc.name}: {name} off")
            return []

    def _kv_checks(self, with_leaks: bool = True, quick: bool = False,
                   scheduled_ids=None) -> list[Violation]:
        """The KV cache's books (KV_REFCOUNT, KV_FREE_QUEUE, KV_LEAK, KV_PREFIX_MAP).

        Every check compares every block's ref count with the references held to it and
        (with prefix caching) looks up the blocks whose hash changed; with the books' block
        mirror (:class:`~vllm_repro.audit.books.BlockMirror`, see :meth:`_kv_checks_mirrored`)
        ref counts and hashes are kept as they are written, else every block is read at C
        speed. The free queue's links are walked every ``full_every``-th check and whenever
        its count is not the number of ref-0 blocks; only blocks whose hash changed are looked
        up in the hash map (all of them every 64 checks). When nothing moved since the last
        check (hook calls, counts, tables, hashes) the comparisons are skipped. Leaks are
        checked every time. ``quick`` (after ``update_from_output``): when the call did not
        go through the block pool at all (no hook call since the last check), only leaks are
        checked; a write to a block outside the pool's entry points is then caught at the next
        check, after the next ``schedule()``.
        """
        if self.hooks is not None and self.hooks.error is not None:
            raise RuntimeError("the audit failed inside a block-pool hook (a lab bug):\n"
                               + self.hooks.error)
        b = self.books
        self.checks += 1
        requests = b.scheduler.requests
        # pool calls other than frees verified block by block right after they ran
        calls = (sum(self.hooks.calls.values()) - self.hooks.verified_frees) if self.hooks else 0
        if quick and self._fingerprint is not None and calls == self._fingerprint[0][0] \
                and self.checks % self.full_every != 1:
            if self.hooks is None or self.hooks.verified_frees == self._fingerprint[4]:
                self._fig_step = getattr(self.loop, "step", None)  # the books did not move
            else:  # frees moved them since the figures were read: annotate reads them afresh
                self._fig_step = None
            return check_leaks(b, requests, getattr(self.loop, "finished", {})) if with_leaks else []
        full = self.checks % self.full_every == 1 or self._fingerprint is None
        if b.mirror is not None and b.mirror.exact:
            return self._kv_checks_mirrored(b, requests, calls, full, with_leaks, scheduled_ids)
        refs = b.refs()
        ids = b.held_ids()
        snap = self.map_check.snapshot(full=full)
        nfree = b.num_free()
        fp = (calls, nfree, snap[1])
        last = self._fingerprint
        found: list[Violation] = []
        if with_leaks:  # ownership changes without the pool (a request finishing)
            found += check_leaks(b, requests, getattr(self.loop, "finished", {}))
        if not full and fp == last[0] and refs == last[1] and ids == last[2] and snap[0] == last[3] \
                and (self.hooks is None or self.hooks.verified_frees == last[4]):
            # the pool, the tables and the hashes are as the last check left them
            self._fig_step = getattr(self.loop, "step", None)
            return found
        found += check_refcounts(b, refs, ids)
        if full or not self._queue_counts_agree(refs, nfree):
            found += check_free_queue(b, refs)[0]
        found += self.map_check.check(full=False, snap=snap)
        if scheduled_ids is not None or full:  # blocks get cached inside schedule()
            found += self.hash_check.check(requests, None if full else scheduled_ids)
        self._fingerprint = (fp, refs, ids, snap[0], self.hooks.verified_frees if self.hooks else 0)
        self._figures = self._compute_figures(refs, ids, nfree, snap)
        self._fig_step = getattr(self.loop, "step", None)
        return found

    def _kv_checks_mirrored(self, b: Books, requests, calls: int, full: bool, with_leaks: bool,
                            scheduled_ids) -> list[Violation]:
        """:meth:`_kv_checks` past its quick path, on the books' mirror of ref counts and hashes
        (:class:`~vllm_repro.audit.books.BlockMirror`): the same checks, run when the same
        things moved, with the same findings; what moved is known from the blocks written since
        the last comparison instead of comparing every block's ref count and hash, and a check
        that would find nothing is answered from running counts (any disagreement is then
        worked out by the same code as without the mirror, on full lists)."""
        m = b.mirror
        ids = b.held_key()  # (compared with the last one without building the flat list)
        nfree = b.num_free()
        if b.caching:
            inner = self.map_check._inner()
            snap = (None, len(inner) if inner is not None else -1)
            hashes_same = not m.hashes_moved()
        else:  # as without the mirror: hashes read at full checks only
            snap = self.map_check.snapshot(full=full)
            hashes_same = self._fingerprint is not None and snap[0] == self._fingerprint[3]
        fp = (calls, nfree, snap[1])
        last = self._fingerprint
        vf = self.hooks.verified_frees if self.hooks else 0
        found: list[Violation] = []
        if with_leaks:  # ownership changes without the pool (a request finishing)
            found += check_leaks(b, requests, getattr(self.loop, "finished", {}))
        if not full and fp == last[0] and ids == last[2] and hashes_same and vf == last[4] \
                and not m.refs_moved():
            self._fig_step = getattr(self.loop, "step", None)
            return found
        if not b.refcounts_agree():
            found += check_refcounts(b, b.refs(), ids.flat())
        null = b.null_id
        nzero = m.nzero - (1 if null is not None and m.refs[null] == 0 else 0)
        nb = b.null
        if full or not (nfree == nzero and (nb is None or (nb.prev_free_block is None
                                                           and nb.next_free_block is None))):
            found += check_free_queue(b, b.refs())[0]
        if b.caching:
            found += self.map_check.check_moved(m)
        else:
            found += self.map_check.check(full=False, snap=snap)
        if scheduled_ids is not None or full:  # blocks get cached inside schedule()
            found += self.hash_check.check(requests, None if full else scheduled_ids)
        m.take()
        self._fingerprint = (fp, None, ids, snap[0], vf)
        self._figures = self._figures_now(ids, nfree, snap[1])
        self._fig_step = getattr(self.loop, "step", None)
        return found

    def _figures_now(self, ids: HeldIds | None = None, nfree: int | None = None,
                     nkeys: int | None = None) -> dict:
        """The trace line's figures of the books as they are now (``ids``, ``nfree``,
        ``nkeys``: already read)."""
        b = self.books
        m = b.mirror
        if m is None or not m.exact:
            return self._compute_figures(b.refs(), b.held_ids(), b.num_free(),
                                         self.map_check.snapshot(full=False))
        ids = b.held_key() if ids is None else ids
        null = b.null_id
        refs = m.refs
        fig = {"free": b.num_free() if nfree is None else nfree,
               "used": b.num_blocks - m.nzero - (1 if null is not None and refs[null] != 0 else 0),
               "total": b.num_blocks,
               "refs_held": ids.refs_held}
        if b.caching:
            if nkeys is None:
                inner = self.map_check._inner()
                nkeys = len(inner) if inner is not None else -1
            fig["cached_free"] = m.nhashed - m.nhashed_held
            fig["hash_entries"] = nkeys
        return fig

    def _queue_counts_agree(self, refs: list[int], nfree: int) -> bool:
        """The free queue counts exactly the non-null ref-0 blocks, and the null block is not
        linked into it."""
        b = self.books
        null = b.null_id
        nzero = refs.count(0) - (1 if null is not None and refs[null] == 0 else 0)
        nb = b.null
        return nfree == nzero and (nb is None or (nb.prev_free_block is None
                                                  and nb.next_free_block is None))

    def _compute_figures(self, refs: list[int], ids: list[int], nfree: int, snap) -> dict:
        """The trace line's ``audit`` figures: ``free`` (the free queue's count), ``used``
        (non-null blocks with ref_cnt > 0), ``total`` (num_gpu_blocks), ``refs_held``
        (block-table references), with prefix caching ``cached_free`` (ref-0 blocks still
        holding a cached prefix) and ``hash_entries`` (keys in the hash map); in blocks."""
        b = self.books
        null = b.null_id
        fig = {"free": nfree, "used": used_blocks(refs, null), "total": b.num_blocks,
               "refs_held": len(ids) - (ids.count(null) if null is not None else 0)}
        if b.caching:
            hashes, nkeys = snap
            # hashes are non-empty bytes or tuples: truthy; None is not
            hashed = len(list(filter(None, hashes)))
            fig["cached_free"] = hashed - len(list(filter(None, compress(hashes, refs))))
            fig["hash_entries"] = nkeys
        return fig

    def _no_progress(self, loop, step: int) -> Violation:
        waiting, running, _ = self.adapter.queues(loop.scheduler)
        unfinished = [rid for rid in loop.created if rid not in loop.finished]
        since = self._last_progress + 1
        what = "no token scheduled and no request finished"
        stall_since = getattr(loop, "stall_since", None)
        if stall_since is not None and since > step:
            # tokens were scheduled every step, yet no request got further than it had been
            # (the engine-core loop's high-water mark of computed + output tokens): a livelock
            since = stall_since
            what = ("tokens scheduled but no request finished or got further (computed + output "
                    "tokens)")
        nfree = self.books.num_free()
        self._stalled_since = since  # the record's step: the first step without progress
        return make_violation(NO_PROGRESS, (
            f"{what} for {step - since + 1} steps "
            f"(steps {since}-{step}) while {names(unfinished)} are unfinished (waiting: "
            f"{names(waiting) if waiting else 'none'}; running: "
            f"{names(running) if running else 'none'}); {nfree} of "
            f"{self.books.num_blocks - 1} usable blocks free; expected progress every step"),
            requests=unfinished)

    # ---- preemptions inside schedule(), the worker's batch -----------------------------------
    def _wrap_schedule(self, sched) -> None:
        """Wrap the scheduler instance's ``schedule`` (the class is never patched) so that the
        running requests are read just before it runs: a preemption inside ``schedule()`` is
        told apart from one made between steps (``reset_prefix_cache``). Undone at the first
        output without ``preempted_req_ids`` and at the end of the run."""
        orig = getattr(sched, "schedule", None)
        if orig is None:
            return
        before = vars(sched).get("schedule")
        auditor = self

        def schedule(*args, **kwargs):
            running = list(sched.running)
            try:  # at C speed where every request has the count (0.13+)
                npre = list(map(_npre, running))
            except AttributeError:
                npre = [getattr(r, "num_preemptions", 0) for r in running]
            auditor._pre_running = list(zip(map(_rid, running), npre))
            return orig(*args, **kwargs)

        schedule.__wrapped__ = orig
        sched.schedule = schedule
        self._schedule_wrapped = (sched, schedule, before)

    def _unwrap_schedule(self) -> None:
        if self._schedule_wrapped is None:
            return
        sched, wrapper, before = self._schedule_wrapped
        self._schedule_wrapped = None
        if vars(sched).get("schedule") is wrapper:
            if before is None:
                del sched.schedule
            else:
                sched.schedule = before

    def _preempted_in_schedule(self, so) -> list[str]:
        """Requests running before this ``schedule()`` and preempted inside it (status
        PREEMPTED now, or ``num_preemptions`` up: preempted and resumed in the same call)."""
        pre, self._pre_running = self._pre_running, None
        if state.preempted_report(so) is state.ABSENT:
            self._unwrap_schedule()  # the release reports no preemptions: nothing to compare
            return []
        if not pre:
            return []
        reqs = self.books.scheduler.requests
        out = []
        name = self.req_checks._name
        for rid, npre in pre:
            r = reqs.get(rid)
            if r is not None and (name(getattr(r, "status", None)) == "PREEMPTED"
                                  or (getattr(r, "num_preemptions", 0) or 0) > (npre or 0)):
                out.append(rid)
        return out

    def _preempted_between(self) -> list[str]:
        """Requests preempted before this step's ``schedule()`` by an engine-core event
        (``reset_prefix_cache(reset_running_requests=True)``, ``pause``): the loop's trace line
        of this step (``TraceLine.preemptions``, a cause other than ``schedule``), where the
        release reports such preemptions in the next output
        (:func:`~vllm_repro.engine.state.reports_preemptions_between_steps`)."""
        line = getattr(self.loop, "_line", None)
        pre = getattr(line, "preemptions", None) or {}
        if not pre or not state.reports_preemptions_between_steps(self.books.scheduler):
            return []  # (a release that does not report them there: nothing to require)
        return [rid for rid, cause in pre.items() if cause != "schedule"]

    # ---- recording ------------------------------------------------------------------------
    def _record(self, v: Violation, step: int, phase: str) -> bool:
        """Store ``v`` unless it repeats a stored one; True if it is new. ``step``: the step
        it was found in, unless the check named the step of the fault itself (``v.step``)."""
        v.step = step if v.step is None else v.step
        v.phase = v.phase or phase
        key = (v.code, tuple(v.requests), tuple(v.blocks), re.sub(r"\d+", "#", v.message))
        first = self._keys.get(key)
        if first is not None:
            first.repeats = (first.repeats or 0) + 1
            first.last_step = step
            return False
        if len(self.violations) >= self.max_records:
            self.dropped += 1
            return False
        self._keys[key] = v
        self.violations.append(v)
        self._step_new.append(v)
        return True

    def _record_all(self, found: list[Violation], step: int, phase: str, stop: bool = True) -> bool:
        new = [v for v in found if self._record(v, step, phase)]
        if new and stop and not self.keep_going:
            self.stopped = {"step": step, "code": new[0].code, "phase": phase}
            return True
        return False

    def _hook_report(self, code: str, message: str, requests, blocks) -> None:
        step = getattr(self.loop, "step", 0)
        stack, call = self._stack()
        v = make_violation(code, message, requests=requests, blocks=blocks, step=step,
                           phase=f"in {call}" if call else "in a vLLM call", stack=stack)
        if self._record(v, step, v.phase) and not self.keep_going:
            self.stopped = {"step": step, "code": code, "phase": v.phase}
            raise AuditStop(v)

    def _stack(self) -> tuple[list[str], str | None]:
        """The caller's stack, outermost first, from the step loop down to the hooked call
        (the audit's own frames left out), and the outermost vLLM function on it."""
        frames = traceback.extract_stack()
        out = []
        outer_call = None
        started = False
        for fs in frames:
            path = os.path.abspath(fs.filename)
            if path.startswith(_AUDIT_DIR):
                continue
            if fs.name == "run" and path.endswith(os.path.join("engine", "loop.py")):
                started = True
                out = []
            shown = path
            if self._vllm_root and path.startswith(self._vllm_root + os.sep):
                shown = "vllm/" + path[len(self._vllm_root) + 1:]
                if outer_call is None:
                    outer_call = fs.name
            out.append(f"{shown}:{fs.lineno} in {fs.name}" + (f": {fs.line}" if fs.line else ""))
        if not started:
            out = out[-16:]
        return out[-24:], outer_call
