"""A scenario's events on the release side: one dataclass per action, and the one dispatch
every level loop uses.

The host validates ``events:`` with the pydantic schema (``scenario/schema.py:Event``, the
user-facing format, unchanged) and sends each event as a mapping with every field
(``child_payload``); :func:`from_mapping` turns it into the event's class here. The loops never
read an event's fields by key: :func:`perform` calls the level loop's own method for the event's
action (``do_abort``, ``do_reset_prefix_cache``, ...), and :func:`refusal` says, before the run,
why a release cannot perform it (the :class:`~vllm_repro.engine.capabilities.Capabilities`'
``events`` names each event kind needs). A level that has no ``do_<action>`` does not support
that kind (:func:`supported`).

Adding an event: a dataclass here (its ``action``, fields and ``capability``), its field in
the schema's ``Event``, a ``do_<action>(event, line)`` method on each level loop that supports
it, its docs (docs/architecture.md, "Adding an event").

Runs inside release environments: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..records import TraceLine


@dataclass(frozen=True)
class Event:
    """One event: done at step ``at_step`` (before that step's ``schedule()``, unless the event
    says otherwise). ``action``: the key of the scenario's event mapping that names it, and the
    suffix of the level loop's method (``do_<action>``). ``capability``: the name in
    ``Capabilities.events`` the release must have (None: every release can), ``call`` the
    EngineCore method it names in a refusal."""

    at_step: int

    action: ClassVar[str] = ""
    capability: ClassVar[str | None] = None
    call: ClassVar[str] = ""

    def where(self, field: str | None = None) -> str:
        """``events[at_step N].FIELD``: how a refusal names the event."""
        return f"events[at_step {self.at_step}].{field or self.action}"

    def field_refusals(self, caps_events, version: str) -> str | None:
        """A refusal for an optional field the release cannot take (None: none)."""
        return None


@dataclass(frozen=True)
class Abort(Event):
    """``abort: [ids]`` (``EngineCore.abort_requests``): ``when`` ``before_step`` (just before
    the step) or ``in_flight`` (``level: engine-core``: while the step's batch executes, as the
    engine's input thread delivers it)."""

    ids: tuple[str, ...] = ()
    when: str = "before_step"

    action: ClassVar[str] = "abort"


@dataclass(frozen=True)
class ResetPrefixCache(Event):
    """``reset_prefix_cache: true`` (``EngineCore.reset_prefix_cache``), with
    ``reset_running_requests`` and ``reset_connector`` (the KV connector's cache too) where the
    release takes them."""

    reset_running_requests: bool = False
    reset_connector: bool = False

    action: ClassVar[str] = "reset_prefix_cache"
    capability: ClassVar[str | None] = "reset_prefix_cache"
    call: ClassVar[str] = "reset_prefix_cache"

    def field_refusals(self, caps_events, version: str) -> str | None:
        if self.reset_running_requests and "reset_running_requests" not in caps_events:
            return (f"{self.where('reset_running_requests')}: vLLM {version}'s "
                    "reset_prefix_cache() does not take it; drop it for this release")
        if self.reset_connector and "reset_connector" not in caps_events:
            return (f"{self.where('reset_connector')}: vLLM {version}'s reset_prefix_cache() "
                    "does not take it (no connector cache reset); drop it for this release")
        return None


@dataclass(frozen=True)
class Pause(Event):
    """``pause: true`` (``EngineCore.pause_scheduler``), ``mode`` handed to it where the
    release takes one (None: the release's default)."""

    mode: str | None = None

    action: ClassVar[str] = "pause"
    capability: ClassVar[str | None] = "pause"
    call: ClassVar[str] = "pause_scheduler"

    def field_refusals(self, caps_events, version: str) -> str | None:
        if self.mode and "pause_mode" not in caps_events:
            return (f"{self.where('mode')}: vLLM {version}'s pause_scheduler() takes no mode (it "
                    "pauses without aborting); drop mode for this release")
        return None


@dataclass(frozen=True)
class Resume(Event):
    """``resume: true`` (``EngineCore.resume_scheduler``)."""

    action: ClassVar[str] = "resume"
    capability: ClassVar[str | None] = "resume"
    call: ClassVar[str] = "resume_scheduler"


@dataclass(frozen=True)
class FaultSpec:
    """What a rank fault does (``scenario/schema.py:RankFault``): ``kind`` ``hang`` / ``late``
    (sleep ``seconds``), ``raise``, ``exit`` (with ``exit_code``), in global rank ``rank``, on
    the first ``execute_model`` after the event's step or on the run's ``on_execute_model``-th."""

    rank: int
    kind: str
    seconds: float = 60.0
    exit_code: int = 1
    on_execute_model: int | None = None


@dataclass(frozen=True)
class InjectFault(Event):
    """``fault: {...}``: a fault armed in a rank process (``distributed_executor_backend:
    mp``, :mod:`vllm_repro.engine.ranks`)."""

    fault: FaultSpec | None = None

    action: ClassVar[str] = "fault"


#: every event class, by its action (the key of the scenario's mapping that names it)
EVENT_TYPES: dict[str, type[Event]] = {
    cls.action: cls for cls in (Abort, ResetPrefixCache, Pause, Resume, InjectFault)}


def from_mapping(e: dict) -> Event:
    """The event the host's mapping (``Scenario.child_payload()``'s ``events[i]``, every field
    present or left out) describes. Raises :class:`ValueError` for a mapping with no action."""
    at = int(e["at_step"])
    if e.get("abort"):
        return Abort(at, tuple(e["abort"]), e.get("when") or "before_step")
    if e.get("reset_prefix_cache"):
        return ResetPrefixCache(at, bool(e.get("reset_running_requests")),
                                bool(e.get("reset_connector")))
    if e.get("pause"):
        return Pause(at, e.get("mode"))
    if e.get("fault"):
        f = e["fault"]
        return InjectFault(at, FaultSpec(f["rank"], f["kind"], float(f.get("seconds", 60.0)),
                                         f.get("exit_code", 1), f.get("on_execute_model")))
    if e.get("resume"):
        return Resume(at)
    raise ValueError(f"events[at_step {at}]: no action (one of {', '.join(EVENT_TYPES)})")


def by_step(events: list[dict] | None) -> dict[int, list[Event]]:
    """The scenario's events by step, in the scenario's order within a step."""
    out: dict[int, list[Event]] = {}
    for e in events or ():
        ev = from_mapping(e)
        out.setdefault(ev.at_step, []).append(ev)
    return out


def supported(loop: Any, event: Event) -> bool:
    """Whether ``loop``'s level performs ``event``'s kind (it has ``do_<action>``)."""
    return callable(getattr(loop, "do_" + event.action, None))


def refusal(event: Event, caps_events, version: str) -> str | None:
    """Why release ``version`` (whose ``Capabilities.events`` are ``caps_events``) cannot
    perform ``event``, or None."""
    if event.capability is not None and event.capability not in caps_events:
        return (f"{event.where()}: vLLM {version}'s EngineCore has no {event.call}(); drop the "
                "event for this release")
    return event.field_refusals(caps_events, version)


def perform(loop: Any, event: Event, line: TraceLine) -> None:
    """Perform ``event`` the level's way: ``loop.do_<action>(event, line)``, which records what
    it did on ``line``. Raises :class:`AttributeError` for a kind the level does not support
    (the loops refuse those before the run: :func:`supported`)."""
    getattr(loop, "do_" + event.action)(event, line)


__all__ = ["Abort", "Event", "EVENT_TYPES", "FaultSpec", "InjectFault", "Pause", "ResetPrefixCache",
           "Resume", "by_step", "from_mapping", "perform", "refusal", "supported"]
