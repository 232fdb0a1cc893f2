"""The parallel topology a scenario asks for, read from its config under vLLM's own names.

``tensor_parallel_size``, ``pipeline_parallel_size``, ``data_parallel_size`` (and
``data_parallel_size_local``) and ``distributed_executor_backend`` are ``ParallelConfig`` fields:
they pass through to the release's config class as written (``config["passthrough"]``). This
module only reads them, to size the emulated platform (as many devices as the ranks need) and to
pick the executor (``mp``: the release's ``MultiprocExecutor`` with one rank process per
device, :mod:`vllm_repro.engine.ranks`).

Runs inside the release environment (standard library only).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the most ranks (devices) a run may ask for: each is a process of this machine under ``mp``
MAX_WORLD_SIZE = 8


@dataclass(frozen=True)
class Topology:
    """``tp`` x ``pp`` ranks per engine core (``world_size``), ``dp`` engine cores, ``dp_local``
    of them on this host; ``backend``: ``distributed_executor_backend`` as the scenario gives it
    (None: vLLM's default)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_local: int = 1
    backend: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks of one engine core (vLLM's ``ParallelConfig.world_size``)."""
        return self.tp * self.pp

    @property
    def devices(self) -> int:
        """GPUs the host needs: ``world_size x data_parallel_size_local``."""
        return self.world_size * self.dp_local

    @property
    def multiprocess(self) -> bool:
        """Whether the ranks run as processes (``distributed_executor_backend: mp``)."""
        return self.backend == "mp"

    def describe(self) -> str:
        """E.g. ``"TP=2 PP=1 DP=1 (mp)"``."""
        return f"TP={self.tp} PP={self.pp} DP={self.dp} ({self.backend or 'in-process'})"


def topology(cfg: dict) -> Topology:
    """The :class:`Topology` of a scenario's ``config`` mapping (its pass-through fields).
    Raises ``ValueError`` naming the field for a size that is not a positive integer or a world
    over :data:`MAX_WORLD_SIZE`."""
    extra = cfg.get("passthrough") or {}
    sizes = {}
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                "data_parallel_size_local"):
        value = extra.get(key, cfg.get(key))
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.{key}: {value!r} is not a positive integer; give 1 or more")
        sizes[key] = value
    tp = sizes.get("tensor_parallel_size", 1)
    pp = sizes.get("pipeline_parallel_size", 1)
    dp = sizes.get("data_parallel_size", 1)
    dp_local = sizes.get("data_parallel_size_local", dp)
    backend = extra.get("distributed_executor_backend", cfg.get("distributed_executor_backend"))
    topo = Topology(tp, pp, dp, dp_local, backend if isinstance(backend, str) else None)
    if topo.devices > MAX_WORLD_SIZE:
        raise ValueError(f"config: tensor_parallel_size x pipeline_parallel_size x "
                         f"data_parallel_size_local = {topo.devices} ranks, over the lab's "
                         f"{MAX_WORLD_SIZE} (one process each); lower them")
    return topo


__all__ = ["Topology", "topology", "MAX_WORLD_SIZE"]
