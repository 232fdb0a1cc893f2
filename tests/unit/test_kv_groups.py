"""Hybrid KV cache groups: the scenario fields of each kind, and the release-side rules
(``engine/adapter/kv_specs.py``) that need no release: the Mamba ``mamba_type`` mapping and
the model-config checks a hybrid model's config would settle."""

from __future__ import annotations

import enum
import textwrap
from dataclasses import dataclass

import pytest

from vllm_repro.engine.adapter import kv_specs
from vllm_repro.engine.adapter.probes import RefusedByRelease
from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

BASE = textwrap.dedent("""
    name: t
    config:
      num_gpu_blocks: 40
      kv_cache_groups: [{type: full}, GROUP]
    requests:
      - {id: A, prompt_len: 10}
""")


def load(tmp_path, group: str):
    p = tmp_path / "s.yaml"
    p.write_text(BASE.replace("GROUP", group))
    return load_scenario(p)


@pytest.mark.parametrize("group, kind", [
    ("{type: sliding_window, sliding_window: 32}", "sliding_window"),
    ("{type: chunked_local_attention, attention_chunk_size: 64}", "chunked_local_attention"),
    ("{type: mamba}", "mamba"),
    ("{type: mamba, block_size: 64, mamba_type: mamba2, num_layers: 3}", "mamba"),
    ("{type: cross_attention}", "cross_attention"),
])
def test_each_kind_loads_and_reaches_the_engine_config(tmp_path, group, kind):
    sc = load(tmp_path, group)
    groups = sc.child_payload()["config"]["kv_cache_groups"]
    assert [g["type"] for g in groups] == ["full", kind]


@pytest.mark.parametrize("group, field, words", [
    ("{type: chunked_local_attention}", "kv_cache_groups", "needs `attention_chunk_size: N`"),
    ("{type: sliding_window}", "kv_cache_groups", "needs `sliding_window: N`"),
    ("{type: full, attention_chunk_size: 64}", "kv_cache_groups",
     "`attention_chunk_size` only applies to groups of type chunked_local_attention"),
    ("{type: sliding_window, sliding_window: 8, block_size: 32}", "kv_cache_groups",
     "`block_size` only applies to groups of type mamba"),
    ("{type: full, mamba_type: mamba2}", "kv_cache_groups", "only applies to groups of type mamba"),
    ("{type: mamba, mamba_type: 'x; y'}", "mamba_type", "pattern"),
    ("{type: linear}", "type", "mamba"),
])
def test_a_bad_group_is_an_input_error_naming_the_field(tmp_path, group, field, words):
    with pytest.raises(InputError) as info:
        load(tmp_path, group)
    msg = str(info.value)
    assert "\n" not in msg and field in msg and words in msg, msg


class Backend(enum.Enum):
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    LINEAR = "linear_attention"


@dataclass(frozen=True)
class EnumSpec:  # the shape of MambaSpec 0.2x+: mamba_type is an enum
    mamba_type: Backend = Backend.MAMBA2


@dataclass(frozen=True)
class StrSpec:  # the shape of MambaSpec up to 0.2x: a string
    mamba_type: str = "mamba2"


def test_mamba_type_is_the_releases_enum_member_by_name_or_value():
    assert kv_specs.mamba_type_value(EnumSpec, None, "X", 1) is Backend.MAMBA2
    assert kv_specs.mamba_type_value(EnumSpec, "mamba1", "X", 1) is Backend.MAMBA1
    assert kv_specs.mamba_type_value(EnumSpec, "LINEAR", "X", 1) is Backend.LINEAR
    assert kv_specs.mamba_type_value(EnumSpec, "linear_attention", "X", 1) is Backend.LINEAR
    assert kv_specs.mamba_type_value(StrSpec, "short_conv", "X", 1) == "short_conv"
    assert kv_specs.mamba_type_value(StrSpec, None, "X", 1) == "mamba2"


def test_an_unknown_mamba_type_names_the_field_and_the_releases_values():
    with pytest.raises(RefusedByRelease) as info:
        kv_specs.mamba_type_value(EnumSpec, "gdn", "9.9.9", 2)
    msg = str(info.value)
    assert msg.startswith("config.kv_cache_groups[2].mamba_type: vLLM 9.9.9")
    assert "mamba1, mamba2, linear" in msg


class Cache:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def cfg(groups, caching=True, chunked=True):
    return {"kv_cache_groups": groups, "enable_prefix_caching": caching,
            "enable_chunked_prefill": chunked}


MAMBA = [{"type": "full"}, {"type": "mamba"}]


@pytest.mark.parametrize("config, cache, field", [
    (cfg(MAMBA), Cache(mamba_cache_mode="none"), "config.mamba_cache_mode"),
    (cfg(MAMBA), Cache(), "config.enable_prefix_caching"),  # no mamba_cache_mode: caching off
    (cfg(MAMBA, chunked=False), Cache(mamba_cache_mode="align"), "config.enable_chunked_prefill"),
    (cfg([{"type": "full"}, {"type": "cross_attention"}]), Cache(), "config.enable_prefix_caching"),
])
def test_a_layout_the_models_config_would_not_allow_is_refused(config, cache, field):
    with pytest.raises(RefusedByRelease) as info:
        kv_specs.check_model_config(config, cache, "9.9.9")
    assert str(info.value).startswith(field)


@pytest.mark.parametrize("config, cache", [
    (cfg(MAMBA), Cache(mamba_cache_mode="align")),
    (cfg(MAMBA), Cache(mamba_cache_mode="all")),
    (cfg(MAMBA, caching=False, chunked=False), Cache(mamba_cache_mode="none")),
    (cfg(MAMBA, caching=False), Cache()),
    (cfg([{"type": "full"}, {"type": "cross_attention"}], caching=False), Cache()),
    (cfg(None), Cache()),
])
def test_a_layout_a_hybrid_model_runs_with_passes(config, cache):
    kv_specs.check_model_config(config, cache, "9.9.9")
