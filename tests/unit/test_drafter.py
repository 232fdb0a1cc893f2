"""The model-based drafter's lab side (engine/drafter.py) without a release: the release's method
compiled from its file, the decision applied to the step's drafts, the zeroed drafts rejected
at the next verification, and the scenario field."""

from __future__ import annotations

import sys
import textwrap
import traceback
import typing
from types import SimpleNamespace

import pytest

from vllm_repro.engine import drafter as drafter_mod
from vllm_repro.engine.adapter.capability_probes import _literal_values
from vllm_repro.engine.fake_runner import FakeModelRunner

RUNNER_SRC = textwrap.dedent('''
    import torch  # the module's own imports are never run


    class GPUModelRunner:
        def other(self):
            return 1

        @torch.inference_mode
        def _input_fits_in_drafter(
            self, common_attn_metadata: CommonAttentionMetadata | None
        ) -> bool:
            if common_attn_metadata is None:
                return False
            assert self.speculative_config is not None
            return (common_attn_metadata.max_seq_len + self.num_spec_tokens
                    <= self.effective_drafter_max_model_len)
''')


@pytest.fixture
def fake_release(tmp_path, monkeypatch):
    """A package ``vllm.v1.worker.gpu_model_runner`` on sys.path whose module cannot import."""
    pkg = tmp_path / "vllm" / "v1" / "worker"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "v1", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "gpu_model_runner.py").write_text(RUNNER_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    return pkg / "gpu_model_runner.py"


def config(limit=128, num_spec=3, method="eagle"):
    spec = SimpleNamespace(method=method, num_speculative_tokens=num_spec,
                           draft_model_config=SimpleNamespace(max_model_len=limit),
                           use_eagle=lambda: method != "draft_model",
                           uses_draft_model=lambda: method == "draft_model")
    return SimpleNamespace(speculative_config=spec,
                           model_config=SimpleNamespace(max_model_len=256))


def test_the_release_method_runs_from_its_own_file_without_importing_it(fake_release):
    fits = drafter_mod.release_method("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
                                      "_input_fits_in_drafter")
    assert "vllm.v1.worker.gpu_model_runner" not in sys.modules  # torch never imported
    me = SimpleNamespace(speculative_config=object(), num_spec_tokens=3,
                         effective_drafter_max_model_len=128)
    assert fits(me, SimpleNamespace(max_seq_len=125)) is True
    assert fits(me, SimpleNamespace(max_seq_len=126)) is False
    assert fits(me, None) is False
    # its statements keep the release file's name and line numbers
    me.speculative_config = None
    with pytest.raises(AssertionError) as info:
        fits(me, SimpleNamespace(max_seq_len=1))
    frame = traceback.extract_tb(info.tb)[-1]
    assert frame.filename == str(fake_release)
    assert RUNNER_SRC.splitlines()[frame.lineno - 1].strip().startswith("assert self.speculative")
    assert drafter_mod.release_method("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
                                      "missing") is None
    assert drafter_mod.release_method("vllm.nowhere", "GPUModelRunner", "x") is None


def test_a_batch_past_the_drafter_limit_gets_zeroed_drafts_then_rejects_them(fake_release):
    d = drafter_mod.release_drafter(config(), SimpleNamespace(num_lookahead_tokens=3))
    assert d is not None and d.rule == drafter_mod.RULE
    drafts, rec = d.decide(["A", "B"], [40, 125], [[7, 7, 7], [7, 7]])
    assert drafts == [[7, 7, 7], [7, 7]] and rec.proposed == {"A": 3, "B": 2}
    assert rec.skipped is None and rec.num_lookahead_tokens == 3 and rec.max_seq_len == 125
    drafts, rec = d.decide(["A", "B"], [41, 126], [[7, 7, 7], []])
    assert drafts == [[0, 0, 0], [0, 0, 0]] and rec.proposed is None
    assert set(rec.skipped) == {"A", "B"} and "126 + 3" in rec.skipped["B"]
    assert d.zeroed == {"A", "B"}
    assert d.decide([], [], [])[1] is None  # an empty batch: the drafter does not run

    # the fake runner: a request whose drafts were zeroed accepts none of them
    runner = FakeModelRunner({"spec_decode": {"accept": {"A": 3}}}, 3)
    runner.drafter = d
    assert runner._accepted("A", 3) == 0
    d.decide(["A"], [50], [[7, 7, 7]])
    assert runner._accepted("A", 3) == 3


def test_no_release_rule_drafts_every_step(tmp_path, monkeypatch):
    monkeypatch.setattr(drafter_mod, "release_method", lambda *a: None)
    d = drafter_mod.ReleaseDrafter(config(limit=16), SimpleNamespace())
    drafts, rec = d.decide(["A"], [1000], [[5, 5, 5]])
    assert drafts == [[5, 5, 5]] and rec.rule is None and rec.proposed == {"A": 3}
    assert rec.num_lookahead_tokens is None  # a scheduler without the attribute


def test_ngram_and_no_spec_decode_have_no_model_drafter():
    assert drafter_mod.release_drafter(SimpleNamespace(speculative_config=None), None) is None
    ngram = SimpleNamespace(method="ngram", use_eagle=lambda: False, uses_draft_model=lambda: False)
    assert drafter_mod.release_drafter(SimpleNamespace(speculative_config=ngram), None) is None


def test_every_drafter_method_has_a_packaged_draft_config():
    import json
    from pathlib import Path

    import vllm_repro

    models = Path(vllm_repro.__file__).parent / "models"
    for method, folder in drafter_mod.DRAFT_MODELS.items():
        cfg = json.loads((models / folder / "config.json").read_text())
        assert cfg["vocab_size"] == 50272, method  # the target's (OPT) vocabulary
        assert cfg["architectures"], method


def test_speculative_methods_are_read_from_nested_literals():
    mtp = typing.Literal["deepseek_mtp", "mtp"]
    eagle = typing.Literal["eagle", "eagle3", mtp]
    method = typing.Literal["ngram", "draft_model", eagle]
    assert _literal_values(typing.Optional[method]) == {
        "ngram", "draft_model", "eagle", "eagle3", "deepseek_mtp", "mtp"}
    assert _literal_values(None) == set()


def test_the_scenario_takes_the_model_based_methods():
    from vllm_repro.scenario.schema import Scenario

    base = {"name": "x", "config": {"num_gpu_blocks": 8, "num_speculative_tokens": 2},
            "requests": [{"id": "A", "prompt_len": 4, "max_tokens": 2}]}
    for method in ("eagle", "eagle3", "mtp", "deepseek_mtp", "draft_model"):
        base["config"]["speculative_method"] = method
        assert Scenario.model_validate(base).config.speculative_method == method
    base["config"]["speculative_method"] = "medusa"
    with pytest.raises(ValueError, match="speculative_method"):
        Scenario.model_validate(base)
    # a drafter named without num_speculative_tokens would run with spec decode off: refused
    for key, value in (("speculative_method", "eagle"), ("speculative_max_model_len", 64)):
        config = {"num_gpu_blocks": 8, key: value}
        with pytest.raises(ValueError, match=f"config.{key}: .*add num_speculative_tokens"):
            Scenario.model_validate({**base, "config": config})


def test_every_packaged_draft_names_its_architectures():
    for folder in drafter_mod.DRAFT_MODELS.values():
        assert drafter_mod.DRAFT_ARCHS[folder], folder


def test_the_drafter_length_is_a_positive_count_for_model_based_drafters():
    from vllm_repro.scenario.schema import Scenario

    base = {"name": "x", "config": {"num_gpu_blocks": 8, "num_speculative_tokens": 2,
                                    "speculative_method": "eagle",
                                    "speculative_max_model_len": 64},
            "requests": [{"id": "A", "prompt_len": 4, "max_tokens": 2}]}
    assert Scenario.model_validate(base).config.speculative_max_model_len == 64
    base["config"]["speculative_max_model_len"] = 0
    with pytest.raises(ValueError, match="speculative_max_model_len"):
        Scenario.model_validate(base)


def test_scripted_skips_are_checked_against_the_release_rule(fake_release):
    from vllm_repro.engine.adapter.probes import RefusedByRelease

    runner = FakeModelRunner({"spec_decode": {"drafter_skipped_at": [2]}}, 3)
    runner.drafter = drafter_mod.release_drafter(config(limit=128), SimpleNamespace())
    drafter_mod.check_scripted_skips(runner, "eagle", "9.9")
    assert runner.drafter.scripted_skips == {2} and not runner.drafter_skipped_at
    assert runner.drafter.decide(["A"], [126], [[7, 7, 7]], step=2)[1].skipped  # agrees
    with pytest.raises(RefusedByRelease, match="drafter_skipped_at: step 2"):
        runner.drafter.decide(["A"], [40], [[7, 7, 7]], step=2)  # the release says it fits
    ngram = FakeModelRunner({"spec_decode": {"drafter_skipped_at": [2]}}, 3)
    with pytest.raises(RefusedByRelease, match="model-based"):
        drafter_mod.check_scripted_skips(ngram, "ngram", "9.9")


def test_scripted_skips_stand_for_an_inline_test_and_hand_back_no_drafts(fake_release):
    # a runner whose input_fits_in_drafter is inline (no method): the steps apply
    fake_release.write_text("class GPUModelRunner:\n    def execute_model(self):\n"
                            "        input_fits_in_drafter = True\n")
    runner = FakeModelRunner({"spec_decode": {"drafter_skipped_at": [1]}}, 2)
    drafter_mod.check_scripted_skips(runner, "ngram", "9.9")
    assert runner.drafter_skipped_at == {1}
    from vllm_repro.engine.adapter import Scheduled

    req = SimpleNamespace(num_tokens=4, num_output_tokens=0)
    ids, sampled, drafts = runner.execute(1, [Scheduled("A", 4, 0, [], True)], {"A": req})
    assert ids == ["A"] and sampled == [[100]] and drafts is None
    assert "drafter_skipped_at" in runner.draft_record.skipped["A"]
    # a runner that never skips: the steps do not apply
    fake_release.write_text("class GPUModelRunner:\n    pass\n")
    runner = FakeModelRunner({"spec_decode": {"drafter_skipped_at": [1]}}, 2)
    drafter_mod.check_scripted_skips(runner, "ngram", "9.9")
    assert not runner.drafter_skipped_at


def test_a_scripted_drafter_skip_past_the_runs_steps_is_refused():
    from vllm_repro.scenario.schema import Scenario

    d = {"name": "x", "config": {"num_gpu_blocks": 8, "num_speculative_tokens": 2,
                                 "speculative_method": "eagle"},
         "requests": [{"id": "A", "prompt_len": 4, "max_tokens": 2}],
         "model": {"spec_decode": {"drafter_skipped_at": [3]}}, "limits": {"max_steps": 100}}
    assert Scenario.model_validate(d).model.spec_decode.drafter_skipped_at == [3]
    d["model"]["spec_decode"]["drafter_skipped_at"] = [3, 99_999_999_999]
    with pytest.raises(ValueError, match="drafter_skipped_at: step 99999999999 is past "
                                         "limits.max_steps 100"):
        Scenario.model_validate(d)
