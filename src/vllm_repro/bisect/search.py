"""The release bisection itself, apart from running anything: which releases lie between two
endpoints on the index, and the binary search over them with a classifier.

A classifier says of one release ``bad`` (the scenario's expected reproduction is observed),
``good`` (clean) or ``skip`` (anything else: an input or environment error, a different
failure). Both directions are searched the same way: between the older endpoint's state and the
newer one's, the first release in the newer state is the answer, ``first bad release`` for a
regression (good older than bad), ``first fixed release`` for a fix (bad older than good).
Skipped releases are stepped around as ``git bisect skip`` does; when only skipped releases
are left between the last old-state and the first new-state release, the boundary is reported
as lying between those two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from packaging.version import InvalidVersion, Version

from ..errors import EnvError, InputError
from ..sources.index import release_version

BAD, GOOD, SKIP = "bad", "good", "skip"
State = Literal["bad", "good", "skip"]


@dataclass(frozen=True)
class Observation:
    """What one release showed: its ``state`` (bad, good or skip), the verdict table's
    ``observed`` text, why it is neither bad nor good (``reason``, for skip), and
    ``error_kind`` (``input``, ``lab`` or ``env``) when the input, the lab or the environment
    failed on it."""

    state: State
    observed: str
    reason: str = ""
    error_kind: str | None = None


Classifier = Callable[[str], Observation]


@dataclass
class BisectResult:
    """The outcome of :func:`bisect_releases`.

    ``span``: the releases between the endpoints, oldest first, endpoints included.
    ``tested``: release -> observation, in the order they were run. ``last_old`` is the newest
    release seen in the older endpoint's state, ``first_new`` the oldest seen in the newer one's;
    ``skipped_between`` the skipped releases between them (empty when the boundary is pinned).
    """

    bad: str
    good: str
    span: list[str]
    tested: dict[str, Observation] = field(default_factory=dict)
    last_old: str = ""
    first_new: str = ""
    skipped_between: list[str] = field(default_factory=list)

    @property
    def direction(self) -> Literal["regression", "fix"]:
        """``regression`` when the good endpoint is the older one, else ``fix``."""
        return "regression" if Version(self.good) < Version(self.bad) else "fix"

    @property
    def pinned(self) -> bool:
        return not self.skipped_between

    def summary(self) -> str:
        """The one result line, e.g. ``first fixed release: 0.10.2 (last bad: 0.10.1.1); 3 of 6
        releases run``; when skips leave the boundary open, the releases it may be and the two it
        lies between: ``first fixed release: not pinned, one of 0.10.1, 0.10.2 (last bad: 0.10.0;
        first good: 0.10.2; skipped between them: 0.10.1); 3 of 3 releases run``."""
        what, old_word, new_word = (("first bad release", "good", "bad") if self.direction == "regression"
                                    else ("first fixed release", "bad", "good"))
        count = f"{len(self.tested)} of {len(self.span)} releases run"
        if self.pinned:
            return f"{what}: {self.first_new} (last {old_word}: {self.last_old}); {count}"
        return (f"{what}: not pinned, one of {', '.join([*self.skipped_between, self.first_new])} "
                f"(last {old_word}: {self.last_old}; first {new_word}: {self.first_new}; skipped "
                f"between them: {', '.join(self.skipped_between)}); {count}")


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _index_name(flag: str, version: str, index: dict[str, dict]) -> str:
    """``version`` as the index spells it (``0.10.2.0`` -> ``0.10.2``). Raises
    :class:`InputError` naming the nearest releases when the index does not have it."""
    if version in index:
        return version
    want = _version(version)
    if want is None:
        raise InputError(f"{flag} {version!r} is not a vLLM version number (e.g. 0.10.1.1)")
    for name in index:
        if _version(name) == want:
            return name
    ordered = sorted((v for v in index if _version(v) is not None), key=Version)
    older = [v for v in ordered if Version(v) < want][-1:]
    newer = [v for v in ordered if Version(v) > want][:1]
    near = ", ".join(older + newer)
    from ..sources.index import LIST_RELEASES

    raise InputError(f"{flag} {version}: vLLM {version} is not a release on the index"
                     + (f"; nearest releases: {near}" if near else "") + f" ({LIST_RELEASES})")


def release_span(index: dict[str, dict], bad: str, good: str) -> tuple[str, str, list[str]]:
    """``(bad, good, span)``: both endpoints as the index spells them and every release from the
    older endpoint to the newer one, oldest first (``packaging.version`` order).

    ``index`` is :func:`vllm_repro.sources.index.list_releases`'s ``{version: file dict}``.
    Between the endpoints only releases count as
    :func:`~vllm_repro.sources.index.release_version` says, the rule ``matrix`` and ``campaign``
    share (no pre-, dev- or local part, not yanked; post releases kept); the endpoints themselves are taken as
    given. Raises :class:`InputError` for an endpoint the index does not have or two endpoints
    that are the same release.
    """
    bad = _index_name("--bad", bad, index)
    good = _index_name("--good", good, index)
    if Version(bad) == Version(good):
        raise InputError(f"--bad and --good are both {bad}; give two different releases")
    lo, hi = sorted((Version(bad), Version(good)))
    between = []
    for name, f in index.items():
        v = release_version(name, bool(f.get("yanked")))
        if v is None or not lo < v < hi:
            continue
        between.append(name)
    older, newer = (bad, good) if Version(bad) < Version(good) else (good, bad)
    return bad, good, [older, *sorted(between, key=Version), newer]


def _endpoint_error(flag: str, release: str, want: State, obs: Observation) -> Exception:
    """The one-line error for an endpoint that does not show its state."""
    if obs.error_kind == "env":
        return EnvError(f"{flag} {release}: the endpoint could not be checked, the environment "
                        f"failed: {obs.observed}")
    if obs.error_kind == "lab":  # the lab failed on it (exit 3): nothing said of the release
        return EnvError(f"{flag} {release}: the endpoint could not be checked, the lab failed: "
                        f"{obs.observed}")
    if want == BAD:
        claim = "does not reproduce the scenario's expected bug"
        claim = f"runs clean, it {claim}" if obs.state == GOOD else claim
        fix = "pass --bad a release that reproduces it"
    else:
        claim = "does not run clean"
        claim = f"reproduces the bug, it {claim}" if obs.state == BAD else claim
        fix = "pass --good a release where it runs clean"
    why = f" ({obs.reason})" if obs.reason else ""
    return InputError(f"{flag} {release} {claim}: observed {obs.observed}{why}; {fix}")


def bisect_releases(span: list[str], bad: str, good: str, classify: Classifier,
                    say: Callable[[str], None] = lambda s: None, *,
                    classify_many: Callable[[list[str]], dict[str, Observation]] | None = None,
                    width: int = 1) -> BisectResult:
    """Binary search ``span`` (oldest first, the endpoints at both ends) for the boundary
    between ``bad`` and ``good``, running ``classify`` on as few releases as it can.

    The endpoints are classified first, ``bad`` then ``good``: ``bad`` must come out bad and
    ``good`` good. Then the release nearest the middle of the open interval that has not been
    skipped is classified, and the interval narrowed, until no unskipped release is left in it.

    With ``width`` > 1 and ``classify_many`` (releases -> observations, run at once: the
    ``--ray`` back end), each round classifies up to ``width`` releases spread evenly over the
    open interval (both endpoints together in the first), and narrows to the first release in
    the newer state and the last in the older state before it: fewer rounds, more releases run.

    Raises :class:`InputError` when an endpoint does not show its state (exit code 2) and
    :class:`EnvError` when its environment failed (exit code 3); whatever ``classify`` raises
    passes through.
    """
    if bad not in (span[0], span[-1]) or good not in (span[0], span[-1]) or bad == good:
        raise ValueError("bad and good must be the two ends of span")
    wide = width > 1 and classify_many is not None
    result = BisectResult(bad, good, list(span))
    if wide:
        say(f"bisect: checking --bad {bad} and --good {good}")
        result.tested.update(classify_many([bad, good]))
    for flag, release, want in (("--bad", bad, BAD), ("--good", good, GOOD)):
        if not wide:
            say(f"bisect: checking {flag} {release}")
            result.tested[release] = classify(release)
        obs = result.tested[release]
        if obs.state != want:
            raise _endpoint_error(flag, release, want, obs)
    old_state = result.tested[span[0]].state
    lo, hi = 0, len(span) - 1
    skipped: set[int] = set()
    while True:
        left = [i for i in range(lo + 1, hi) if i not in skipped]
        if not left:
            break
        if not wide:
            middle = (lo + hi) / 2
            i = min(left, key=lambda j: (abs(j - middle), j))
            say(f"bisect: {span[i]} ({len(left)} release(s) left between {span[lo]} and {span[hi]})")
            obs = result.tested[span[i]] = classify(span[i])
            if obs.state == SKIP:
                skipped.add(i)
            elif obs.state == old_state:
                lo = i
            else:
                hi = i
            continue
        k = min(width, len(left))
        picks = sorted({left[(n + 1) * len(left) // (k + 1)] for n in range(k)})
        say(f"bisect: {', '.join(span[i] for i in picks)} at once ({len(left)} release(s) left "
            f"between {span[lo]} and {span[hi]})")
        got = classify_many([span[i] for i in picks])
        for i in picks:
            result.tested[span[i]] = got[span[i]]
        skipped |= {i for i in picks if got[span[i]].state == SKIP}
        newer = [i for i in picks if got[span[i]].state not in (SKIP, old_state)]
        hi = min(newer, default=hi)
        lo = max([i for i in picks if got[span[i]].state == old_state and i < hi], default=lo)
    result.last_old, result.first_new = span[lo], span[hi]
    result.skipped_between = [span[i] for i in range(lo + 1, hi)]
    return result
