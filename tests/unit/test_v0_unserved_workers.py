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
                       ({"speculative_model": "JackFram/llama-68m", "num_speculative_tokens": 3},
                        "config.num_speculative_tokens, config.speculative_model")):
        with pytest.raises(RefusedByRelease) as e:
            adapter.engine_args(cfg)
        assert str(e.value).startswith(f"{named}: vLLM 0.6.3.post1's V0 speculative decoding")
        assert 'speculative_model: "[ngram]"' in str(e.value)  # what is served instead
    # the lab's drafter choice alone (its default) asks for nothing
    assert adapter.engine_args({"speculative_method": "ngram", "num_speculative_tokens": None})


def test_the_ngram_drafter_reaches_vllms_engine_args(tmp_path):
    """speculative_model "[ngram]" is handed to the release's EngineArgs with the lab's
    num_speculative_tokens under EngineArgs' own name; vLLM builds the speculative config."""
    adapter = object.__new__(V0Adapter)
    adapter.version, adapter.model_dir = "0.6.3.post1", tmp_path
    adapter.engine_args_fields = {"model", "disable_log_stats", "speculative_model",
                                  "num_speculative_tokens", "ngram_prompt_lookup_max"}
    kw = adapter.engine_args({"speculative_model": "[ngram]", "ngram_prompt_lookup_max": 3,
                              "num_speculative_tokens": 3, "speculative_method": "ngram"})
    assert (kw["speculative_model"], kw["num_speculative_tokens"],
            kw["ngram_prompt_lookup_max"]) == ("[ngram]", 3, 3)
    assert "speculative_method" not in kw  # the lab's V1 drafter choice, no EngineArgs field


def test_ngram_spec_decode_runs_where_served_and_other_drafters_stay_refused():
    ngram = SimpleNamespace(num_speculative_tokens=3, ngram_prompt_lookup_max=3)
    cfg = {"speculative_model": "[ngram]", "num_speculative_tokens": 3}
    refuse_unserved_workers(_config(spec=ngram), cfg, "0.6.3.post1", serves_spec_decode=True)
    refuse_unserved_workers(_config(spec=SimpleNamespace(method="ngram")),  # 0.8.5's config
                            {"speculative_config": {"method": "ngram"}}, "0.8.5",
                            serves_spec_decode=True)
    with pytest.raises(RefusedByRelease):  # a release whose SpecDecodeWorker is not served
        refuse_unserved_workers(_config(spec=ngram), cfg, "0.5.4")
    draft = SimpleNamespace(num_speculative_tokens=3, ngram_prompt_lookup_max=0)
    with pytest.raises(RefusedByRelease):  # a draft model: its KV split and weights
        refuse_unserved_workers(_config(spec=draft), {"speculative_model": "m"}, "0.6.3.post1",
                                serves_spec_decode=True)


def test_spec_decode_is_served_by_the_releases_spec_decode_worker_source(tmp_path):
    """Probed from vllm/spec_decode/spec_decode_worker.py (ast): SpecDecodeWorker with
    _run_no_spec, _run_speculative_decoding_step and _create_output_sampler_list."""
    adapter = object.__new__(V0Adapter)
    adapter.vllm_file = tmp_path
    assert not adapter.serves_spec_decode()  # no spec_decode package (0.4.x)
    (tmp_path / "spec_decode").mkdir()
    src = tmp_path / "spec_decode" / "spec_decode_worker.py"
    methods = ["_run_no_spec", "_run_speculative_decoding_step", "_create_output_sampler_list"]
    src.write_text("class SpecDecodeWorker:\n" + "".join(
        f"    def {m}(self):\n        pass\n" for m in methods[:2]))
    assert not adapter.serves_spec_decode()
    src.write_text("class SpecDecodeWorker:\n" + "".join(
        f"    def {m}(self):\n        pass\n" for m in methods))
    assert adapter.serves_spec_decode()


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
    loop._line = SimpleNamespace(scheduled={})  # the step's trace line (V0EngineLoop.run)
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
    answers, scheduled = [], []
    for i in range(4):
        loop._line = SimpleNamespace(scheduled={})  # a new trace line each engine step
        answers.append(loop.execute(_request(i, 4, None)))
        scheduled.append(loop._line.scheduled)
    assert [len(a) for a in answers] == [1, 1, 1, 4]
    assert [_tokens(o) for o in answers[-1]] == [[12], [13], [14], [15]]
    # the batch's later steps run without schedule(): the trace counts them as decoding (the
    # first step's line is schedule()'s, which this test does not call)
    assert scheduled == [{}, {"A": 1}, {"A": 1}, {"A": 1}]


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


