"""``vllm-repro bisect``, the search itself: the release range from the index's list and the
binary search with a fake classifier (ordering, skips, both directions, endpoint checks)."""

from __future__ import annotations

import math

import pytest

from vllm_repro.bisect.search import (BAD, GOOD, SKIP, Observation, bisect_releases,
                                      release_span)
from vllm_repro.errors import EnvError, IndexUnreachable, InputError

INDEX = {v: {"filename": f"vllm-{v}.tar.gz"} for v in (
    "0.10.2", "0.9.2", "0.10.1.1", "0.10.0", "0.10.1", "0.9.1", "0.11.0", "0.10.2rc1",
    "0.10.1.dev3", "0.9.0.1", "0.8.5.post1", "0.8.5", "0.9.0")}
INDEX["0.9.1"] = {"filename": "vllm-0.9.1.tar.gz", "yanked": "broken wheels"}


class Fake:
    """A classifier from a table {release: state}; records what it was asked, in order."""

    def __init__(self, states: dict[str, str]):
        self.states = states
        self.asked: list[str] = []

    def __call__(self, release: str) -> Observation:
        self.asked.append(release)
        state = self.states[release]
        return Observation(state, {"bad": "crash AssertionError @3", "good": "clean (2 finished)",
                                   "skip": "error: no priority"}[state],
                           error_kind="input" if state == SKIP else None)


# -- the range of releases ---------------------------------------------------------------------

def test_span_is_packaging_ordered_final_and_unyanked_between_the_endpoints():
    bad, good, span = release_span(INDEX, "0.10.0", "0.10.2")
    assert (bad, good) == ("0.10.0", "0.10.2")
    assert span == ["0.10.0", "0.10.1", "0.10.1.1", "0.10.2"]  # no 0.10.1.dev3, no 0.10.2rc1
    _, _, span = release_span(INDEX, "0.11.0", "0.8.5")  # either endpoint may be the older
    assert span == ["0.8.5", "0.8.5.post1", "0.9.0", "0.9.0.1", "0.9.2", "0.10.0", "0.10.1",
                    "0.10.1.1", "0.10.2", "0.11.0"]  # post-releases kept, yanked 0.9.1 left out


def test_span_endpoints_as_the_index_spells_them_and_refused_when_unknown_or_equal():
    assert release_span(INDEX, "0.10.0.0", "0.10.2")[0] == "0.10.0"
    with pytest.raises(InputError, match=r"--good 0\.10\.3: vLLM 0\.10\.3 is not a release on the "
                                         r"index; nearest releases: 0\.10\.2, 0\.11\.0"):
        release_span(INDEX, "0.10.0", "0.10.3")
    with pytest.raises(InputError, match="--bad and --good are both 0.10.2"):
        release_span(INDEX, "0.10.2", "0.10.2.0")


# -- the search ----------------------------------------------------------------------------------

SPAN = ["0.9.0", "0.9.0.1", "0.9.2", "0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0"]


def test_fix_direction_bad_older_than_good_finds_the_first_fixed_release():
    fake = Fake({v: (BAD if i < 6 else GOOD) for i, v in enumerate(SPAN)})  # fixed in 0.10.2
    res = bisect_releases(SPAN, "0.9.0", "0.11.0", fake)
    assert fake.asked[:2] == ["0.9.0", "0.11.0"], "the endpoints are checked first, bad first"
    assert (res.direction, res.first_new, res.last_old, res.pinned) == ("fix", "0.10.2", "0.10.1.1", True)
    assert len(fake.asked) == len(set(fake.asked)) <= 2 + math.ceil(math.log2(len(SPAN) - 1))
    assert list(res.tested) == fake.asked
    assert res.summary() == (f"first fixed release: 0.10.2 (last bad: 0.10.1.1); "
                             f"{len(fake.asked)} of 8 releases run")


def test_regression_direction_good_older_than_bad_finds_the_first_bad_release():
    fake = Fake({v: GOOD for v in SPAN[:2]} | {v: BAD for v in SPAN[2:]})
    res = bisect_releases(SPAN, "0.11.0", "0.9.0", fake)  # --bad 0.11.0 --good 0.9.0
    assert fake.asked[:2] == ["0.11.0", "0.9.0"]
    assert (res.direction, res.first_new, res.last_old) == ("regression", "0.9.2", "0.9.0.1")
    assert res.summary().startswith("first bad release: 0.9.2 (last good: 0.9.0.1); ")


@pytest.mark.parametrize("first_bad", range(1, len(SPAN)))
def test_every_boundary_is_found_in_both_directions(first_bad):
    regression = Fake({v: (GOOD if i < first_bad else BAD) for i, v in enumerate(SPAN)})
    res = bisect_releases(SPAN, SPAN[-1], SPAN[0], regression)
    assert (res.last_old, res.first_new) == (SPAN[first_bad - 1], SPAN[first_bad])
    fix = Fake({v: (BAD if i < first_bad else GOOD) for i, v in enumerate(SPAN)})
    res = bisect_releases(SPAN, SPAN[0], SPAN[-1], fix)
    assert (res.last_old, res.first_new) == (SPAN[first_bad - 1], SPAN[first_bad])


