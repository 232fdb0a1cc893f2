"""KV cache spec kinds: one ``KVCacheSpec`` per scenario KV cache group, as the model's layers
would declare them (``Attention.get_kv_cache_spec``, ``MambaBase.get_kv_cache_spec``), for
both levels: the scheduler level's ``KVCacheConfig`` (``V1Adapter._kv_cache_config``) and the
fake worker's ``get_kv_cache_spec`` at level engine-core (``executor.kv_cache_spec``).

Which kinds a release has is probed (:func:`release_kinds`): the spec class in
``vllm/v1/kv_cache_interface.py`` and a single-type manager for it in
``vllm/v1/core/single_type_kv_cache_manager.py`` (``spec_manager_map`` up to 0.2x,
``register_all_kvcache_specs`` later). Constructor fields are handed over only where the
release's spec takes them (``call_supported``); a scenario field the release's spec lacks is
refused, naming it.

Page sizes: every spec here has the page size of one full-attention block (one KV head of
size 1 in float32: 2 x 4 bytes a token), a Mamba group's state included (one float32 state of
``2 x block_size`` values), so that engine-core start-up's uniform-page-size layout
(``kv_cache_utils._get_kv_cache_config_uniform_page_size``) holds for any mix of kinds, as
the platform's hybrid block-size alignment arranges it for real hybrid models.
"""

from __future__ import annotations

import enum
import importlib.util
from pathlib import Path
from typing import Any

from .probes import RefusedByRelease, _try_import, call_supported, init_params

#: scenario ``type`` -> (the spec class of vllm/v1/kv_cache_interface.py, the scenario fields
#: that class takes beyond the attention ones); names as vLLM's KVCacheSpecKind spells them
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "full": ("FullAttentionSpec", ()),
    "sliding_window": ("SlidingWindowSpec", ("sliding_window",)),
    "chunked_local_attention": ("ChunkedLocalAttentionSpec", ("attention_chunk_size",)),
    "mamba": ("MambaSpec", ("mamba_type",)),
    "cross_attention": ("CrossAttentionSpec", ()),
}


def _manager_source() -> str:
    try:
        spec = importlib.util.find_spec("vllm.v1.core.single_type_kv_cache_manager")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin:
        return ""
    try:
        return Path(spec.origin).read_text()
    except OSError:
        return ""


def release_kinds() -> tuple[str, ...]:
    """The scenario kinds of :data:`KINDS` the imported release has: its spec class imports
    from ``vllm.v1.kv_cache_interface`` and the single-type manager module names it (maps it
    to a manager). Empty on releases without the module (0.6.x/0.7.x)."""
    src = _manager_source()
    kinds = []
    for kind, (cls_name, _fields) in KINDS.items():
        cls = _try_import(f"vllm.v1.kv_cache_interface:{cls_name}")
        if cls is not None and (cls_name in src or kind == "full"):
            kinds.append(kind)
    return tuple(kinds)


def _refuse_kind(version: str, index: int, kind: str, kinds: tuple[str, ...]) -> RefusedByRelease:
    cls_name = KINDS.get(kind, (kind, ()))[0]
    return RefusedByRelease(
        f"config.kv_cache_groups[{index}].type: vLLM {version} has no {kind} KV cache groups "
        f"(no {cls_name} with a single-type manager in vllm/v1/core); this release's kinds: "
        f"{', '.join(kinds) or 'none'}")


def mamba_type_value(cls, value: str | None, version: str, index: int):
    """The release's value for ``MambaSpec.mamba_type``: its enum member (0.2x+:
    ``MambaAttentionBackendEnum``, by name or value, any case) or the string (older
    releases). Raises :class:`RefusedByRelease` for a name the enum lacks, listing its
    members."""
    field = getattr(cls, "__dataclass_fields__", {}).get("mamba_type")
    default = getattr(field, "default", None)
    if value is None:
        return default
    if isinstance(default, enum.Enum):
        enum_cls = type(default)
        for member in enum_cls:
            if value.lower() in (member.name.lower(), str(member.value).lower()):
                return member
        raise RefusedByRelease(
            f"config.kv_cache_groups[{index}].mamba_type: vLLM {version}'s MambaSpec has no "
            f"mamba_type {value!r}; its values: "
            f"{', '.join(m.name.lower() for m in enum_cls)}")
    return value


