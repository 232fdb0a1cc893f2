"""Outputs: what a ``SchedulerOutput`` schedules, the ``ModelRunnerOutput`` handed back, drafts,
stat loggers and the ``SchedulerStats`` attached to engine-core outputs."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .. import state
from .probes import AdapterError, _import, _try_import, call_supported, fields_of


@dataclass
class Scheduled:
    """One request in a ``SchedulerOutput``: tokens scheduled this step, computed tokens before
    this step, and the draft (spec) tokens scheduled for verification."""

    req_id: str
    num_scheduled: int
    num_computed_before: int | None  # None: in num_scheduled_tokens without new/cached data
    spec_tokens: list[int]
    new: bool


class OutputsMixin:
    """``V1Adapter``'s output methods."""

    # ---- scheduler output / model output ----------------------------------------------------
    def scheduled(self, so) -> list[Scheduled]:
        """What ``SchedulerOutput`` asks the model runner to compute, per request, in
        ``num_scheduled_tokens`` order (``vllm/v1/core/sched/output.py``; read by
        :mod:`.state`)."""
        before, new_ids = state.computed_before(so)
        spec = state.spec_tokens(so)
        out = []
        for rid, n in so.num_scheduled_tokens.items():
            out.append(Scheduled(rid, n, before.get(rid), list(spec.get(rid, [])), rid in new_ids))
        return out

    def model_output(self, req_ids: list[str], sampled: list[list[int]],
                     drafts: list[list[int]] | None, kv_connector: dict | None = None):
        """``ModelRunnerOutput`` for ``req_ids`` (ordered as scheduled).

        ``sampled``: the tokens of each request this step (``[]``: none, e.g. a partial prefill).
        Where the release takes one token per request (0.6.x/0.7.x) a request without a token
        gets the placeholder id 0, which that scheduler ignores for a request still in prefill
        (as the GPU runner's sampled token is ignored there); more than one token is an
        :class:`AdapterError` (no spec decode in that API). ``kv_connector``: what the worker's
        KV connector reports this step (:meth:`kv_connector_fields`' arguments), or None."""
        sampled_field: list = sampled
        if self.one_token_per_request:
            if any(len(s) > 1 for s in sampled):
                raise AdapterError(f"vLLM {self.version}'s ModelRunnerOutput takes one sampled "
                                   "token per request (no spec decode)")
            sampled_field = [s[0] if s else 0 for s in sampled]
        elif self._sampled_ndarray:
            import numpy as np

            sampled_field = [np.array(s, dtype=np.int32) for s in sampled]
        kwargs = dict(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                      sampled_token_ids=sampled_field, logprobs=None, prompt_logprobs_dict={},
                      pooler_output=[], num_nans_in_logits=None,
                      logprob_token_ids_cpu=None, logprobs_cpu=None)
        if "spec_token_ids" in self._mro_fields:
            kwargs["spec_token_ids"] = drafts
        if kv_connector is not None:
            kwargs.update(self.kv_connector_fields(**kv_connector))
        return call_supported(self.ModelRunnerOutput, **kwargs)

    def kv_connector_fields(self, finished_sending: set, finished_recving: set,
                            invalid_block_ids: set, failed_recving: set,
                            completed_jobs: list[int] | None = None) -> dict:
        """The ``ModelRunnerOutput`` fields that carry a step's KV connector report, as
        ``GPUModelRunner`` fills them from its connector's ``get_finished`` /
        ``get_block_ids_with_load_errors``: one ``KVConnectorOutput`` in
        ``kv_connector_output`` (``vllm/v1/outputs.py``, 0.10.1+; ``invalid_block_ids`` and
        ``failed_recving`` where it has them), or ``finished_sending`` / ``finished_recving`` on
        the output itself (0.9.x). ``completed_jobs``: vLLM's OffloadingConnector's finished
        transfer jobs, in ``kv_connector_worker_meta`` as its worker's
        ``build_connector_worker_meta`` reports them (``OffloadingWorkerMetadata``, None
        when none finished). Sets stay None when empty, as the runner leaves them. Raises
        :class:`AdapterError` where the output has neither (the capabilities refuse first)."""
        send = set(finished_sending) or None
        recv = set(finished_recving) or None
        kvo_cls = _try_import("vllm.v1.outputs:KVConnectorOutput")
        if "kv_connector_output" in self._mro_fields and kvo_cls is not None:
            kvo_fields = fields_of(kvo_cls)
            kw: dict = dict(finished_sending=send, finished_recving=recv)
            if invalid_block_ids and "invalid_block_ids" in kvo_fields:
                kw["invalid_block_ids"] = set(invalid_block_ids)
            if failed_recving and "failed_recving" in kvo_fields:
                kw["failed_recving"] = set(failed_recving)
            if completed_jobs and "kv_connector_worker_meta" in kvo_fields:
                meta_cls = _import("vllm.distributed.kv_transfer.kv_connector.v1.offloading."
                                   "common:OffloadingWorkerMetadata")
                kw["kv_connector_worker_meta"] = meta_cls(
                    completed_jobs={int(j): 1 for j in completed_jobs})
            return {"kv_connector_output": kvo_cls(**kw)}
        if "finished_recving" in self._mro_fields:
            return {"finished_sending": send, "finished_recving": recv}
        raise AdapterError(f"vLLM {self.version}'s ModelRunnerOutput has no KV connector report "
                           "(kv_connector_output or finished_recving)")

    def deliver_drafts(self, scheduler, req_ids: list[str], drafts: list[list[int]] | None) -> None:
        """0.10.2+: drafts reach the scheduler through ``update_draft_token_ids`` after
        ``update_from_output`` (``EngineCore.step``); older releases took them in the output."""
        if drafts is None or "spec_token_ids" in self._mro_fields:
            return
        if self.DraftTokenIds is not None and hasattr(scheduler, "update_draft_token_ids"):
            scheduler.update_draft_token_ids(self.DraftTokenIds(req_ids, drafts))

    def stat_logger(self, vllm_config):
        """The front end's stat loggers, as ``AsyncLLM`` builds them when stats are logged
        (``disable_log_stats: false``): ``StatLoggerManager(vllm_config, engine_idxs=[0])`` (0.10+,
        logging + Prometheus), else ``LoggingStatLogger`` and ``PrometheusStatLogger`` one by one
        (0.8/0.9). Returns a callable ``record(scheduler_stats)`` (``vllm/v1/metrics/loggers.py``;
        iteration stats come from the detokenizing output processor, which the lab does not run,
        so they are None). Raises :class:`AdapterError` where the release has no V1 stat
        loggers."""
        try:
            loggers_mod = importlib.import_module("vllm.v1.metrics.loggers")
        except Exception as exc:  # noqa: BLE001 - e.g. a slice without the metrics modules
            raise AdapterError(f"vLLM {self.version}'s stat loggers (vllm.v1.metrics.loggers, for "
                               f"config.disable_log_stats: false) do not import: "
                               f"{type(exc).__name__}: {exc}") from exc
        manager_cls = getattr(loggers_mod, "StatLoggerManager", None)
        if manager_cls is not None:
            manager = call_supported(manager_cls, vllm_config=vllm_config, engine_idxs=[0],
                                     custom_stat_loggers=None, enable_default_loggers=True)
            loggers = [manager]
        else:
            classes = [_try_import("vllm.v1.metrics.loggers:LoggingStatLogger"),
                       _try_import("vllm.v1.metrics.loggers:PrometheusStatLogger")]
            if None in classes:
                raise AdapterError(f"vLLM {self.version} has no V1 stat loggers "
                                   "(config.disable_log_stats: false)")
            loggers = [call_supported(cls, vllm_config=vllm_config, engine_index=0,
                                      engine_indexes=[0]) for cls in classes]

        def record(scheduler_stats) -> None:
            for lg in loggers:
                call_supported(lg.record, scheduler_stats=scheduler_stats, iteration_stats=None,
                               mm_cache_stats=None, engine_idx=0)
        return record

    @staticmethod
    def scheduler_stats(engine_core_outputs) -> list:
        """The ``SchedulerStats`` that ``update_from_output`` attached to its outputs
        (``dict[int, EngineCoreOutputs]`` 0.9+, one ``EngineCoreOutputs`` 0.8, a list of
        ``EngineCoreOutput`` before)."""
        if isinstance(engine_core_outputs, dict):
            outs = list(engine_core_outputs.values())
        elif isinstance(engine_core_outputs, (list, tuple)):
            outs = []
        else:
            outs = [engine_core_outputs]
        return [st for o in outs if (st := getattr(o, "scheduler_stats", None)) is not None]