def test_a_skipped_release_is_stepped_around_and_the_boundary_still_pinned():
    states = {v: (BAD if i < 6 else GOOD) for i, v in enumerate(SPAN)}  # first fixed: 0.10.2
    states["0.10.0"] = SKIP  # the middle one: the next nearest is run instead
    fake = Fake(states)
    res = bisect_releases(SPAN, "0.9.0", "0.11.0", fake)
    assert fake.asked[2] == "0.10.0" and fake.asked[3] in ("0.9.2", "0.10.1")
    assert (res.first_new, res.last_old, res.pinned) == ("0.10.2", "0.10.1.1", True)
    assert res.tested["0.10.0"].state == SKIP


def test_skips_next_to_the_boundary_leave_it_between_two_releases():
    states = {v: (BAD if i < 6 else GOOD) for i, v in enumerate(SPAN)}
    states["0.10.1"] = states["0.10.1.1"] = SKIP  # e.g. refused with exit 2
    fake = Fake(states)
    res = bisect_releases(SPAN, "0.9.0", "0.11.0", fake)
    assert (res.last_old, res.first_new, res.skipped_between) == ("0.10.0", "0.10.2",
                                                                 ["0.10.1", "0.10.1.1"])
    assert not res.pinned
    assert res.summary() == (
        "first fixed release: not pinned, one of 0.10.1, 0.10.1.1, 0.10.2 (last bad: 0.10.0; first "
        f"good: 0.10.2; skipped between them: 0.10.1, 0.10.1.1); {len(fake.asked)} of 8 releases run")


def test_adjacent_endpoints_run_only_the_endpoints():
    fake = Fake({"0.10.1.1": BAD, "0.10.2": GOOD})
    res = bisect_releases(["0.10.1.1", "0.10.2"], "0.10.1.1", "0.10.2", fake)
    assert res.summary() == "first fixed release: 0.10.2 (last bad: 0.10.1.1); 2 of 2 releases run"


def test_endpoint_that_does_not_show_its_state_is_an_input_error_naming_what_was_observed():
    fake = Fake({v: GOOD for v in SPAN})
    with pytest.raises(InputError, match=r"^--bad 0\.9\.0 runs clean, it does not reproduce the "
                                         r"scenario's expected bug: observed clean \(2 finished\); "
                                         "pass --bad a release that reproduces it$"):
        bisect_releases(SPAN, "0.9.0", "0.11.0", fake)
    assert fake.asked == ["0.9.0"], "nothing else is run once an endpoint fails"
    fake = Fake({v: BAD for v in SPAN})
    with pytest.raises(InputError, match=r"^--good 0\.11\.0 reproduces the bug, it does not run "
                                         r"clean: observed crash AssertionError @3; pass --good a "
                                         "release where it runs clean$"):
        bisect_releases(SPAN, "0.9.0", "0.11.0", fake)
    assert fake.asked == ["0.9.0", "0.11.0"]
    fake = Fake({v: (SKIP if v == "0.11.0" else BAD) for v in SPAN})  # refused there (exit 2)
    with pytest.raises(InputError, match=r"^--good 0\.11\.0 does not run clean: observed error: no "
                                         r"priority; pass --good"):
        bisect_releases(SPAN, "0.9.0", "0.11.0", fake)


@pytest.mark.parametrize("kind, observed, said", [
    ("env", "error: uv pip install failed", "environment failed: error: uv pip install failed"),
    # a lab failure (a run that left a slice: exit 3) says nothing of the release; it read
    # "--good 0.10.2 does not run clean ... pass --good a release where it runs clean", exit 2
    ("lab", "error: the run left the slice of vLLM 0.11.0", "lab failed: error: the run left the slice"),
])
def test_endpoint_the_environment_or_the_lab_failed_on_is_exit_3_not_an_input_error(kind, observed, said):
    def classify(release):
        if release == "0.11.0":
            return Observation(SKIP, observed, error_kind=kind)
        return Observation(BAD, "crash")

    with pytest.raises(EnvError, match=r"--good 0\.11\.0: the endpoint could not be checked, the "
                                       + said):
        bisect_releases(SPAN, "0.9.0", "0.11.0", classify)


def test_classifier_exceptions_pass_through():
    def classify(release):
        raise IndexUnreachable("the package index is unreachable: GET x failed: refused")

    with pytest.raises(IndexUnreachable):
        bisect_releases(SPAN, "0.9.0", "0.11.0", classify)


# -- rounds of several releases at once (bisect --ray) -------------------------------------------

@pytest.mark.parametrize("width", [2, 3, 5])
@pytest.mark.parametrize("boundary", range(1, len(SPAN)))
def test_wide_rounds_find_the_same_boundary_in_fewer_rounds(width, boundary):
    states = {r: BAD if i < boundary else GOOD for i, r in enumerate(SPAN)}
    states["0.10.0"] = SKIP if boundary not in (3, 4) else states["0.10.0"]
    narrow = bisect_releases(SPAN, SPAN[0], SPAN[-1], Fake(states))
    fake, rounds = Fake(states), []

    def many(releases):
        rounds.append(list(releases))
        return {r: fake(r) for r in releases}

    wide = bisect_releases(SPAN, SPAN[0], SPAN[-1], fake, classify_many=many, width=width)
    assert (wide.last_old, wide.first_new, wide.skipped_between) == (
        narrow.last_old, narrow.first_new, narrow.skipped_between)
    assert rounds[0] == [SPAN[0], SPAN[-1]] and all(len(r) <= width for r in rounds[1:])
    assert len(rounds) - 1 <= math.ceil(math.log(len(SPAN), width + 1)) + 2
