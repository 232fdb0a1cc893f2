"""The capabilities record a worker sends in its hello: what the loop, the fuzzer and triage
read instead of probing vLLM themselves (no vLLM release needed)."""

from __future__ import annotations

import sys

import pytest

from vllm_repro.engine.adapter.capability_probes import _class_source
from vllm_repro.engine.capabilities import FEATURES, Capabilities, load, save
from vllm_repro.errors import InputError
from vllm_repro.fuzz.search import fit_profile, refused_features
from vllm_repro.fuzz.strategies import DEFAULT

OLD = Capabilities(version="0.6.6.post1", kv_group_kinds=("full",), events=("abort",))
NEW = Capabilities(version="0.33.0", priority=True, spec_decode=True,
                   spec_methods=("ngram", "ngram_gpu"), empty_outputs=True,
                   async_scheduling=True, kv_cache_groups=True,
                   kv_group_kinds=("full", "sliding_window"), engine_core=True, engine_core_proc=True,
                   dp_engine_core_proc=True, dp_throttle_prefills=True,
                   split_sampling=True, batch_queue_from_config=True,
                   events=("abort", "abort_in_flight", "reset_prefix_cache",
                           "reset_running_requests", "pause", "resume"),
                   structured_outputs=True, structured_outputs_field="structured_outputs",
                   structured_backends=("xgrammar", "guidance"),
                   reasoning_parser_field="StructuredOutputsConfig.reasoning_parser",
                   reasoning_parsers=("deepseek_r1", "qwen3"),
                   preprocess_errors_per_request=True, kv_connectors=True,
                   kv_load_failures=("invalid_block_ids", "failed_recving"))


def test_round_trip_through_json_and_the_cache(tmp_path):
    assert Capabilities.from_dict(NEW.to_dict()) == NEW
    # a record cached by another lab version: unknown keys are ignored, missing ones default
    raw = {**OLD.to_dict(), "some_future_field": True}
    raw.pop("events")
    assert Capabilities.from_dict(raw).events == ()
    # the structured-output fields travel too (a tuple of backends back from a JSON list)
    back = Capabilities.from_dict(NEW.to_dict())
    assert (back.structured_outputs_field, back.structured_backends) == (
        "structured_outputs", ("xgrammar", "guidance"))
    assert Capabilities.from_dict(OLD.to_dict()).structured_outputs_field is None
    assert (back.reasoning_parser_field, back.reasoning_parsers) == (
        "StructuredOutputsConfig.reasoning_parser", ("deepseek_r1", "qwen3"))
    save(tmp_path, NEW)
    assert load(tmp_path, "0.33.0") == NEW
    assert load(tmp_path, "0.9.2") is None


def test_each_checkout_of_the_lab_keeps_its_own_records(tmp_path):
    # a record is what this checkout's probes found; another checkout (other code) sharing the
    # release cache must not read it: the folder is keyed by the checkout, as labpath/ is
    from vllm_repro.engine.capabilities import cache_path
    from vllm_repro.engine.host import lab_path

    save(tmp_path, NEW)
    (saved,) = (tmp_path / "capabilities").rglob("*.json")
    assert saved == cache_path(tmp_path, "0.33.0")
    assert saved.parent.name == lab_path().name != "capabilities"
    assert not (tmp_path / "capabilities" / "0.33.0.json").exists()


def test_refusals_name_the_release_and_the_fix():
    for f in FEATURES:
        assert NEW.supports(f) and NEW.refusal(f) is None
        msg = OLD.refusal(f)
        assert msg is not None and "0.6.6.post1" in msg
    assert "level: scheduler" in OLD.refusal("engine-core")
    with pytest.raises(KeyError):
        OLD.refusal("time travel")


class _Worker:
    def __init__(self, caps):
        self.capabilities = caps


def test_the_fuzzer_fits_its_profile_to_the_record():
    assert refused_features(_Worker(NEW)) == {}
    refused = refused_features(_Worker(OLD))
    assert set(refused) == {"priority", "spec decode", "empty outputs", "async scheduling",
                            "kv cache groups", "engine-core"}
    prof = fit_profile(DEFAULT, refused)
    assert "priority" not in prof.policies and not prof.spec_decode and not prof.empty_outputs
    assert not prof.async_scheduling and not prof.kv_cache_groups
    with pytest.raises(InputError, match="--level engine-core: vLLM 0.6.6.post1"):
        fit_profile(DEFAULT, refused, level="engine-core")


