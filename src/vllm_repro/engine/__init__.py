"""Release-side engine driver: adapter (API drift), fake model runner, step loop, worker.

Everything in this package runs inside a vLLM release environment: standard library and vLLM's
own dependencies only.
"""
