"""Model-based drafters (EAGLE, EAGLE-3, MTP, a draft model): the release's own decisions around
a forward pass the lab fakes.

A model-based drafter runs a model on the GPU after the target's forward pass; that forward
pass is the lab's (the draft tokens come from the scenario: ``model.draft_tokens``,
``model.spec_decode.propose``, as for the n-gram drafter). What is not tensor math runs as the
release ships it:

- the configs: the release's ``SpeculativeConfig.__post_init__`` builds the draft
  ``ModelConfig`` from a packaged config-only draft model (:data:`DRAFT_MODELS`, under
  ``src/vllm_repro/models``: no weights, no hub), wraps an EAGLE head in its ``EAGLEConfig``,
  turns a DeepSeek-V3 config into ``deepseek_mtp``, and sets the drafter's ``max_model_len``;
  ``VllmConfig`` accepts or refuses the method with async scheduling
  (``adapter/build.py:_draft_model_kwargs``);
- the lookahead slots: the release's ``Scheduler`` reserves ``num_lookahead_tokens`` KV slots
  past each request's scheduled tokens (``allocate_slots``); the record shows the scheduler's
  own figure (:attr:`ReleaseDrafter.num_lookahead_tokens`);
- whether the drafter runs in a step: ``GPUModelRunner._input_fits_in_drafter``
  (``vllm/v1/worker/gpu_model_runner.py``; compiled from the release's file, not imported:
  :func:`release_method`), called unbound on a stand-in of the runner that
  carries the attributes ``GPUModelRunner.__init__`` sets for it (``speculative_config``,
  ``num_spec_tokens``, ``effective_drafter_max_model_len``: the draft model config's
  ``max_model_len``, else the target's) and a stand-in of the step's
  ``CommonAttentionMetadata`` (``max_seq_len``: the batch's longest sequence, drafts
  included). Where it answers False, ``GPUModelRunner.sample_tokens`` does not run the drafter
  and zeroes every request's drafts (``_copy_draft_token_ids_to_cpu(zeros_only=True)``): the
  scheduler is handed ``num_spec_tokens`` zeros per request, which the next verification
  rejects (:meth:`ReleaseDrafter.decide`). A release without that method (the V2 runner's
  speculator of 0.34, which clamps positions on the GPU; 0.20-0.22, where the same test is
  inline in ``sample_tokens``) drafts every step, with a one-line note.

Runs inside the release environment (standard library + vLLM).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from ..records import DraftRecord
from .draft_models import DRAFT_ARCHS, DRAFT_MODELS  # noqa: F401 - re-exported

#: the release's method that decides whether the drafter runs in a step
RULE = "vllm/v1/worker/gpu_model_runner.py:GPUModelRunner._input_fits_in_drafter"


class ReleaseDrafter:
    """The release's drafter decisions for one run (see the module docstring).

    ``vllm_config``: the engine's config (its ``speculative_config`` set); ``scheduler``: the
    release's scheduler (its ``num_lookahead_tokens``); ``notes``: where the one-line note goes
    when the release has no callable rule (None: the engine log, ``vllm-repro: note: ...``)."""

    def __init__(self, vllm_config, scheduler, notes: list[str] | None = None):
        spec = vllm_config.speculative_config
        self.method = str(spec.method)
        self.num_spec = int(spec.num_speculative_tokens or 0)
        look = getattr(scheduler, "num_lookahead_tokens", None)
        self.num_lookahead_tokens = int(look) if look is not None else None
        target_len = vllm_config.model_config.max_model_len
        draft = getattr(spec, "draft_model_config", None)
        # GPUModelRunner.__init__: the draft model config's max_model_len, else the target's
        limit = getattr(draft, "max_model_len", None) if draft is not None else None
        self.drafter_max_model_len = int(limit if limit is not None else target_len)
        self._fits = release_method("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
                                    "_input_fits_in_drafter")
        #: the stand-in ``self`` of the release's method: what GPUModelRunner.__init__ sets
        self._runner = SimpleNamespace(speculative_config=spec, num_spec_tokens=self.num_spec,
                                       effective_drafter_max_model_len=self.drafter_max_model_len)
        self.rule = RULE if callable(self._fits) else None
        if self.rule is None:
            note = (f"speculative_method {self.method}: the release has no "
                    "GPUModelRunner._input_fits_in_drafter to call; the drafter runs every step")
            if notes is not None:
                notes.append(note)
            else:  # the engine log, as the worker-side state's notes
                print(f"vllm-repro: note: {note}", file=sys.stderr)
        #: request ids whose last drafts were the runner's zeros (rejected at verification)
        self.zeroed: set[str] = set()
        #: steps the scenario says the drafter's input does not fit, checked against the
        #: release's answer (:func:`check_scripted_skips`)
        self.scripted_skips: set[int] = set()

    def fits(self, max_seq_len: int) -> bool:
        """The release's answer: whether the drafter runs after a batch whose longest sequence
        is ``max_seq_len`` tokens (True where the release has no such rule)."""
        if self._fits is None:
            return True
        meta = SimpleNamespace(max_seq_len=max_seq_len)
        return bool(self._fits(self._runner, meta))

    def decide(self, req_ids: list[str], seq_lens: list[int],
               drafts: list[list[int]], step: int = 0) -> tuple[list[list[int]], DraftRecord | None]:
        """The drafts handed on after a step, and its :class:`DraftRecord` (None for an empty
        batch: the drafter does not run).

        ``req_ids`` / ``seq_lens``: the batch's requests and their sequence lengths after this
        step's scheduled tokens (``num_computed_tokens + num_scheduled_tokens``, as
        ``GPUModelRunner._prepare_inputs`` computes ``seq_lens``); ``drafts``: what the
        scenario's drafter proposes for each (empty: none, e.g. a partial prefill). Where the
        release's rule says the input does not fit the drafter, every request of the batch gets
        ``num_spec_tokens`` zeros instead (the runner's zeroed draft buffer)."""
        if not req_ids:
            return drafts, None
        max_seq_len = max(seq_lens, default=0)
        record = DraftRecord(self.method, num_lookahead_tokens=self.num_lookahead_tokens,
                             rule=self.rule, max_seq_len=max_seq_len,
                             drafter_max_model_len=self.drafter_max_model_len)
        fits = self.fits(max_seq_len)
        if step in self.scripted_skips and fits:
            from .adapter.probes import RefusedByRelease

            raise RefusedByRelease(
                f"model.spec_decode.drafter_skipped_at: step {step}, where the release's "
                f"GPUModelRunner._input_fits_in_drafter says the drafter's input fits (max_seq_len "
                f"{max_seq_len} + {self.num_spec} <= {self.drafter_max_model_len}); fix the steps")
        if fits:
            self.zeroed.difference_update(req_ids)
            record.proposed = {rid: len(d) for rid, d in zip(req_ids, drafts)}
            return drafts, record
        reason = (f"max_seq_len {max_seq_len} + {self.num_spec} draft tokens > drafter "
                  f"max_model_len {self.drafter_max_model_len}: drafts zeroed")
        self.zeroed.update(req_ids)
        record.skipped = {rid: reason for rid in req_ids}
        return [[0] * self.num_spec for _ in req_ids], record


def release_method(module: str, cls: str, name: str):
    """The release's method ``cls.name`` of ``module``, compiled from the module's own source
    file (its statements and line numbers: a traceback points into the release's file),
    without importing the module; None where the file, the class or the method is absent.

    ``gpu_model_runner`` is not imported: under the emulated CUDA platform its imports build
    Triton kernel configurations (``vllm/model_executor/layers/mamba/ops``) that fail without
    Triton, and it costs ~10 s. The method is compiled alone, its annotations dropped (they
    name classes of the module's imports); a method whose body uses a module-level name fails
    at its call with ``NameError``, a lab error."""
    import ast

    from .adapter.probes import class_in_source

    found = class_in_source(module, cls)
    if found is not None:
        origin, _, node = found
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == name:
                item.decorator_list = []
                item.returns = None
                a = item.args
                for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                    arg.annotation = None
                namespace: dict = {"__name__": module}
                exec(compile(ast.Module([item], []), origin, "exec"), namespace)  # noqa: S102
                return namespace[name]
    return None


def check_scripted_skips(runner, method: str | None, version: str) -> None:
    """What ``model.spec_decode.drafter_skipped_at`` means on this release (the steps at which
    the model runner's ``input_fits_in_drafter`` is false):

    - the runner tests it inline (0.11 to 0.22: no method to call): the script stands for that
      test, and the runner hands the scheduler no draft token ids at those steps;
    - the release's ``GPUModelRunner._input_fits_in_drafter`` decides (0.24 to 0.33), with a
      model-based drafter: the release's answer is used and each scripted step is checked
      against it (:meth:`ReleaseDrafter.decide`; a disagreement is an input error); with an
      n-gram drafter it is refused (the lab does not run that drafter's rule);
    - the runner never skips the drafter (0.10.x; 0.34's V2 runner clamps draft positions on
      the GPU instead): the steps do not apply, with a note in the engine log.

    Raises :class:`~vllm_repro.engine.adapter.RefusedByRelease`. Sets ``runner``'s drafter
    method name for the step records."""
    import importlib.util

    from .adapter.probes import RefusedByRelease

    runner.spec_method = method
    if not getattr(runner, "drafter_skipped_at", None):
        return
    field = "model.spec_decode.drafter_skipped_at"
    if release_method("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
                      "_input_fits_in_drafter") is not None:
        if getattr(runner, "drafter", None) is None:
            raise RefusedByRelease(f"{field}: vLLM {version} decides it with "
                                   "GPUModelRunner._input_fits_in_drafter, which the lab runs for "
                                   "model-based drafters only (speculative_method eagle, eagle3, "
                                   "mtp, draft_model); use one, or drop it")
        runner.drafter.scripted_skips = set(runner.drafter_skipped_at)
        runner.drafter_skipped_at = set()
        return
    try:
        spec = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner")
        text = open(spec.origin, encoding="utf-8").read() if spec and spec.origin else ""
    except (ImportError, ValueError, OSError):
        text = ""
    if "input_fits_in_drafter" not in text:
        print(f"vllm-repro: note: {field}: vLLM {version}'s model runner drafts after every step "
              "(no input_fits_in_drafter): the scripted steps do not apply", file=sys.stderr)
        runner.drafter_skipped_at = set()


def release_drafter(vllm_config, scheduler, notes: list[str] | None = None) -> ReleaseDrafter | None:
    """A :class:`ReleaseDrafter` where the config's speculative method runs a draft model on the
    GPU (``SpeculativeConfig.use_eagle()`` or ``uses_draft_model()``, the release's own
    predicates), else None (no spec decode, n-gram drafters)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    model_based = False
    for name in ("use_eagle", "uses_draft_model"):
        fn = getattr(spec, name, None)
        if callable(fn):
            try:
                model_based = model_based or bool(fn())
            except Exception:  # noqa: BLE001 - a predicate the release cannot answer here
                continue
    if not model_based and getattr(spec, "method", None) not in DRAFT_MODELS:
        return None
    return ReleaseDrafter(vllm_config, scheduler, notes)


__all__ = ["DRAFT_MODELS", "DRAFT_ARCHS", "RULE", "ReleaseDrafter", "release_drafter",
           "release_method", "check_scripted_skips"]
