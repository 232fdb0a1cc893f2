"""``expect.mechanism``: a scenario names which of a code's ways its bug takes (the fuzz
signature's ``violation:CODE/mechanism``), and the fuzzer's written reproducer carries it, so the
scenario it saves re-matches that finding and not the code's other way."""

from __future__ import annotations

import textwrap

import pytest

from vllm_repro.errors import InputError
from vllm_repro.fuzz.search import Finding, signature, write_finding
from vllm_repro.scenario import load_scenario
from vllm_repro.verdict import judge

from .builders import make_result, make_violation

FOUND = {"level": "v0-engine",
         "config": {"block_size": 16, "num_gpu_blocks": 32, "num_cpu_blocks": 0,
                    "enable_prefix_caching": True, "max_model_len": 256},
         "requests": [{"id": "R0", "prompt_len": 32, "max_tokens": 4},
                      {"id": "R1", "prompt_len": 32, "max_tokens": 4, "at_step": 3}]}


def prefix_map(mechanism: str, step: int = 12):
    v = make_violation("KV_PREFIX_MAP", step, "R1 skips block 5 as cached: not a prefix-cache "
                       "hit on these tokens: a fresh block counted as cached", requests=("R1",),
                       blocks=(5,))
    v.mechanism = mechanism
    return make_result("violation", violations=[v.to_dict()], steps=step, finished={},
                       unfinished=["R1"], audit={"keep_going": False,
                                                 "stopped": {"step": step, "code": "KV_PREFIX_MAP",
                                                             "phase": "after schedule"}})


def test_a_written_finding_round_trips_and_re_matches_its_own_mechanism_only(tmp_path):
    res = prefix_map("fresh-block")
    sig = signature(res)
    assert sig == "violation:KV_PREFIX_MAP/fresh-block"
    path, _ = write_finding(Finding(sig, FOUND, res, 1.0, 5, 0), "0.8.4", tmp_path)
    sc = load_scenario(path)
    assert (sc.expect.outcome, sc.expect.code, sc.expect.mechanism) == (
        "violation", "KV_PREFIX_MAP", "fresh-block")
    v = judge(sc, "0.8.4", res)
    assert v.ok is True and v.observed == "violation KV_PREFIX_MAP/fresh-block @12"
    # the code's other way is another finding: not this scenario's bug
    other = judge(sc, "0.8.4", prefix_map("uncomputed-hit"))
    assert other.ok is False
    assert other.reason == ("no KV_PREFIX_MAP/fresh-block among the violations "
                            "(KV_PREFIX_MAP/uncomputed-hit @12)")


def test_a_finding_without_a_mechanism_writes_the_code_alone(tmp_path):
    res = make_result("violation", violations=[make_violation("REQ_STATE", 3).to_dict()],
                      steps=3, finished={}, unfinished=["R0", "R1"])
    path, _ = write_finding(Finding(signature(res), FOUND, res, 1.0, 5, 0), "0.8.4", tmp_path)
    sc = load_scenario(path)
    assert sc.expect.code == "REQ_STATE" and sc.expect.mechanism is None
    assert judge(sc, "0.8.4", res).ok is True


def test_on_a_clean_on_release_only_the_expected_mechanism_is_the_scenarios_bug(tmp_path):
    """#14353's residue (``finished``) on a release where #12973's (``ignored``) is still open:
    the run is clean for #14353."""
    text = textwrap.dedent("""
        name: m
        level: v0-engine
        vllm: {reproduces_on: ["0.7.3"], clean_on: ["0.8.0"]}
        config: {block_size: 16, num_gpu_blocks: 32, num_cpu_blocks: 0}
        requests: [{id: A, prompt_len: 24, max_tokens: 4, n: 2}]
        expect: {outcome: violation, code: REQ_RESIDUE, mechanism: finished}
    """)
    (tmp_path / "m.yaml").write_text(text)
    sc = load_scenario(tmp_path / "m.yaml")
    ignored = make_violation("REQ_RESIDUE", 6, "A_parallel_sample_1 (ignored by the scheduler) "
                             "left the scheduler", requests=("A",)).to_dict() | {"mechanism": "ignored"}
    ran = make_result("violation", violations=[ignored], steps=9, finished={"A": "FINISHED_IGNORED"},
                      unfinished=[], audit={"keep_going": True, "stopped": None})
    assert judge(sc, "0.8.0", ran).ok is True
    ran.violations[0].mechanism = "finished"
    assert judge(sc, "0.8.0", ran).ok is False


