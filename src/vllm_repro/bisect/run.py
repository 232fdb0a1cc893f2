"""The classifier :func:`~vllm_repro.bisect.search.bisect_releases` runs: one release through
the lab's own runner (:func:`vllm_repro.lab.run_pairs`), judged by the verdict module.

A release is ``bad`` when the verdict is ok with the release framed as a ``reproduces_on``
release (the scenario's ``expect`` observed, the lab's judgement for ``reproduces_on``),
``good`` when it is ok framed as a ``clean_on`` release, ``skip`` otherwise. The scenario's
own release lists are not consulted: each release is judged under both framings. The audit runs
as the lab runs it under each framing (:func:`vllm_repro.verdict.audit_keeps_going`); where
the two differ (an expected ``violation``: stop at the first, versus a clean verdict that needs
the whole run) the release is run a second time, framed as clean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal

from ..errors import IndexUnreachable, InputError
from ..scenario.schema import Scenario
from ..verdict import Verdict, audit_keeps_going, judge
from .search import BAD, GOOD, SKIP, Observation

Say = Callable[[str], None]


def default_endpoints(scenario, source: Path, bad: str | None, good: str | None) -> tuple[str, str]:
    """``--bad`` / ``--good`` as given, else the scenario's first concrete ``reproduces_on`` /
    ``clean_on`` release. Raises :class:`~vllm_repro.errors.InputError` when one is missing and
    the scenario names none, or a value is not a version number."""
    from packaging.version import InvalidVersion, Version

    from ..sources.sdist import validate_version

    def first(entries: list[str]) -> str | None:
        for e in entries:
            try:
                Version(e)
                return e
            except InvalidVersion:
                continue
        return None

    bad = bad if bad is not None else first(scenario.vllm.reproduces_on)
    good = good if good is not None else first(scenario.vllm.clean_on)
    if bad is None:
        raise InputError(f"{source}: vllm.reproduces_on names no release to start from; add one "
                         "(e.g. reproduces_on: [\"0.10.1.1\"]) or pass --bad VERSION")
    if good is None:
        raise InputError(f"{source}: vllm.clean_on names no release to start from; add one "
                         "(e.g. clean_on: [\"0.10.2\"]) or pass --good VERSION")
    return validate_version(bad), validate_version(good)


def require_expectation(scenario: Scenario, source: str | Path) -> None:
    """Raises :class:`InputError` when the scenario gives nothing to tell a bad release from a
    good one: no ``expect``, or ``expect.outcome: clean``."""
    if scenario.expect is None:
        raise InputError(f"{source}: expect: missing; bisect tells a bad release by the scenario's "
                         "expected reproduction: add expect: {outcome: crash|violation|stall, ...}")
    if scenario.expect.outcome == "clean":
        raise InputError(f"{source}: expect.outcome: clean cannot tell a bad release from a good "
                         "one; give the outcome the buggy releases show (crash, violation or stall)")


def framed(scenario: Scenario, version: str, kind: Literal["reproduce", "clean"]) -> Scenario:
    """A copy of ``scenario`` whose only release is ``version``, listed under ``reproduces_on``
    (kind ``reproduce``) or ``clean_on`` (kind ``clean``): the verdict module then judges that
    release as the lab judges those lists."""
    refs = scenario.vllm.model_copy(update={"reproduces_on": [version] if kind == "reproduce" else [],
                                            "clean_on": [version] if kind == "clean" else []})
    return scenario.model_copy(update={"vllm": refs})


class ReleaseClassifier:
    """Classifies one release at a time by running ``scenario`` on it (a callable for
    :func:`~vllm_repro.bisect.search.bisect_releases`). Reports go to
    ``reports/<scenario>/<version>/`` as for ``vllm-repro run``; ``result.json`` carries the
    verdict that decided. Raises :class:`IndexUnreachable` (exit code 3) when a release could not
    be fetched because the index did not answer; any other lab or input error on a release makes
    it ``skip``.
    """

    #: whether each run goes to its end past an audit finding (``DiffClassifier``'s runs do)
    keep_going = False

    def __init__(self, scenario: Scenario, reports: Path, say: Say = lambda s: None,
                 tree: str | None = None):
        if not self.keep_going:
            require_expectation(scenario, scenario.name)
        self.scenario = scenario
        self.reports = reports
        self.say = say
        self.tree = tree
        self._unreachable: IndexUnreachable | None = None

    def _prepare(self, version: str):
        from ..sources.prepare import prepare_release, resolve_tree

        try:
            # the tree that serves the scenario's level (auto: a slice proven at it, else the
            # full tree: a v0-engine scenario on 0.10.2 ran on its V1-only slice before)
            kind = resolve_tree(version, self.tree, self.scenario.level)
            return prepare_release(version, self.say, tree=kind)
        except IndexUnreachable as exc:
            self._unreachable = exc  # run_pairs turns it into an error row; stop instead
            raise

    def _run(self, scenario: Scenario, version: str):
        from ..lab import RunItem, run_pairs

        item = RunItem(scenario, version)
        self._unreachable = None
        run_pairs([item], self.reports, keep_going=self.keep_going, jobs=1, say=self.say,
                   prepare=self._prepare)
        if self._unreachable is not None:
            raise self._unreachable
        return item

    def __call__(self, version: str) -> Observation:
        as_bad = framed(self.scenario, version, "reproduce")
        item = self._run(as_bad, version)
        bad = item.verdict
        if bad.outcome == "error":
            return Observation(SKIP, bad.observed, error_kind=bad.error_kind)
        if bad.ok:
            return Observation(BAD, bad.observed)
        as_good = framed(self.scenario, version, "clean")
        if audit_keeps_going(as_good, version) == audit_keeps_going(as_bad, version):
            good = judge(as_good, version, item.result)  # the same run, judged as clean_on
            _record_verdict(item, good)
        else:
            good = self._run(as_good, version).verdict
        if good.ok:
            return Observation(GOOD, good.observed)
        return Observation(SKIP, bad.observed, reason=f"not the expected reproduction: {bad.reason}; "
                                                      f"not clean: {good.reason}",
                           error_kind=good.error_kind)


class DiffClassifier(ReleaseClassifier):
    """``bisect --on diff``: classifies a release by the scheduler's decisions instead of the
    scenario's expectation. The scenario runs on the ``reference`` release once (its trace kept)
    and on each release asked; a release is ``good`` when no step's decisions differ from the
    reference's (:func:`vllm_repro.diff.first_difference`: scheduled tokens, preemptions,
    finished requests, free KV blocks, a crash), ``bad`` when one does (its ``observed`` names
    the step and the fields), ``skip`` when the run is a lab or input error. Each run goes to its
    end, as ``vllm-repro diff`` runs it (an audit finding does not stop it). Raises
    :class:`~vllm_repro.errors.InputError` when the reference itself does not run."""

    keep_going = True  # no expectation needed either

    def __init__(self, scenario: Scenario, reference: str, reports: Path,
                 say: Say = lambda s: None, tree: str | None = None):
        super().__init__(scenario, reports, say, tree)
        self.reference = reference
        self._reference_trace = None

    def _trace(self, version: str):
        from ..records import ReportDir, read_trace

        item = self._run(self.scenario, version)
        if item.result.outcome == "error":
            return item, None
        path = item.report.path / ReportDir.TRACE
        return item, read_trace(path) if path.is_file() else []

    def __call__(self, version: str) -> Observation:
        from ..diff import first_difference

        if self._reference_trace is None:
            item, trace = self._trace(self.reference)
            if trace is None:
                raise InputError(f"bisect --on diff: the reference release {self.reference} did "
                                 f"not run the scenario ({item.verdict.observed}); give --good a "
                                 "release it runs on")
            self._reference_trace = trace
        if version == self.reference:
            return Observation(GOOD, "the reference release")
        item, trace = self._trace(version)
        if trace is None:
            return Observation(SKIP, item.verdict.observed, error_kind=item.verdict.error_kind)
        step, fields = first_difference(self._reference_trace, trace)
        if step is None:
            return Observation(GOOD, f"the same decisions as {self.reference} at every step")
        return Observation(BAD, f"differs from {self.reference} at step {step} "
                                f"({', '.join(fields)})")


def classify_task(arg: dict) -> Observation:
    """One release classified where the executor put this task (``bisect --ray``): ``arg``
    ``{"scenario": Scenario, "release", "reports": absolute path}``; reports are written there
    (on a cluster: a folder the nodes share)."""
    return ReleaseClassifier(arg["scenario"], Path(arg["reports"]))(arg["release"])


def classify_on(executor, scenario: Scenario, reports: Path) -> Callable[[list[str]], dict[str, Observation]]:
    """``releases -> observations``, each release one task on ``executor``
    (:mod:`vllm_repro.task_executor`), for :func:`~vllm_repro.bisect.search.bisect_releases`'s
    ``classify_many``. A task that raised (the index unreachable, its process or node died) is
    an :class:`~vllm_repro.errors.EnvError` naming the release: exit 3, as without Ray."""
    from ..errors import EnvError

    def many(releases: list[str]) -> dict[str, Observation]:
        args = [{"scenario": scenario, "release": r, "reports": str(reports.resolve())}
                for r in releases]
        out = {}
        for i, outcome in executor.run(classify_task, args):
            if outcome.error is not None:
                raise EnvError(f"bisect: vLLM {releases[i]} could not be classified: "
                               f"{outcome.error.splitlines()[0]}")
            out[releases[i]] = outcome.value
        return out

    return many


def _record_verdict(item, verdict: Verdict) -> None:
    """Put ``verdict`` (the one that decided the release) into the run's ``result.json``,
    through its :class:`~vllm_repro.records.ReportDir`."""
    if item.report is None or not item.report.exists():
        return
    item.result.verdict = verdict.as_dict()
    item.report.write_result(item.result)
