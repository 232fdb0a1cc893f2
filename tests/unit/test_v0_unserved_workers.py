"""level: v0-engine refuses what the lab's fake V0 worker does not serve (multi-step scheduling
where the release's MultiStepModelRunner is not the one it answers for, V0 speculative decoding)
in one line naming the field, the release and what to do, instead of
running vLLM's engine against a worker that answers differently (without a release: the
engine config is read by attribute, as engine/v0.py reads vLLM's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_repro.engine.adapter.probes import RefusedByRelease
from vllm_repro.engine.v0 import V0Adapter, refuse_unserved_workers


def _config(steps=1, spec=None):
    return SimpleNamespace(scheduler_config=SimpleNamespace(num_scheduler_steps=steps),
                           speculative_config=spec)


def test_multi_step_is_refused_where_the_lab_does_not_serve_it():
    """A release whose MultiStepModelRunner is not the one the fake worker answers for (0.5.5's,
    without async output processing): one line naming field, release and fix."""
    with pytest.raises(RefusedByRelease) as e:
        refuse_unserved_workers(_config(steps=8), {"num_scheduler_steps": 8}, "0.5.5")
    assert str(e.value).startswith("config.num_scheduler_steps: 8: vLLM 0.5.5's multi-step "
                                   "scheduling runs its MultiStepWorker")
    assert str(e.value).endswith("use 1 (the default) at level: v0-engine")


def test_multi_step_runs_where_the_lab_serves_it():
    refuse_unserved_workers(_config(steps=8), {"num_scheduler_steps": 8}, "0.6.3.post1",
                            serves_multi_step=True)
    with pytest.raises(RefusedByRelease):  # spec decode stays refused
        refuse_unserved_workers(_config(steps=8, spec=object()), {"speculative_model": "x"},
                                "0.6.3.post1", serves_multi_step=True)


def test_single_step_and_releases_without_multi_step_or_spec_decode_run():
    refuse_unserved_workers(_config(steps=1), {}, "0.6.3.post1")
    # 0.4.x: no num_scheduler_steps, no speculative_config attribute at all
    refuse_unserved_workers(SimpleNamespace(scheduler_config=SimpleNamespace()), {}, "0.4.1")


def test_a_built_speculative_config_is_refused_naming_the_scenarios_field():
    with pytest.raises(RefusedByRelease) as e:
        refuse_unserved_workers(_config(spec=object()), {"speculative_model": "[ngram]",
                                                         "speculative_method": "ngram"}, "0.7.3")
    assert str(e.value).startswith("config.speculative_model: vLLM 0.7.3's V0 speculative "
                                   "decoding runs its SpecDecodeWorker")


def test_spec_fields_are_refused_before_vllm_builds_its_config(tmp_path):
    """The lab's num_speculative_tokens (V1's drafter) and vLLM's own V0 spec fields get the
    same one line, not the generic V1-only refusal nor vLLM's 'num_speculative_tokens must be
    provided' (which sent users back and forth between the two)."""
    adapter = object.__new__(V0Adapter)
    adapter.version, adapter.model_dir = "0.6.3.post1", tmp_path
    adapter.engine_args_fields = {"model", "disable_log_stats", "speculative_model",
                                  "num_speculative_tokens", "ngram_prompt_lookup_max"}
    for cfg, named in (({"num_speculative_tokens": 2, "speculative_method": "ngram"},
                        "config.num_speculative_tokens"),
                       ({"speculative_model": "[ngram]", "ngram_prompt_lookup_max": 3,
                         "speculative_method": "ngram"},
                        "config.speculative_model, config.ngram_prompt_lookup_max")):
        with pytest.raises(RefusedByRelease) as e:
            adapter.engine_args(cfg)
        assert str(e.value).startswith(f"{named}: vLLM 0.6.3.post1's V0 speculative decoding")
    # the lab's drafter choice alone (its default) asks for nothing
    assert adapter.engine_args({"speculative_method": "ngram", "num_speculative_tokens": None})


# ---- multi-step: what the fake worker answers at each engine step ---------------------------

class _Out:
    """SamplerOutput / CompletionSequenceGroupOutput / SequenceOutput stand-ins."""

    def __init__(self, *args, outputs=None):
        self.args, self.outputs = args, outputs


class _Ctx:
    """vLLM's SchedulerContext: append_output queues what the callback then processes."""

    def __init__(self):
        self.output_queue, self.processed = [], []
        self.seq_group_metadata_list = self.scheduler_outputs = None

    def append_output(self, outputs, seq_group_metadata_list, scheduler_outputs, is_async,
                      is_last_step, is_first_step_output):
        self.output_queue.append((outputs, is_last_step, is_first_step_output))


def _loop():
    from functools import partial

    from vllm_repro.engine.v0 import V0EngineLoop

    loop = object.__new__(V0EngineLoop)
    loop.adapter = SimpleNamespace(SamplerOutput=lambda outputs: _Out(outputs=outputs),
                                   CompletionSequenceGroupOutput=lambda s, p: _Out(s, p),
                                   SequenceOutput=lambda sid, tok, lp: _Out(sid, tok),
                                   Logprob=lambda x: x)
    loop.observer, loop.step, loop._multi, loop.multi_step = None, 0, None, True
    loop.token, loop.eos_at, loop.engine = 100, {}, SimpleNamespace()
    loop.scripted = {"A": [11, 12, 13, 14, 15, 16]}
    ctx = _Ctx()

    def process(ctx):
        if ctx.output_queue:
            ctx.processed.append(ctx.output_queue.pop(0))
    return loop, ctx, partial(process, ctx=ctx)


def _request(step, steps, callback):
    meta = SimpleNamespace(request_id="A", do_sample=True,
                           seq_data={0: SimpleNamespace(output_token_ids=[11])})
    return SimpleNamespace(seq_group_metadata_list=[meta], is_first_multi_step=step == 0,
                           is_last_step=step == steps - 1, async_callback=callback, num_steps=1)


def _tokens(sampler_output):
    return [s.args[1] for g in sampler_output.outputs for s in g.args[0]]


def test_multi_step_without_async_returns_every_steps_output_at_the_last_step():
    """MultiStepModelRunner without async output processing: one output per call until the
    last step, then every step's SamplerOutput in order, each step one token further."""
    loop, ctx, _ = _loop()
    answers = [loop.execute(_request(i, 4, None)) for i in range(4)]
    assert [len(a) for a in answers] == [1, 1, 1, 4]
    assert [_tokens(o) for o in answers[-1]] == [[12], [13], [14], [15]]


def test_multi_step_with_async_queues_earlier_steps_on_the_engines_context():
    """With async output processing, each step's output is queued on the engine's context
    (is_last_step False, is_first_step_output for step 0) and processed by the engine's callback
    before the next step samples; the last step returns only its own output."""
    loop, ctx, callback = _loop()
    answers = [loop.execute(_request(i, 4, callback)) for i in range(4)]
    assert [len(a) for a in answers] == [1, 1, 1, 1]
    assert [_tokens(o) for o in answers[-1]] == [[15]]
    assert [(_tokens(o[0]), last, first) for o, last, first in ctx.processed] == [
        ([12], False, True), ([13], False, False), ([14], False, False)]
    assert not ctx.output_queue