def check_model_config(cfg: dict[str, Any], cache_config, version: str) -> None:
    """What a hybrid model's config would settle before the scheduler sees a Mamba group
    (``vllm/model_executor/models/config.py``: ``HybridAttentionMambaModelConfig`` /
    ``MambaModelConfig.verify_and_update_config``), checked instead of guessed: prefix caching
    with a Mamba group needs ``mamba_cache_mode`` (``align`` or ``all``) where the release has
    the field, and is off for Mamba models where it has not; ``align`` needs chunked prefill.
    A ``cross_attention`` group is an encoder-decoder model's, for which vLLM turns prefix
    caching off (``CrossAttentionManager`` has no cache hits). Raises :class:`RefusedByRelease`
    naming the field to set."""
    kinds = {g["type"] for g in cfg.get("kv_cache_groups") or []}
    if "cross_attention" in kinds and cfg["enable_prefix_caching"]:
        raise RefusedByRelease(
            "config.enable_prefix_caching: a cross_attention KV cache group is an "
            "encoder-decoder model's, for which vLLM turns prefix caching off; set it false")
    if "mamba" not in kinds:
        return
    mode = getattr(cache_config, "mamba_cache_mode", None)
    if cfg["enable_prefix_caching"]:
        if mode is None:
            raise RefusedByRelease(
                f"config.enable_prefix_caching: vLLM {version} turns prefix caching off for "
                "models with Mamba layers (no CacheConfig.mamba_cache_mode); set it false")
        if mode == "none":
            raise RefusedByRelease(
                "config.mamba_cache_mode: a mamba KV cache group with prefix caching needs "
                "mamba_cache_mode align or all (the hybrid model's config picks one); set it")
    if mode == "align" and not cfg["enable_chunked_prefill"]:
        raise RefusedByRelease("config.enable_chunked_prefill: mamba_cache_mode align needs "
                               "chunked prefill (vLLM's hybrid model config asserts it); set it true")


def group_spec(adapter, g: dict[str, Any], index: int, cfg: dict[str, Any], torch,
               cache_config=None):
    """The release's ``KVCacheSpec`` for scenario group ``g`` (the ``index``-th of
    ``config.kv_cache_groups``). Raises :class:`RefusedByRelease` for a kind or a field the
    release lacks."""
    kind = g["type"]
    kinds = adapter.caps.kv_group_kinds
    if kind not in kinds:
        raise _refuse_kind(adapter.version, index, kind, kinds)
    cls_name, _ = KINDS[kind]
    cls = _try_import(f"vllm.v1.kv_cache_interface:{cls_name}")
    names, var_kw = init_params(cls)
    block_size = g.get("block_size") or cfg["block_size"]
    if kind == "mamba":
        kwargs: dict[str, Any] = dict(
            shapes=((2 * cfg["block_size"],),), dtypes=(torch.float32,), block_size=block_size,
            page_size_padded=None,
            mamba_type=mamba_type_value(cls, g.get("mamba_type"), adapter.version, index))
        mode = getattr(cache_config, "mamba_cache_mode", None)
        if mode is not None:
            kwargs["mamba_cache_mode"] = mode
        # MambaBase.get_kv_cache_spec: one state block per draft token
        kwargs["num_speculative_blocks"] = int(cfg.get("num_speculative_tokens") or 0)
    else:
        kwargs = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                      use_mla=False)
        if kind == "full":
            kwargs["sliding_window"] = None
        for field in KINDS[kind][1]:
            if field not in names and not var_kw:
                raise RefusedByRelease(
                    f"config.kv_cache_groups[{index}].{field}: vLLM {adapter.version}'s "
                    f"{cls_name} does not take it")
            kwargs[field] = g[field]
    return call_supported(cls, **kwargs)


__all__ = ["KINDS", "release_kinds", "group_spec", "check_model_config", "mamba_type_value"]