def test_engine_classes_are_read_from_source_not_imported(tmp_path, monkeypatch):
    pkg = tmp_path / "fakevllm_caps"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text(
        "raise RuntimeError('imported')\n"
        "class EngineCore:\n"
        "    def __init__(self, vllm_config):\n"
        "        self.aborts_queue = None\n"
        "    def reset_prefix_cache(self, reset_running_requests=False):\n"
        "        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    methods, init_src = _class_source("fakevllm_caps.core", "EngineCore")
    assert methods["reset_prefix_cache"] == {"self", "reset_running_requests"}
    assert "aborts_queue" in init_src
    assert "fakevllm_caps.core" not in sys.modules
    assert _class_source("fakevllm_caps.core", "Missing") is None
    assert _class_source("fakevllm_caps.nowhere", "EngineCore") is None


def test_engine_generations_refuse_naming_the_level_to_use():
    from dataclasses import replace

    v0_only = replace(OLD, version="0.6.3.post1", v1_engine=False, v0_engine=True)
    assert v0_only.supports("v0-engine")
    assert "use level: v0-engine" in v0_only.refusal("v1-engine")
    assert "vLLM 0.33.0 has no V0 engine" in NEW.refusal("v0-engine")
    assert Capabilities.from_dict(v0_only.to_dict()) == v0_only


def test_mamba_cache_modes_are_read_from_cache_configs_annotation():
    import types
    from typing import Literal

    from vllm_repro.engine.adapter.capability_probes import _mamba_cache_modes

    def adapter_with(annotations):
        cls = type("CacheConfig", (), {"__annotations__": annotations, "__module__": __name__})
        return types.SimpleNamespace(config_mod=types.SimpleNamespace(CacheConfig=cls))

    assert _mamba_cache_modes(adapter_with({"mamba_cache_mode": Literal["all", "align", "none"]})) \
        == ("all", "align")  # vllm/config/cache.py of 0.28.0
    assert _mamba_cache_modes(adapter_with({"block_size": int})) == ()  # releases before it
    assert _mamba_cache_modes(adapter_with({"mamba_cache_mode": 'Literal["align", "none"]'})) \
        == ("align",)  # a postponed annotation, read from its text


def test_the_reasoning_parser_field_is_the_one_the_managers_source_reads(tmp_path, monkeypatch):
    """``reasoning_parser_field``: the config field a release's StructuredOutputManager reads
    (found in its source, not by version), with the names its ReasoningParserManager registers
    (eager and lazy); none where the manager reads no parser (0.8.x) or there is none."""
    import types

    from vllm_repro.engine.adapter import capability_probes

    pkg = tmp_path / "fakevllm_so"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "so.py").write_text(
        "class Old:\n"
        "    def __init__(self, vllm_config):\n"
        "        name = vllm_config.decoding_config.reasoning_backend\n"
        "class New:\n"
        "    def __init__(self, vllm_config):\n"
        "        name = (\n            self.vllm_config.structured_outputs_config.reasoning_parser\n        )\n"
        "class NoReasoning:\n"
        "    def __init__(self, vllm_config):\n"
        "        self.backend = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from fakevllm_so import so

    manager = types.SimpleNamespace(reasoning_parsers={"qwen3": object},
                                    lazy_parsers={"deepseek_r1": ("m", "C")})
    monkeypatch.setattr(capability_probes, "_try_import", lambda *names: manager)
    fields = {"StructuredOutputsConfig": {"backend", "reasoning_parser"},
              "DecodingConfig": {"backend", "reasoning_backend"}}

    def adapter(som, *classes):
        return types.SimpleNamespace(StructuredOutputManager=som,
                                     config_fields=lambda c: fields[c] if c in classes else set())

    assert capability_probes._reasoning_parsers(adapter(so.New, "StructuredOutputsConfig")) == (
        "StructuredOutputsConfig.reasoning_parser", ("deepseek_r1", "qwen3"))
    assert capability_probes._reasoning_parsers(adapter(so.Old, "DecodingConfig"))[0] == \
        "DecodingConfig.reasoning_backend"
    # 0.8.x: DecodingConfig has reasoning_backend, but the V1 manager never reads it
    assert capability_probes._reasoning_parsers(adapter(so.NoReasoning, "DecodingConfig")) == (None, ())
    assert capability_probes._reasoning_parsers(adapter(None)) == (None, ())
    assert "reads no reasoning parser" in OLD.refusal("reasoning parser")
