"""The step loop: a scenario driven through the release's real ``Scheduler``.

Mirrors ``vllm/v1/engine/core.py:EngineCore.step`` with the executor replaced by
:class:`~vllm_repro.engine.fake_runner.FakeModelRunner`::

    requests at_step n added (EngineCore.add_request), aborts applied (abort_requests)
    if nothing is left to schedule: the step is idle          # EngineCore.step's early return
    scheduler_output = scheduler.schedule()                  # step n
    model_output = fake_runner.execute(scheduler_output)
    scheduler.update_from_output(scheduler_output, model_output)
    stat_loggers.record(scheduler_stats)                     # disable_log_stats: false
    scheduler.update_draft_token_ids(drafts)                 # spec decode, 0.10.2+

Runs inside the release environment (standard library + vLLM only). Returns a result dict (the
``result.json`` of DESIGN.md) and writes one trace line per step.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from .adapter import AdapterError, RefusedByRelease, V1Adapter, token_stream
from .fake_runner import FakeModelRunner


def vllm_frames(tb, vllm_root: Path) -> list[dict]:
    """Frames of a traceback that lie in the vLLM package, outermost first, as
    ``{"file": "vllm/v1/...py", "function": ..., "line": N}``."""
    frames = []
    root = str(vllm_root.resolve())
    for fs in traceback.extract_tb(tb):
        try:
            path = str(Path(fs.filename).resolve())
        except OSError:
            continue
        if path.startswith(root + "/"):
            frames.append({"file": "vllm/" + path[len(root) + 1:], "function": fs.name,
                           "line": fs.lineno})
    return frames


def describe_exception(exc: BaseException, vllm_root: Path, step: int, phase: str) -> dict:
    """The ``crash`` record: type, first message line, innermost vLLM frame, step, phase."""
    frames = vllm_frames(exc.__traceback__, vllm_root)
    msg = str(exc).strip().splitlines()
    return {
        "type": type(exc).__name__,
        "message": msg[0] if msg else "",
        "where": frames[-1] if frames else None,
        "vllm_frames": frames[-8:],
        "step": step,
        "phase": phase,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-6000:],
    }


class _NeverRaised(BaseException):
    """Stands in for an observer's ``stop_exception`` when it has none."""


