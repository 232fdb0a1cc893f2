"""Sliced vLLM: a traced slice of a release's sources, stubs for what scheduling never uses.

Nothing is imported here: :mod:`vllm_repro.slicing.tracer` runs inside release environments
(standard library only) and must not pull in the lab's dependencies.
"""
