"""The lab's declared interfaces on the release side: what a level driver, a step-loop observer
and a fake worker promise (:class:`typing.Protocol`: checked by type checkers and by
``isinstance`` where marked ``runtime_checkable``; nothing inherits from them).

- :class:`LevelDriver`: one entry of :data:`vllm_repro.engine.run.LEVELS`, how a scenario
  ``level`` builds its loop (:class:`~vllm_repro.engine.loop.StepLoop`,
  :class:`~vllm_repro.engine.core_loop.EngineCoreLoop`, :class:`~vllm_repro.engine.v0.V0EngineLoop`).
- :class:`Observer`: what the step loops call around each vLLM call
  (:class:`vllm_repro.audit.Auditor`, :class:`vllm_repro.audit.v0.V0Auditor`,
  :class:`vllm_repro.audit.plant.WithPlant`).
- :class:`FakeWorker`: what the release's engine calls on the GPU worker the lab stands in for
  (:class:`vllm_repro.engine.fake_executor.FakeWorker` under the release's ``UniProcExecutor``,
  :class:`vllm_repro.engine.v0.FakeV0Worker` under its V0 GPU executor).

Runs inside release environments: standard library only.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from ..records import AuditSummary, RunResult, TraceLine, Violation


class LevelDriver(Protocol):
    """How one level runs a scenario: ``driver(adapter, level, scenario, write, observer,
    start) -> RunResult``.

    ``adapter``: the worker's adapter (:class:`~vllm_repro.engine.adapter.V1Adapter`, or the
    V0 adapter on a release without the V1 engine); ``level``: the scenario's level name;
    ``scenario``: the validated scenario; ``write``: called with each
    :class:`~vllm_repro.records.TraceLine`; ``observer``: an :class:`Observer` or None. The
    driver builds its loop (a :class:`~vllm_repro.engine.loop.StepLoop`) and returns
    ``start(loop)``, inside whatever scope the level needs (the V0 platform). Raises
    :class:`~vllm_repro.engine.adapter.LevelMissing` when the release has no such engine,
    :class:`~vllm_repro.engine.adapter.RefusedByRelease` for a configuration it refuses;
    anything else is a lab failure (``run_scenario`` turns it into outcome ``error``).
    """

    def __call__(self, adapter: Any, level: str, scenario: dict,
                 write: Callable[[TraceLine], None], observer: "Observer | None",
                 start: Callable[[Any], RunResult]) -> RunResult: ...


@runtime_checkable
class Observer(Protocol):
    """What a step loop calls around each vLLM call (the auditor's contract).

    Order, per run: ``attach(loop)`` once, after the scheduler (engine) is built; per step,
    ``after_schedule(step, scheduler_output, scheduled)`` after ``schedule()`` and
    ``after_update(step, scheduler_output, line)`` after ``update_from_output()`` (V0: after
    ``LLMEngine.step``), each returning True to stop the run (outcome ``violation``; the loop
    ends at once); ``annotate(line)`` just before each trace line is written (it may set
    ``line.audit`` and ``line.violations``); ``finish(loop, outcome)`` once at the end, whatever
    the outcome (``clean``, ``crash``, ``stall``, ``violation``, ``error``), returning True when
    it recorded any violation. ``violations`` (the records, in the order found) and
    ``summary()`` (``result.json``'s ``audit``) are read after ``finish``.

    ``stop_exception``: a ``BaseException`` subclass the observer may raise from inside a vLLM
    call (a hook caught a violation there); the loop catches it, ends the run with outcome
    ``violation`` and still calls ``finish``. An observer must not raise anything else; one
    that does is a lab bug (outcome ``error``, kind ``lab``). Level v0-engine also calls
    ``before_execute(step, execute_model_request)`` where the observer has it.
    """

    stop_exception: type[BaseException]
    violations: list[Violation]

    def attach(self, loop: Any) -> None: ...

    def after_schedule(self, step: int, so: Any, scheduled: Any) -> bool: ...

    def after_update(self, step: int, so: Any, line: TraceLine) -> bool: ...

    def annotate(self, line: TraceLine) -> None: ...

    def finish(self, loop: Any, outcome: str) -> bool: ...

    def summary(self) -> AuditSummary: ...


class FakeWorker(Protocol):
    """The GPU worker the lab stands in for, as the release's executor calls it: the fakes stop
    at what a GPU computes and reports (``vllm/v1/worker/gpu_worker.py:Worker``; V0:
    ``vllm/worker/worker.py:Worker``).

    ``execute_model(request)`` is called once per engine step with the release's own request
    (V1: ``SchedulerOutput``; V0: ``ExecuteModelRequest``) and answers what the model runner
    would (V1: a ``ModelRunnerOutput``, or None where the release splits sampling off into
    ``sample_tokens(grammar_output)``; V0: a list of ``SamplerOutput``), with the tokens the
    scenario scripts (:class:`~vllm_repro.engine.fake_runner.FakeModelRunner`). The start-up
    calls (V1: ``get_kv_cache_spec``, ``determine_available_memory``,
    ``initialize_from_config``; V0: ``determine_num_available_blocks``, ``initialize_cache``)
    answer from the scenario's sizes. It never re-implements vLLM's scheduling or KV logic;
    a call the release makes that the lab does not know is recorded (V1: ``unknown``), not
    guessed at.
    """

    def execute_model(self, request: Any, *args: Any, **kwargs: Any) -> Any: ...


__all__ = ["FakeWorker", "LevelDriver", "Observer"]
