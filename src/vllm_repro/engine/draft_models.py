"""The config-only draft models the package ships for the model-based drafters
(``src/vllm_repro/models``: no weights), by ``SpeculativeConfig.method``. Data only: the
adapter's builder (``engine/adapter/build.py``) names them to the release's ``SpeculativeConfig``,
and :mod:`vllm_repro.engine.drafter` reads them; neither imports the other."""

from __future__ import annotations

#: ``SpeculativeConfig.method`` -> the packaged config-only draft model (a folder of
#: ``src/vllm_repro/models``) the lab names as its ``model``
DRAFT_MODELS = {"eagle": "eagle-llama", "eagle3": "eagle3-llama", "mtp": "deepseek-mtp",
                "deepseek_mtp": "deepseek-mtp", "draft_model": "opt"}

#: packaged draft folder -> the architectures its config resolves to in the release (its own
#: ``config.json``'s, and the ones ``SpeculativeConfig`` derives: ``EAGLEConfig``'s
#: ``Eagle``/``Eagle3`` prefix, ``hf_config_override``'s MTP model), registered in-process
#: before the draft ``ModelConfig`` inspects them (``V1Adapter._register_model``)
DRAFT_ARCHS = {"eagle-llama": ("LlamaForCausalLM", "EagleLlamaForCausalLM"),
               "eagle3-llama": ("LlamaForCausalLM", "Eagle3LlamaForCausalLM"),
               "deepseek-mtp": ("DeepseekV3ForCausalLM", "DeepSeekMTPModel"),
               "opt": ("OPTForCausalLM",)}