# ---- spec decode: what the fake SpecDecodeWorker answers per engine step -------------------

def _spec_loop(accept=None, disable_at=None):
    loop, _, _ = _loop()
    loop.multi_step, loop.spec_k, loop.spec_disable_at = False, 3, disable_at
    loop.accept, loop._verified = dict(accept or {}), {}
    loop.request_of = lambda rid: rid
    loop.adapter.worker_returns_list = True
    loop.scripted = {"A": [11, 12, 13, 14, 15, 16, 17, 18]}
    return loop


def _spec_request(lookahead=3, queue=2, outputs=None):
    outputs = outputs or {"A": 1, "B": 1}
    metas = [SimpleNamespace(request_id=rid, do_sample=True, num_speculative_tokens=None,
                             seq_data={i: SimpleNamespace(output_token_ids=[7] * n)})
             for i, (rid, n) in enumerate(outputs.items())]
    return SimpleNamespace(seq_group_metadata_list=metas, num_lookahead_slots=lookahead,
                           running_queue_size=queue, async_callback=None, num_steps=1)


def _by_position(answer):
    """[[token of each sequence] per SamplerOutput]; each group has one sample."""
    return [[g.args[0][0].args[1] for g in out.outputs] for out in answer]


def test_spec_decode_step_answers_one_output_per_position_with_minus_one_past_acceptance():
    """_create_output_sampler_list: k+1 SamplerOutputs (one per position), every sequence
    in each; A accepts all 3 drafts (its next 4 scripted tokens), B 1 draft then -1s."""
    loop = _spec_loop(accept={"B": [1, 0]})
    first = loop.execute(_spec_request())
    assert _by_position(first) == [[12, 100], [13, 100], [14, -1], [15, -1]]
    assert [g.args[0][0].args[0] for g in first[0].outputs] == [0, 1]  # seq ids, batch order
    # B's second verification accepts none: only its bonus token
    assert _by_position(loop.execute(_spec_request(outputs={"A": 5, "B": 3}))) == [
        [16, 100], [17, -1], [18, -1], [100, -1]]


def test_spec_decode_stops_the_list_where_every_sequence_is_rejected():
    loop = _spec_loop(accept={"A": 0, "B": 1})
    assert _by_position(loop.execute(_spec_request())) == [[12, 100], [-1, 100]]


def test_prefill_and_disabled_steps_answer_one_output_as_without_spec_decode():
    """_run_no_spec: no lookahead slots (a prefill), or the running queue at
    speculative_disable_by_batch_size (then each group's num_speculative_tokens is 0 for good)."""
    loop = _spec_loop()
    assert _by_position(loop.execute(_spec_request(lookahead=0))) == [[12, 100]]
    loop = _spec_loop(disable_at=2)
    req = _spec_request(queue=2)
    assert _by_position(loop.execute(req)) == [[12, 100]]
    assert [m.num_speculative_tokens for m in req.seq_group_metadata_list] == [0, 0]
    req.running_queue_size = 1
    assert _by_position(loop.execute(req)) == [[12, 100]]  # still off for these groups


def test_ngram_fields_fold_into_the_speculative_config_dict_where_engine_args_takes_only_it(
        tmp_path, monkeypatch):
    """0.8.5 on: EngineArgs has speculative_config (a dict) and no speculative_model; the flat
    n-gram fields go into the dict under SpeculativeConfig's own names (probed fields)."""
    import dataclasses

    import vllm_repro.engine.v0 as v0

    @dataclasses.dataclass
    class SpeculativeConfig:  # 0.8.5's names
        model: str | None = None
        method: str | None = None
        num_speculative_tokens: int | None = None
        prompt_lookup_max: int | None = None
        prompt_lookup_min: int | None = None

    monkeypatch.setattr(v0, "_try_import", lambda *c: SpeculativeConfig)
    adapter = object.__new__(V0Adapter)
    adapter.version, adapter.model_dir = "0.8.5", tmp_path
    adapter.engine_args_fields = {"model", "disable_log_stats", "speculative_config"}
    kw = adapter.engine_args({"speculative_model": "[ngram]", "ngram_prompt_lookup_max": 3,
                              "num_speculative_tokens": 3})
    assert kw["speculative_config"] == {"model": "[ngram]", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3}
    assert not {"speculative_model", "num_speculative_tokens"} & set(kw)