@pytest.mark.parametrize("expect, words", [
    ("{outcome: violation, code: KV_PREFIX_MAP, mechanism: fresh_block}",
     "expect.mechanism: 'fresh_block' is not one of KV_PREFIX_MAP's: fresh-block, "
     "uncomputed-hit; did you mean fresh-block?"),
    ("{outcome: violation, mechanism: finished}",
     "expect.mechanism: needs the violation's code: add code (REQ_RESIDUE) or drop mechanism"),
    ("{outcome: violation, code: KV_LEAK, mechanism: finished}",
     "expect.mechanism: the audit tells no mechanisms of KV_LEAK apart"),
    # the outcome is what is wrong, not the code
    ("{outcome: crash, code: REQ_RESIDUE, mechanism: finished}",
     "expect: code and mechanism only apply to outcome: violation (this one expects crash); "
     "drop code and mechanism, or set outcome: violation"),
    ("{outcome: violation, mechanism: fresh-block}", "add code (KV_PREFIX_MAP) or drop mechanism"),
    ("{outcome: violation, code: REQ_RESIDUE, mechanism: true}",
     "expect.mechanism: true is no mechanism tag; use one of finished, aborted, ignored"),
    ("{outcome: violation, code: 42}", "expect.code: 42 is no violation code; use one of KV_"),
    # a number or a boolean: the tags, not a hint to quote it
    ("{outcome: violation, code: REQ_RESIDUE, mechanism: 3}",
     "expect.mechanism: 3 is no mechanism tag; use one of finished, aborted, ignored"),
    ("{outcome: violation, code: REQ_RESIDUE, mechanism: FINISHED}",
     "did you mean finished?"),
    # a misspelt code is refused at load (it could only show as a failed reproduction), and
    # the mechanism's own check does not point the other way
    ("{outcome: violation, code: REQ_RESIDU, mechanism: finished}",
     "expect.code: 'REQ_RESIDU' is no violation code of the audit; did you mean REQ_RESIDUE?"),
    ("{outcome: violation, code: req_residue}", "did you mean REQ_RESIDUE?"),
])
def test_a_bad_mechanism_is_one_line_naming_the_field_and_the_fix(tmp_path, expect, words):
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nconfig: {num_gpu_blocks: 8}\nrequests: [{id: A, prompt_len: 10}]\n"
                 f"expect: {expect}\n")
    with pytest.raises(InputError) as err:
        load_scenario(p)
    assert str(err.value).startswith(f"{p}: ") and words in str(err.value)
    assert "\n" not in str(err.value)


def test_the_mechanisms_a_scenario_may_name_are_the_ones_the_audit_gives():
    import re
    from pathlib import Path

    from vllm_repro.audit import v0
    from vllm_repro.records import MECHANISMS

    assert {m for _, m in v0._ENDED.values()} == set(MECHANISMS["REQ_RESIDUE"])
    # _how_skipped's two tags, each returned as the second of a (sentence, tag) pair
    src = Path(v0.__file__).read_text()
    skipped = src[src.index("def _how_skipped"):src.index("#: a GPU block no worker")]
    assert set(re.findall(r'"([a-z]+-[a-z]+)"\)', skipped)) == set(MECHANISMS["KV_PREFIX_MAP"])


def test_a_missing_step_names_the_expected_kind_not_any_violation(tmp_path):
    """A violation at the expected step, of another way: the reason says which is missing there
    (before, "no violation at step 12" beside a table showing one at step 12)."""
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nlevel: v0-engine\nvllm: {reproduces_on: ['0.8.4']}\n"
                 "config: {num_gpu_blocks: 32, num_cpu_blocks: 0, block_size: 16}\n"
                 "requests: [{id: R1, prompt_len: 32}]\n"
                 "expect: {outcome: violation, code: KV_PREFIX_MAP, mechanism: fresh-block, step: 12}\n")
    v = judge(load_scenario(p), "0.8.4", prefix_map("uncomputed-hit", step=12))
    assert v.ok is False
    assert v.reason.endswith("; no KV_PREFIX_MAP/fresh-block at step 12"), v.reason
