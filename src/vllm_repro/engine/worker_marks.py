"""What the two drivers of the release's worker-side state share
(:mod:`~vllm_repro.engine.input_batch`: V1 ``InputBatch``;
:mod:`~vllm_repro.engine.request_states`: the V2 runner's ``RequestState`` / ``BlockTables``):
the mark that makes an exception raised inside the release's classes vLLM's crash, not a lab
error, and a signature reader. Its own module so that neither driver imports the other.

Runs inside the release environment (standard library only).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

#: attribute set (True) on an exception raised by the release's worker-side state: the loops
#: re-raise it as vLLM's failure (a crash), never as a lab error
WORKER_STATE_ATTR = "vllm_repro_worker_state"


def _params(fn) -> dict:
    """``fn``'s parameters by name (``{}`` where its signature cannot be read)."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _mark(exc: BaseException) -> BaseException:
    """``exc`` marked with :data:`WORKER_STATE_ATTR` (unmarked where the type has no
    ``__dict__``); returned for ``raise _mark(...)``."""
    try:
        setattr(exc, WORKER_STATE_ATTR, True)
    except Exception:  # noqa: BLE001 - an exception type without a __dict__: unmarked
        pass
    return exc


@contextmanager
def marked():
    """Run the block, marking (:func:`_mark`) and re-raising any exception it raises: what the
    release's worker-side classes raise is vLLM's crash."""
    try:
        yield
    except Exception as exc:
        _mark(exc)
        raise


def scheduler_configs(scheduler, note) -> tuple | None:
    """``(vllm_config, kv_cache_config, scheduler_config, model_config)`` of the release's
    ``scheduler``, what the model runner sizes its worker-side state from; None (and
    ``note(text)``) where one is missing."""
    vcfg = getattr(scheduler, "vllm_config", None)
    kvc = getattr(scheduler, "kv_cache_config", None)
    sched_cfg = getattr(scheduler, "scheduler_config", None) or getattr(vcfg, "scheduler_config",
                                                                         None)
    model_cfg = getattr(vcfg, "model_config", None)
    if vcfg is None or kvc is None or sched_cfg is None or model_cfg is None:
        note("the scheduler has no vllm_config / kv_cache_config: the worker-side state is the "
             "lab's PersistentBatch")
        return None
    return vcfg, kvc, sched_cfg, model_cfg


__all__ = ["WORKER_STATE_ATTR", "_mark", "_params", "marked", "scheduler_configs"]