class StepLoop:
    """One scenario run. ``observer`` (the auditor, :class:`vllm_repro.audit.Auditor`) gets
    ``attach(loop)``, ``after_schedule(step, so, scheduled)``, ``after_update(step, so, line)``
    and ``finish(loop, outcome)`` calls and may stop the run by returning True. Optional:
    ``annotate(line)`` adds fields to each trace line before it is written; ``stop_exception``
    (a ``BaseException`` it raises from inside a vLLM call to stop there); ``violations`` and
    ``summary()`` go into the result."""

    level = "scheduler"

    def __init__(self, adapter: V1Adapter, scenario: dict, trace: Callable[[dict], None] | None = None,
                 observer: Any = None):
        self.adapter = adapter
        self.sc = scenario
        self.trace = trace or (lambda line: None)
        self.observer = observer
        self.cfg = scenario["config"]
        self.requests_by_step: dict[int, list[dict]] = {}
        for r in scenario["requests"]:
            self.requests_by_step.setdefault(r["at_step"], []).append(r)
        self.events_by_step: dict[int, list[dict]] = {}
        for e in scenario.get("events", []):
            self.events_by_step.setdefault(e["at_step"], []).append(e)
        self.created: dict[str, Any] = {}
        self.finished: dict[str, str] = {}
        self.order = 0

    def prompt_of(self, spec: dict) -> list[int]:
        n = spec["prompt_len"]
        if spec.get("prefix"):
            k = spec.get("prefix_len") or n
            return token_stream("prefix:" + spec["prefix"], k) + token_stream("req:" + spec["id"], n - k)
        return token_stream("req:" + spec["id"], n)

    def run(self) -> dict:
        a = self.adapter
        t0 = time.perf_counter()
        try:
            _, self.scheduler = a.build(self.cfg)
        except (AdapterError, RefusedByRelease):
            raise
        except Exception as exc:
            raise self.refusal(exc) from exc
        model = self.sc.get("model") or {}
        if model.get("empty_at") and not a.caps.empty_outputs:
            raise RefusedByRelease(f"model.empty_at: {a.caps.refusal('empty outputs')}")
        record_stats = self._front_door_and_stats(a.vllm_config)
        build_s = time.perf_counter() - t0
        sched = self.scheduler
        runner = FakeModelRunner(self.sc.get("model") or {}, self.cfg.get("num_speculative_tokens"))
        max_steps, stall_steps, last_add = self._limits_and_attach()
        result: dict[str, Any] = {"outcome": "clean"}
        stop_exc = getattr(self.observer, "stop_exception", None) or _NeverRaised
        idle = 0
        step = 0
        t1 = time.perf_counter()
        c1 = time.process_time()
        for step in range(1, max_steps + 1):
            self.step = step
            line: dict[str, Any] = {"step": step, "added": [], "aborted": []}
            phase = "add_request"
            try:
                for r in self.requests_by_step.get(step, []):
                    req = self._lab(a.make_request, r["id"], self.prompt_of(r), r["max_tokens"],
                                    r.get("priority", 0),
                                    r["arrival_time"] if r.get("arrival_time") is not None
                                    else float(self.order))
                    self.order += 1
                    self.created[r["id"]] = req
                    sched.add_request(req)
                    line["added"].append(r["id"])
                phase = "abort"
                for e in self.events_by_step.get(step, []):
                    if e.get("abort"):
                        a.abort(sched, e["abort"])
                        line["aborted"].extend(e["abort"])
                so = None
                if not a.has_work(sched):
                    # EngineCore.step returns without scheduling when there is nothing to do
                    line["scheduled"] = {}
                    line["idle"] = True
                else:
                    phase = "schedule"
                    so = sched.schedule()
                    scheduled = self._lab(a.scheduled, so)
                    line["scheduled"] = {s.req_id: s.num_scheduled for s in scheduled}
                    if self.observer is not None and self._lab(self.observer.after_schedule, step,
                                                               so, scheduled):
                        result = {"outcome": "violation"}
                        self._state(line)
                        self._emit(line)
                        break
                    req_ids, sampled, drafts = self._lab(runner.execute, step, scheduled,
                                                         sched.requests,
                                                         getattr(so, "finished_req_ids", ()))
                    mro = self._lab(a.model_output, req_ids, sampled, drafts)
                    phase = "update_from_output"
                    engine_core_outputs = sched.update_from_output(so, mro)
                    if record_stats is not None:
                        # AsyncLLM's output handler: logger_manager.record(scheduler_stats, ...)
                        phase = "record_stats"
                        for stats in a.scheduler_stats(engine_core_outputs):
                            record_stats(stats)
                    phase = "update_draft_token_ids"
                    a.deliver_drafts(sched, req_ids, drafts)
            except (RefusedByRelease, AdapterError):
                raise
            except stop_exc:  # the observer stopped the run inside a vLLM call (audit hook)
                result = {"outcome": "violation"}
                self._state(line)
                self._emit(line)
                break
            except Exception as exc:  # vLLM raised: the reproduction's main kind of evidence
                result = {"outcome": "crash", "crash": describe_exception(exc, a.vllm_file, step, phase)}
                line["crash"] = {k: result["crash"][k] for k in ("type", "message", "where", "phase")}
                self._state(line)
                self._emit(line)
                break
            newly = self._collect_finished()
            line["finished"] = newly
            self._state(line)
            if (self.observer is not None and so is not None
                    and self._lab(self.observer.after_update, step, so, line)):
                result = {"outcome": "violation"}
                self._emit(line)
                break
            self._emit(line)
            unfinished = [rid for rid in self.created if rid not in self.finished]
            if step >= last_add and not unfinished:
                break
            progress = bool(newly) or any(n > 0 for n in line["scheduled"].values())
            idle = 0 if (progress or not unfinished) else idle + 1
            if idle >= stall_steps:
                self.stall_since = step - stall_steps + 1
                result = {"outcome": "stall", "stall": {
                    "step": step, "since": step - stall_steps + 1, "unfinished": unfinished,
                    "waiting": line["waiting"], "running": line["running"],
                    "free_blocks": line.get("free_blocks")}}
                break
        return self.finish_result(result, step, build_s, time.perf_counter() - t1,
                                  time.process_time() - c1)

    def _front_door_and_stats(self, vllm_config):
        """Every request through the release's front door (its refusals are input errors);
        returns the stat logger's ``record(scheduler_stats)`` when the scenario logs stats
        (``disable_log_stats: false``), else None. Shared by both levels."""
        a = self.adapter
        for r in self.sc["requests"]:
            a.front_door(r["id"], self.prompt_of(r), r["max_tokens"], r.get("priority", 0))
        if self.cfg.get("disable_log_stats", True):
            return None
        return self._lab(a.stat_logger, vllm_config)

    def _limits_and_attach(self) -> tuple[int, int, int]:
        """``(max_steps, stall_steps, the last step that adds a request or has an event)``,
        with the observer attached to the built loop. Shared by both levels."""
        limits = self.sc.get("limits") or {}
        last_add = max([*self.requests_by_step, *self.events_by_step, 0])
        if self.observer is not None:
            self.observer.attach(self)
        return limits.get("max_steps", 500), limits.get("stall_steps", 20), last_add

    def finish_result(self, result: dict, step: int, build_s: float, run_s: float,
                      run_cpu_s: float) -> dict:
        """The end of a run at either level: the observer's end-of-run checks (a clean run
        with violations becomes ``violation``), then ``steps``, ``finished`` (request id ->
        finish status), ``unfinished``, ``limit_reached`` and ``timing`` (seconds; steps/s of
        the loop alone) added to ``result``, which is returned."""
        if self.observer is not None:
            fin = self.observer.finish(self, result["outcome"])
            if fin and result["outcome"] == "clean":
                result["outcome"] = "violation"
            if getattr(self.observer, "violations", None):
                result["violations"] = list(self.observer.violations)
            if hasattr(self.observer, "summary"):
                result["audit"] = self.observer.summary()
        unfinished = [r["id"] for r in self.sc["requests"] if r["id"] not in self.finished]
        result.update({
            "steps": step,
            "finished": dict(self.finished),
            "unfinished": unfinished,
            "limit_reached": result["outcome"] == "clean" and bool(unfinished),
            "level": self.level,
            "timing": {"build_s": round(build_s, 4), "run_s": round(run_s, 4),
                       "run_cpu_s": round(run_cpu_s, 4),
                       "steps_per_s": round(step / run_s, 1) if run_s > 0 else None},
        })
        return result

    def refusal(self, exc: Exception) -> Exception:
        """What a failure to build the release's configs or scheduler means. Raised inside
        vLLM (config validation, the CPU platform's checks): the release refuses this
        configuration, an input error (:class:`RefusedByRelease`, quoting vLLM). Raised in the
        lab: a lab error (:class:`AdapterError`)."""
        a = self.adapter
        tb = traceback.extract_tb(exc.__traceback__)
        innermost = tb[-1].filename if tb else ""
        first = " ".join(" ".join(str(exc).strip().splitlines()[:3]).split())
        # vLLM's config classes are pydantic dataclasses: their validators' errors come out
        # of pydantic as a ValidationError naming the vLLM config class
        refused_by_config = (type(exc).__name__ == "ValidationError"
                             and type(exc).__module__.startswith("pydantic"))
        if refused_by_config or vllm_frames(exc.__traceback__, a.vllm_file) and str(
                a.vllm_file.resolve()) in str(Path(innermost).resolve()):
            return RefusedByRelease(f"config: vLLM {a.version} refuses this configuration: "
                                    f"{type(exc).__name__}: {first}")
        return AdapterError(f"building vLLM {a.version}'s scheduler failed: "
                            f"{type(exc).__name__}: {first}")

    def _emit(self, line: dict) -> None:
        """Write one trace line, with the observer's fields (``annotate``) added."""
        annotate = getattr(self.observer, "annotate", None)
        if annotate is not None:
            annotate(line)
        self.trace(line)

    @staticmethod
    def _lab(fn, *args):
        """Run a lab-side step (the adapter, the fake runner): its failure is a lab error, never
        a vLLM crash."""
        try:
            return fn(*args)
        except (RefusedByRelease, AdapterError):
            raise
        except Exception as exc:
            raise AdapterError(f"{getattr(fn, '__qualname__', fn)}: {type(exc).__name__}: {exc}") from exc

    def _collect_finished(self) -> list[str]:
        newly = []
        live = self.scheduler.requests
        for rid, req in self.created.items():
            if rid not in self.finished and rid not in live:
                status = getattr(req, "status", None)
                self.finished[rid] = getattr(status, "name", str(status))
                newly.append(rid)
        return newly

    def _state(self, line: dict) -> None:
        try:
            waiting, running, preempted = self.adapter.queues(self.scheduler)
        except Exception as exc:  # noqa: BLE001 - after a crash the queues may be unreadable
            line["state_error"] = f"{type(exc).__name__}: {exc}"
            return
        line["waiting"] = waiting
        line["running"] = running
        line["preempted"] = preempted
        line["free_blocks"] = self.adapter.num_free_blocks(self.scheduler)


