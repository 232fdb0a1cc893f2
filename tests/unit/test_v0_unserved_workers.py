"""level: v0-engine refuses what the lab's fake V0 worker does not serve (multi-step scheduling,
V0 speculative decoding) in one line naming the field, the release and what to do, instead of
running vLLM's engine against a worker that answers differently (without a release: the
engine config is read by attribute, as engine/v0.py reads vLLM's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_repro.engine.adapter.probes import RefusedByRelease
from vllm_repro.engine.v0 import V0Adapter, refuse_unserved_workers


def _config(steps=1, spec=None):
    return SimpleNamespace(scheduler_config=SimpleNamespace(num_scheduler_steps=steps),
                           speculative_config=spec)


def test_multi_step_is_refused_naming_field_release_and_fix():
    with pytest.raises(RefusedByRelease) as e:
        refuse_unserved_workers(_config(steps=8), {"num_scheduler_steps": 8}, "0.6.3.post1")
    assert str(e.value).startswith("config.num_scheduler_steps: 8: vLLM 0.6.3.post1's multi-step "
                                   "scheduling runs its MultiStepWorker")
    assert str(e.value).endswith("use 1 (the default) at level: v0-engine")


def test_single_step_and_releases_without_multi_step_or_spec_decode_run():
    refuse_unserved_workers(_config(steps=1), {}, "0.6.3.post1")
    # 0.4.x: no num_scheduler_steps, no speculative_config attribute at all
    refuse_unserved_workers(SimpleNamespace(scheduler_config=SimpleNamespace()), {}, "0.4.1")


def test_a_built_speculative_config_is_refused_naming_the_scenarios_field():
    with pytest.raises(RefusedByRelease) as e:
        refuse_unserved_workers(_config(spec=object()), {"speculative_model": "[ngram]",
                                                         "speculative_method": "ngram"}, "0.7.3")
    assert str(e.value).startswith("config.speculative_model: vLLM 0.7.3's V0 speculative "
                                   "decoding runs its SpecDecodeWorker")


def test_spec_fields_are_refused_before_vllm_builds_its_config(tmp_path):
    """The lab's num_speculative_tokens (V1's drafter) and vLLM's own V0 spec fields get the
    same one line, not the generic V1-only refusal nor vLLM's 'num_speculative_tokens must be
    provided' (which sent users back and forth between the two)."""
    adapter = object.__new__(V0Adapter)
    adapter.version, adapter.model_dir = "0.6.3.post1", tmp_path
    adapter.engine_args_fields = {"model", "disable_log_stats", "speculative_model",
                                  "num_speculative_tokens", "ngram_prompt_lookup_max"}
    for cfg, named in (({"num_speculative_tokens": 2, "speculative_method": "ngram"},
                        "config.num_speculative_tokens"),
                       ({"speculative_model": "[ngram]", "ngram_prompt_lookup_max": 3,
                         "speculative_method": "ngram"},
                        "config.speculative_model, config.ngram_prompt_lookup_max")):
        with pytest.raises(RefusedByRelease) as e:
            adapter.engine_args(cfg)
        assert str(e.value).startswith(f"{named}: vLLM 0.6.3.post1's V0 speculative decoding")
    # the lab's drafter choice alone (its default) asks for nothing
    assert adapter.engine_args({"speculative_method": "ngram", "num_speculative_tokens": None})
