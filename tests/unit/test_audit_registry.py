"""The check registry (audit/registry.py): what the auditors run and what docs/audit.md says
come from the same declarations."""

from pathlib import Path

import pytest

from vllm_repro.audit import registry
from vllm_repro.audit.codes import CODES

DOC = Path(__file__).resolve().parents[2] / "docs" / "audit.md"


def test_docs_audit_md_is_generated_from_the_registry():
    text = DOC.read_text()
    assert registry.render_page(text) == text, (
        "docs/audit.md's tables are out of date with the registry: run "
        "`.venv/bin/python -m vllm_repro.audit docs/audit.md`")


def test_every_code_is_recorded_by_a_registered_check():
    assert registry.registered_codes() == set(CODES)


def test_every_phase_of_each_level_runs_registered_checks_in_order():
    names = [c.name for c in registry.checks_for(registry.AFTER_SCHEDULE, "engine-core")]
    assert names == ["KV books", "request states", "KV transfers", "preemption report",
                     "starvation", "draft limit"]
    names = [c.name for c in registry.checks_for(registry.AFTER_UPDATE, "scheduler")]
    assert names == ["KV books", "request states", "worker batch", "KV transfers"]
    assert [c.name for c in registry.checks_for(registry.END_OF_RUN, "scheduler", "stall")] \
        == ["stall"]
    assert [c.name for c in registry.checks_for(registry.AFTER_UPDATE, "v0-engine")] \
        == ["V0 books"]
    # hooks are listed for the table, not run by the phase loop
    assert registry.checks_for(registry.IN_CALL, "scheduler") == []


def test_a_check_with_an_unknown_code_or_phase_is_refused():
    with pytest.raises(ValueError, match="unknown code 'KV_OOPS'"):
        registry.check("oops", codes="KV_OOPS", phase=registry.AFTER_UPDATE, text="x")
    with pytest.raises(ValueError, match="phases"):
        registry.check("oops", codes="KV_LEAK", phase="sometime", text="x")(lambda a, m: [])
    with pytest.raises(ValueError, match="outcomes"):
        registry.check("oops", codes="KV_LEAK", phase=registry.END_OF_RUN, text="x")(
            lambda a, m: [])
    with pytest.raises(ValueError, match="twice"):
        registry.check("KV books", codes="KV_LEAK", phase=registry.AFTER_UPDATE, text="x")(
            lambda a, m: [])
    assert "oops" not in [c.name for c in registry.CHECKS]


def test_draft_limit_flags_more_drafts_than_num_speculative_tokens():
    from types import SimpleNamespace

    from vllm_repro.audit.checks import draft_limit

    def found(limit, drafts):
        auditor = SimpleNamespace(books=SimpleNamespace(scheduler=SimpleNamespace(
            num_spec_tokens=limit)))
        so = SimpleNamespace(scheduled_spec_decode_tokens=drafts)
        return draft_limit(auditor, registry.Moment(3, registry.AFTER_SCHEDULE, so))

    assert found(2, {"A": [5, 6], "B": [7]}) == []
    assert found(0, {"A": [5, 6, 7]}) == []  # no spec decode: nothing to hold it to
    (v,) = found(2, {"A": [5, 6], "B": [7, 8, 9]})
    assert (v.code, v.requests) == ("DRAFT_OVER_LIMIT", ["B"])
    assert "3 draft tokens but num_speculative_tokens is 2" in v.message
