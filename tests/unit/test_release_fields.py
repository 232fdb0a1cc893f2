"""Pass-through ``config:`` fields against a release's source, before vLLM is imported."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import vllm_repro.lab as lab
from vllm_repro.scenario import parse_scenario
from vllm_repro.scenario.release_fields import release_config_fields, unknown_passthrough
from vllm_repro.sources.env import ReleaseEnv
from vllm_repro.verdict import exit_code

CONFIG = textwrap.dedent("""\
    from dataclasses import dataclass

    class _Base:
        inherited_field: int = 0

    @dataclass
    class SchedulerConfig:
        max_num_seqs: int = 128
        max_num_partial_prefills: int = 1

    @dataclass
    class CacheConfig(_Base):
        block_size: int = 16
        num_gpu_blocks_override: int | None = None

    class ParallelConfig:
        def __init__(self, pipeline_parallel_size: int = 1):
            self.pipeline_parallel_size = pipeline_parallel_size

    @dataclass
    class SpeculativeConfig:
        num_speculative_tokens: int = 0
    """)


def tree(tmp_path: Path, source: str = CONFIG, package: bool = True) -> Path:
    t = tmp_path / "tree"
    target = t / "vllm" / "config" / "scheduler.py" if package else t / "vllm" / "config.py"
    target.parent.mkdir(parents=True)
    target.write_text(source)
    return t


def scenario(**extra):
    return parse_scenario({"name": "t", "config": {"num_gpu_blocks": 8, **extra},
                           "requests": [{"id": "A", "prompt_len": 10}]})


@pytest.mark.parametrize("package", [True, False], ids=["vllm/config/", "vllm/config.py"])
def test_fields_of_the_four_classes_with_bases_and_init(tmp_path, package):
    fields = release_config_fields(tree(tmp_path, package=package))
    assert {"max_num_partial_prefills", "num_gpu_blocks_override", "inherited_field",
            "pipeline_parallel_size", "num_speculative_tokens"} <= fields
    assert "self" not in fields


@pytest.mark.parametrize("change", [
    ("class SpeculativeConfig:", "class SpeculativeConfigX:"),           # a class not found
    ("def __init__(self, pipeline_parallel_size: int = 1):",
     "def __init__(self, pipeline_parallel_size: int = 1, **kwargs):"),  # takes any name
    ("class CacheConfig(_Base):", "class CacheConfig(Elsewhere):"),      # a base not seen
])
def test_the_source_does_not_settle_it_so_nothing_is_refused(tmp_path, change):
    t = tree(tmp_path, CONFIG.replace(*change))
    assert release_config_fields(t) is None
    assert unknown_passthrough(scenario(max_num_partial_prefils=2).config, "9.9.9", t) is None


@pytest.mark.parametrize("cls", ["StructuredOutputsConfig", "DecodingConfig"])
def test_a_structured_output_field_goes_through_where_the_release_has_the_class(tmp_path, cls):
    """``backend`` (docs/scenarios.md's example) belongs to StructuredOutputsConfig, or to
    DecodingConfig on older releases, as the worker routes it: not refused before vLLM is
    imported (it was: only the first four classes were read); named among the classes the
    release has when misspelled."""
    t = tree(tmp_path, CONFIG + f"\n@dataclass\nclass {cls}:\n    backend: str = 'auto'\n")
    assert unknown_passthrough(scenario(backend="auto").config, "9.9.9", t) is None
    msg = unknown_passthrough(scenario(backand="auto").config, "9.9.9", t)
    assert "did you mean backend?" in msg and f"SpeculativeConfig, {cls};" in msg
    # a release with neither: the field is nobody's, and the classes named are the four
    msg = unknown_passthrough(scenario(backend="auto").config, "9.9.9", tree(tmp_path / "b"))
    assert msg.startswith("config.backend: vLLM 9.9.9 has no such field") and "Decoding" not in msg


def test_a_misspelled_field_is_named_with_the_one_it_likely_means(tmp_path):
    msg = unknown_passthrough(scenario(max_num_partial_prefils=2).config, "9.9.9", tree(tmp_path))
    assert msg.startswith("config.max_num_partial_prefils: vLLM 9.9.9 has no such field")
    assert "did you mean max_num_partial_prefills?" in msg
    assert unknown_passthrough(scenario(max_num_partial_prefills=2).config, "9.9.9",
                               tree(tmp_path / "b")) is None


def test_every_unknown_field_is_named_in_one_line_each_with_its_likely_misspelling(tmp_path):
    msg = unknown_passthrough(scenario(max_num_partial_prefils=2, foo_bar=1, blok_size=8).config,
                              "9.9.9", tree(tmp_path))
    assert msg == ("config: vLLM 9.9.9 has no fields max_num_partial_prefils (did you mean "
                   "max_num_partial_prefills?), foo_bar, blok_size (did you mean block_size?) in "
                   "SchedulerConfig, CacheConfig, ParallelConfig, SpeculativeConfig; check the "
                   "names against that release's vllm/config, or drop them for this release")
    # the known ones among them are not named
    assert "max_num_seqs" not in unknown_passthrough(
        scenario(max_num_seqs=2, foo_bar=1, baz=2).config, "9.9.9", tree(tmp_path / "b"))


def refused_without_a_worker(monkeypatch, env: ReleaseEnv, sc, tmp_path: Path) -> str:
    """``run_pairs`` of ``sc`` on ``env``: the refusal's message, with no worker started
    (vLLM never imported) and exit 2."""
    class NoWorker:
        def __init__(self, *a, **k):
            raise AssertionError("a worker was started (vLLM imported) for a refused scenario")

    monkeypatch.setattr(lab, "WorkerHandle", NoWorker)
    item = lab.RunItem(sc, env.version)
    lab.run_pairs([item], tmp_path / "r", prepare=lambda v: env)
    assert item.result.outcome == "error" and item.result.error.kind == "input"
    assert exit_code([item.verdict]) == 2
    return item.result.error.message


def test_run_pairs_refuses_it_without_starting_a_worker(tmp_path, monkeypatch):
    env = ReleaseEnv(version="9.9.9", tree=tree(tmp_path), root=tmp_path / "env")
    msg = refused_without_a_worker(monkeypatch, env, scenario(num_gpu_blocks_overide=50), tmp_path)
    assert "did you mean num_gpu_blocks_override?" in msg


# ---- level: v0-engine: the release's EngineArgs (vllm/engine/arg_utils.py) -------------------

ARG_UTILS = textwrap.dedent("""\
    from dataclasses import dataclass

    @dataclass
    class EngineArgs:
        model: str = "facebook/opt-125m"
        swap_space: float = 4
        preemption_mode: Optional[str] = None
        disable_async_output_proc: bool = False

    @dataclass
    class AsyncEngineArgs(EngineArgs):
        disable_log_requests: bool = False
    """)


def v0_tree(tmp_path: Path, source: str = ARG_UTILS) -> Path:
    t = tmp_path / "tree"
    (t / "vllm" / "engine").mkdir(parents=True)
    (t / "vllm" / "engine" / "arg_utils.py").write_text(source)
    return t


def v0_scenario(**extra):
    return parse_scenario({"name": "t", "level": "v0-engine",
                           "config": {"num_gpu_blocks": 8, **extra},
                           "requests": [{"id": "A", "prompt_len": 10}]})


def test_v0_a_misspelled_engine_arg_is_refused_from_the_source_with_the_one_it_means(tmp_path):
    t = v0_tree(tmp_path)
    msg = unknown_passthrough(v0_scenario(preemtion_mode="swap").config, "0.6.3.post1", t, "v0-engine")
    assert msg == ("config.preemtion_mode: vLLM 0.6.3.post1 has no EngineArgs field "
                   "'preemtion_mode' (level: v0-engine); did you mean preemption_mode?")
    far = unknown_passthrough(v0_scenario(kv_connector="x").config, "0.6.3.post1", t, "v0-engine")
    assert far.endswith("; drop it for this release")
    # a subclass's field is no EngineArgs field; the known ones and the drafter's folded ones pass
    assert "disable_log_requests" in unknown_passthrough(
        v0_scenario(disable_log_requests=True).config, "0.6.3.post1", t, "v0-engine")
    assert unknown_passthrough(v0_scenario(preemption_mode="swap", swap_space=1,
                                           speculative_model="[ngram]").config,
                               "0.6.3.post1", t, "v0-engine") is None


def test_v0_every_unknown_engine_arg_is_named_in_one_line(tmp_path):
    t = v0_tree(tmp_path)
    msg = unknown_passthrough(v0_scenario(preemtion_mode="swap", kv_connector="x", swap_space=1)
                              .config, "0.6.3.post1", t, "v0-engine")
    assert msg == ("config: vLLM 0.6.3.post1 has no EngineArgs fields preemtion_mode (did you "
                   "mean preemption_mode?), kv_connector at level: v0-engine; correct the "
                   "misspelt names, drop the others for this release")
    both = unknown_passthrough(v0_scenario(kv_connector="x", foo=1).config, "0.6.3.post1", t,
                               "v0-engine")
    assert both.endswith("has no EngineArgs fields kv_connector, foo at level: v0-engine; drop them for "
                         "this release")


def test_v0_the_source_does_not_settle_it_so_the_worker_decides(tmp_path):
    assert unknown_passthrough(v0_scenario(preemtion_mode="swap").config, "0.6.3.post1",
                               tmp_path / "no-tree", "v0-engine") is None
    t = v0_tree(tmp_path, ARG_UTILS.replace("class EngineArgs:", "class EngineArgs(Base):"))
    assert unknown_passthrough(v0_scenario(preemtion_mode="swap").config, "0.6.3.post1", t,
                               "v0-engine") is None


def test_run_pairs_refuses_a_v0_typo_without_starting_a_worker(tmp_path, monkeypatch):
    env = ReleaseEnv(version="0.6.3.post1", tree=v0_tree(tmp_path), root=tmp_path / "env")
    msg = refused_without_a_worker(monkeypatch, env, v0_scenario(disable_async_output_procs=True),
                                   tmp_path)
    assert "did you mean disable_async_output_proc?" in msg


def test_the_workers_own_check_names_every_unknown_field_too():
    """Where the source does not settle it, the worker refuses after importing vLLM: in the same
    words, every unknown field named."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from vllm_repro.engine.adapter.build import BuildMixin
    from vllm_repro.engine.adapter.probes import RefusedByRelease

    @dataclass
    class SchedulerConfig:
        max_num_seqs: int = 128

    @dataclass
    class CacheConfig:
        block_size: int = 16

    adapter = BuildMixin()
    adapter.version, adapter.config_mod = "9.9.9", SimpleNamespace(SchedulerConfig=SchedulerConfig,
                                                                   CacheConfig=CacheConfig)
    assert adapter.route_passthrough({"passthrough": {"max_num_seqs": 4}}) == {
        "SchedulerConfig": {"max_num_seqs": 4}}
    with pytest.raises(RefusedByRelease) as err:
        adapter.route_passthrough({"passthrough": {"max_num_seqz": 4, "blok_size": 8,
                                                   "block_size": 8}})
    assert str(err.value).startswith(
        "config: vLLM 9.9.9 has no fields max_num_seqz (did you mean max_num_seqs?), blok_size "
        "(did you mean block_size?) in SchedulerConfig, CacheConfig, ")
