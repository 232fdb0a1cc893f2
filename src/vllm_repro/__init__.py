"""vllm-repro: reproduce vLLM engine crashes on CPU with vLLM's real scheduler and KV-cache code.

This package is imported on both sides of the lab: by the host CLI (typer, rich, pydantic) and,
for ``vllm_repro.engine`` and ``vllm_repro.audit``, inside a release's environment, where only the
standard library and vLLM's own dependencies exist. Keep this module free of imports.
"""

__version__ = "0.1.0"
