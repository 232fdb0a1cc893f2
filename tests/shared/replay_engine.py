"""Replay a scenario's workload on the real vLLM engine (GPU, a real small model).

Run by ``test_gpu_replay.py`` with the interpreter that has the installed full vLLM:
``python replay_engine.py MODEL_DIR < scenario.json``; prints one JSON line:
``{"outcome": "crash" | "clean", "exception": ..., "where": "vllm/...py:function", "step": n}``.

The V1 ``LLMEngine`` runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that one
``engine.step()`` is one ``Scheduler.schedule()`` of the real ``EngineCore``: requests are added
just before the step the scenario says, aborts applied the same way, with the scenario's KV pool
(``num_gpu_blocks_override``) and scheduler limits. EOS is ignored (the model decides tokens,
not the scenario), so requests run to ``max_tokens``. Standard library and vLLM only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V1", "1")


def _where(tb) -> tuple[str | None, int | None]:
    for frame in reversed(traceback.extract_tb(tb)):
        norm = frame.filename.replace(os.sep, "/")
        if "/vllm/" in norm:
            rel = "vllm/" + norm.rsplit("/vllm/", 1)[1]
            return f"{rel}:{frame.name}", frame.lineno
    return None, None


def main() -> int:
    model = sys.argv[1]
    sc = json.load(sys.stdin)
    cfg = sc["config"]
    from vllm import EngineArgs, SamplingParams

    try:
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError:  # releases before V1's own LLMEngine
        from vllm import LLMEngine
    wanted = {
        "model": model, "enforce_eager": True, "seed": 0, "gpu_memory_utilization": 0.5,
        "block_size": cfg["block_size"], "num_gpu_blocks_override": cfg["num_gpu_blocks"],
        "max_num_seqs": cfg["max_num_seqs"], "max_num_batched_tokens": cfg["max_num_batched_tokens"],
        "max_model_len": cfg["max_model_len"], "enable_chunked_prefill": cfg["enable_chunked_prefill"],
        "enable_prefix_caching": cfg["enable_prefix_caching"], "scheduling_policy": cfg["policy"],
    }
    if cfg.get("long_prefill_token_threshold"):
        wanted["long_prefill_token_threshold"] = cfg["long_prefill_token_threshold"]
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    engine = LLMEngine.from_engine_args(EngineArgs(**{k: v for k, v in wanted.items() if k in fields}))
    token = sc["model"]["token"]
    added: set[str] = set()
    step = 0
    try:
        for step in range(1, sc["limits"]["max_steps"] + 1):
            for r in sc["requests"]:
                if r["at_step"] == step:
                    prompt = {"prompt_token_ids": [token] * r["prompt_len"]}
                    params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
                    kwargs = {"priority": r["priority"]} if cfg["policy"] == "priority" else {}
                    engine.add_request(r["id"], prompt, params, **kwargs)
                    added.add(r["id"])
            for ev in sc.get("events", []):
                if ev["at_step"] == step:
                    engine.abort_request(ev["abort"])
            engine.step()
            if len(added) == len(sc["requests"]) and not engine.has_unfinished_requests():
                break
    except Exception as exc:  # noqa: BLE001 - the engine's crash is the observation
        where, line = _where(exc.__traceback__)
        print(json.dumps({"outcome": "crash", "exception": type(exc).__name__, "where": where,
                          "line": line, "step": step, "message": str(exc).splitlines()[0][:300]
                          if str(exc) else ""}))
        return 0
    print(json.dumps({"outcome": "clean", "steps": step}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