def run_scenario(adapter: V1Adapter, scenario: dict, out_dir: Path | None, observer=None) -> dict:
    """Run one scenario; write ``trace.jsonl`` and ``result.json`` into ``out_dir`` (if given).

    The result's ``outcome`` is ``clean``, ``crash``, ``violation``, ``stall`` or ``error``;
    ``error`` means the lab or the input failed (``error.kind``: ``input`` or ``lab``).
    """
    trace_f = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        trace_f = open(out_dir / "trace.jsonl", "w")

    def write(line: dict) -> None:
        if trace_f is not None:
            trace_f.write(json.dumps(line, default=str) + "\n")

    try:
        if scenario.get("level") == "engine-core":
            from .core_loop import EngineCoreLoop

            loop: StepLoop = EngineCoreLoop(adapter, scenario, write, observer)
        else:
            loop = StepLoop(adapter, scenario, write, observer)
        result = loop.run()
    except RefusedByRelease as exc:
        result = {"outcome": "error", "error": {"kind": "input", "message": str(exc)}}
    except AdapterError as exc:
        cause = exc.__cause__ or exc
        result = {"outcome": "error", "error": {
            "kind": "lab", "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))[-4000:]}}
    except Exception as exc:  # noqa: BLE001 - a bug in the lab itself: never a reproduction
        result = {"outcome": "error", "error": {
            "kind": "lab", "message": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:]}}
    finally:
        if trace_f is not None:
            trace_f.close()
    result["scenario"] = scenario["name"]
    result.setdefault("level", scenario.get("level", "scheduler"))
    result["vllm"] = adapter.version
    result["python"] = sys.version.split()[0]
    if out_dir is not None:
        (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result
