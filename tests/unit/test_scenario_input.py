"""Bad scenario input: one line naming the file and the field, exit code 2, never a run."""

from __future__ import annotations

import json

import textwrap

import pytest

from vllm_repro.errors import InputError
from vllm_repro.scenario import load_scenario

GOOD = textwrap.dedent("""
    name: t
    config: {num_gpu_blocks: 8}
    requests:
      - {id: A, prompt_len: 10}
      - {id: B, prompt_len: 20, at_step: 2}
    events:
      - {at_step: 3, abort: [A]}
""")


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_good_scenario_loads_with_vllm_defaults(tmp_path):
    sc = load_scenario(write(tmp_path, GOOD))
    assert sc.config.block_size == 16 and sc.config.policy == "fcfs"
    assert [r.id for r in sc.requests] == ["A", "B"]
    assert sc.requests[1].at_step == 2


def test_async_scheduling_null_leaves_it_to_the_release_and_a_word_is_refused(tmp_path):
    """``async_scheduling: null`` is vLLM's own default (None: VllmConfig decides, as ``vllm
    serve`` without the flag); unset it stays the lab's false; anything but a bool or null is
    refused naming the field (catalog #45014 / #48245 run with null)."""
    sc = load_scenario(write(tmp_path, GOOD.replace(
        "config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, async_scheduling: null}")))
    assert sc.config.async_scheduling is None
    assert load_scenario(write(tmp_path, GOOD)).config.async_scheduling is False
    p = write(tmp_path, GOOD.replace("config: {num_gpu_blocks: 8}",
                                     "config: {num_gpu_blocks: 8, async_scheduling: maybe}"))
    with pytest.raises(InputError) as info:
        load_scenario(p)
    assert "config.async_scheduling" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("mutation, field, words", [
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, Num-Blocks: 3}"),
     "config", "not a vLLM config field name"),
    (("{id: A, prompt_len: 10}", "{id: A, prompt_len: -4}"), "requests[0].prompt_len", "greater than"),
    (("{id: B, prompt_len: 20, at_step: 2}", "{id: A, prompt_len: 20, at_step: 2}"),
     "requests[1].id", "used twice; give each request an id of its own"),
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, swap_space: 1e-1}"),
     "config.swap_space", "'1e-1' is read as text by YAML (a number with an exponent needs a "
     "dot there); write it as 0.1"),
    # YAML reads an id of 1 or true as a number or a bool: the same text quoted is the string
    (("{id: A, prompt_len: 10}", "{id: 1, prompt_len: 10}"), "requests[0].id",
     'write it in quotes ("1") so YAML reads it as a string'),
    (("{id: A, prompt_len: 10}", "{id: true, prompt_len: 10}"), "requests[0].id",
     'write it in quotes ("true")'),
    (("abort: [A]", "abort: [Z]"), "events[0].abort",
     "unknown request id 'Z'; use an id from requests[].id (A, B)"),
    (("abort: [A]", "abort: [a]"), "events[0].abort", "unknown request id 'a'; did you mean A?"),
    (("name: t", "name: t\nname: u"), "line", "appears twice"),
    (("config: {num_gpu_blocks: 8}", "config: {}"), "config.num_gpu_blocks",
     "missing required field"),
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, policy: lifo}"), "config.policy",
     "fcfs"),
    # a wrong type is refused, not coerced (true would become max_num_seqs 1)
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, max_num_seqs: true}"),
     "config.max_num_seqs", "write a whole number (no quotes)"),
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, enable_prefix_caching: yes_please}"),
     "config.enable_prefix_caching", "write true or false (no quotes)"),
    (("config: {num_gpu_blocks: 8}", 'config: {num_gpu_blocks: 8, max_num_seqs: "2"}'),
     "config.max_num_seqs", "valid integer"),
    # a quoted number passed through to vLLM would meet a bare TypeError there (newcomer P6)
    (("config: {num_gpu_blocks: 8}", 'config: {num_gpu_blocks: 8, num_scheduler_steps: "8"}'),
     "config.num_scheduler_steps", "write it without quotes"),
    # a mapping passed through: the line says what to write instead (newcomer P7)
    (("config: {num_gpu_blocks: 8}",
      "config: {num_gpu_blocks: 8, speculative_config: {model: '[ngram]'}}"),
     "config.speculative_config", "give its fields as plain config keys"),
    # a trigger past the run's end would silently never happen (a buggy release read as fixed)
    (("abort: [A]}", "abort: [A]}\nlimits: {max_steps: 2}"), "events[0].at_step",
     "past limits.max_steps 2"),
    # block 0 is the null block: one block leaves nothing to allocate
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 1}"), "config.num_gpu_blocks",
     "use a value of at least 2"),
    # per-step model behaviour (spec decode): ids, counts and the drafter's limit
    (("abort: [A]}", "abort: [A]}\nmodel: {spec_decode: {accept: {Z: [1, 0]}}}"),
     "model.spec_decode.accept", "unknown request id 'Z'"),
    (("abort: [A]}", "abort: [A]}\nmodel: {spec_decode: {accept: {A: [1, -1]}}}"),
     "spec_decode.accept", "A: give a count >= 0 for every step"),
    (("abort: [A]}", "abort: [A]}\nmodel: {spec_decode: {accept: {A: []}}}"),
     "spec_decode.accept", "non-empty list of counts"),
    (("abort: [A]}", "abort: [A]}\nmodel: {spec_decode: {propose: {A: [1]}}}"),
     "model.spec_decode.propose.A", "spec decode is off"),
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, num_speculative_tokens: 2}"
      "\nmodel: {spec_decode: {propose: {A: [1, 3]}}}"),
     "model.spec_decode.propose.A", "3 drafts, over config.num_speculative_tokens 2"),
    # the reasoning parser: a name (a string), read by the engine's StructuredOutputManager
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, reasoning_parser: 5}"),
     "config.reasoning_parser", "valid string"),
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, reasoning_parser: 'r1; x'}"),
     "config.reasoning_parser", "should match pattern"),
    (("config: {num_gpu_blocks: 8}", "config: {num_gpu_blocks: 8, reasoning_parser: qwen3}"),
     "config.reasoning_parser", "add `level: engine-core`"),
])
def test_bad_field_is_one_line_naming_file_and_field(tmp_path, mutation, field, words):
    old, new = mutation
    p = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(InputError) as info:
        load_scenario(p)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(str(p))
    assert field in msg
    assert words in msg


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such scenario file"):
        load_scenario(tmp_path / "nope.yaml")


def test_folder_is_not_a_scenario_file(tmp_path):
    with pytest.raises(InputError, match="is a folder, not a scenario file"):
        load_scenario(tmp_path)


def test_not_a_mapping(tmp_path):
    with pytest.raises(InputError, match="must hold a mapping"):
        load_scenario(write(tmp_path, "- just\n- a list\n"))


def test_prompt_plus_max_tokens_over_max_model_len_is_vllms_to_cap(tmp_path):
    """vLLM takes a request whose prompt plus max_tokens is over max_model_len (it caps the
    output, FINISHED_LENGTH_CAPPED): the lab follows that rule, not a stricter one of its own."""
    p = write(tmp_path, GOOD.replace("{num_gpu_blocks: 8}", "{num_gpu_blocks: 8, max_model_len: 15}"))
    sc = load_scenario(p)
    assert sc.requests[0].prompt_len + sc.requests[0].max_tokens > sc.config.max_model_len


def test_v0_engine_leaves_a_prompt_over_max_model_len_to_the_release(tmp_path):
    """At level v0-engine a prompt longer than max_model_len goes to the release's own front
    door (0.8.4+ refuses it, earlier V0 releases take it: the catalog's #8881)."""
    v0 = GOOD.replace("config: {num_gpu_blocks: 8}",
                      "level: v0-engine\nconfig: {num_gpu_blocks: 8, max_model_len: 15}")
    sc = load_scenario(write(tmp_path, v0))
    assert sc.requests[1].prompt_len == 20 > sc.config.max_model_len


def test_parallel_sampling_is_for_the_v0_engine_level(tmp_path):
    from vllm_repro.errors import InputError

    n2 = GOOD.replace("{id: A, prompt_len: 10}", "{id: A, prompt_len: 10, n: 2}")
    with pytest.raises(InputError, match=r"requests\[0\]\.n: parallel sampling is driven at "
                                         "level: v0-engine only"):
        load_scenario(write(tmp_path, n2))
    v0 = n2.replace("config: {num_gpu_blocks: 8}", "level: v0-engine\nconfig: {num_gpu_blocks: 8}")
    assert load_scenario(write(tmp_path, v0)).requests[0].n == 2


def run_refused(tmp_path, cli, text):
    """``vllm-repro run`` of ``text`` written to a file: asserts exit 2 and no report folder;
    returns (the file, stderr's non-blank lines)."""
    p = write(tmp_path, text)
    proc = cli("run", str(p), "--vllm", "0.10.2", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "r").exists(), "an input error must not produce a report"
    return p, [ln for ln in proc.stderr.splitlines() if ln.strip()]


@pytest.mark.parametrize("bad, fragment", [
    ("config: {num_gpu_blocks: 8, max_num_seqs: true}", "config.max_num_seqs"),
    ("requests:\n  - {id: A, prompt_len: -1}", "requests[0].prompt_len"),
])
def test_cli_exit_code_2_and_one_line(tmp_path, cli, bad, fragment):
    text = GOOD
    if bad.startswith("config"):
        text = text.replace("config: {num_gpu_blocks: 8}", bad)
    else:
        text = text.replace("  - {id: A, prompt_len: 10}", "  - {id: A, prompt_len: -1}")
    p, lines = run_refused(tmp_path, cli, text)
    assert len(lines) == 1, lines
    assert fragment in lines[0] and str(p) in lines[0]


def test_cli_missing_file_exit_2(tmp_path, cli):
    proc = cli("run", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2
    assert "no such scenario file" in proc.stderr


def test_cli_bad_version_string_exit_2(tmp_path, cli, root):
    proc = cli("run", str(root / "scenarios/vllm-23347-priority-preempt-scheduled.yaml"),
               "--vllm", "banana", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "'banana' is not a vLLM version number" in proc.stderr


def test_cli_usage_error_exit_2(cli):
    proc = cli("run", "--no-such-option")
    assert proc.returncode == 2
    assert "No such option" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_two_files_with_one_name_exit_2_before_running(tmp_path, cli, root):
    """Their reports would share reports/<name>/<version>/: refused, naming both files."""
    flagship = root / "scenarios/vllm-23347-priority-preempt-scheduled.yaml"
    twin = tmp_path / "twin.yaml"
    twin.write_text(flagship.read_text())
    proc = cli("run", str(flagship), str(twin), "--vllm", "0.10.2", "--reports", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert f"{twin}: name: 'vllm-23347-priority-preempt-scheduled' is also the name of {flagship}" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_v0_engine_level_takes_zero_gpu_blocks_and_cpu_blocks(tmp_path):
    """level: v0-engine: the fake V0 worker reports num_gpu_blocks (0 allowed: vLLM's own
    start-up check judges it) and num_cpu_blocks; elsewhere both are refused with the fix."""
    from vllm_repro.errors import InputError

    v0 = GOOD.replace("config: {num_gpu_blocks: 8}",
                      "level: v0-engine\nconfig: {num_gpu_blocks: 0, num_cpu_blocks: 0}")
    sc = load_scenario(write(tmp_path, v0))
    assert sc.level == "v0-engine" and sc.config.num_gpu_blocks == 0
    assert sc.config.num_cpu_blocks == 0
    with pytest.raises(InputError, match="config.num_cpu_blocks applies to level: v0-engine"):
        load_scenario(write(tmp_path, GOOD.replace("{num_gpu_blocks: 8}",
                                                   "{num_gpu_blocks: 8, num_cpu_blocks: 4}")))
    with pytest.raises(InputError, match="config.num_gpu_blocks is required at level: v0-engine"):
        load_scenario(write(tmp_path, GOOD.replace(
            "config: {num_gpu_blocks: 8}", "level: v0-engine\nconfig: {kv_cache_memory_bytes: 9}")))


def test_every_problem_is_listed_one_line_each_and_exit_2(tmp_path, cli):
    """Several bad fields: each on its own line naming the file, the field and the fix (not
    the first one and "(+N more)"), still exit 2 and no report."""
    text = GOOD.replace("config: {num_gpu_blocks: 8}",
                        "config: {num_gpu_blocks: 8, max_num_seqs: true, policy: lifo}")
    text = text.replace("{id: A, prompt_len: 10}", "{id: A, prompt_len: -1}")
    p, lines = run_refused(tmp_path, cli, text)
    assert len(lines) == 3, lines
    fields = ["config.max_num_seqs", "config.policy", "requests[0].prompt_len"]
    fixes = ["write a whole number (no quotes)", "use one of the values listed", "at least 1"]
    for field, fix in zip(fields, fixes):
        (line,) = [ln for ln in lines if f": {field}: " in ln]
        assert line.startswith(f"error: {p}: ") and fix in line, line
    assert not any("more)" in ln for ln in lines)
    # in one line where only one fits (a run's error record, a table cell): the count stays
    with pytest.raises(InputError) as info:
        load_scenario(p)
    assert str(info.value).endswith("(+2 more)") and len(info.value.lines()) == 3


def test_a_long_list_of_problems_is_cut_with_a_count(tmp_path):
    reqs = "".join(f"  - {{id: R{i}, prompt_len: -1}}\n" for i in range(30))
    p = write(tmp_path, "name: t\nconfig: {num_gpu_blocks: 8}\nrequests:\n" + reqs)
    with pytest.raises(InputError) as info:
        load_scenario(p)
    lines = info.value.lines()
    assert len(lines) == 21 and "requests[19].prompt_len" in lines[19]
    assert lines[20] == f"{p}: ... and 10 more problem(s) like these; fix the ones above and " \
                        "validate it again"


@pytest.mark.parametrize("field, typed, meant", [
    ("level", "v0-engin", "v0-engine"),
    ("level", "engine_core", "engine-core"),
    ("level", "schedular", "scheduler"),
    ("config.policy", "fcsf", "fcfs"),
])
def test_a_misspelled_choice_gets_did_you_mean(tmp_path, field, typed, meant):
    """As an unknown field name does: the value of a field with fixed choices names the nearest."""
    if field == "level":
        text = GOOD.replace("config: {num_gpu_blocks: 8}",
                            f"level: {typed}\nconfig: {{num_gpu_blocks: 8}}")
    else:
        text = GOOD.replace("config: {num_gpu_blocks: 8}",
                            f"config: {{num_gpu_blocks: 8, policy: {typed}}}")
    p = write(tmp_path, text)
    with pytest.raises(InputError) as info:
        load_scenario(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: {field}: ") and msg.endswith(f"did you mean {meant!r}?"), msg


def test_a_choice_far_from_every_value_lists_them_without_a_guess(tmp_path):
    p = write(tmp_path, GOOD.replace("config: {num_gpu_blocks: 8}",
                                     "level: gpu\nconfig: {num_gpu_blocks: 8}"))
    with pytest.raises(InputError) as info:
        load_scenario(p)
    msg = str(info.value)
    assert "'scheduler', 'engine-core' or 'v0-engine'" in msg and "did you mean" not in msg


def test_a_config_field_the_release_lacks_is_said_naming_the_file(tmp_path, capsys):
    """`config: {max_num_seq: 4}` passes the schema (config passes vLLM's own fields through)
    and is refused per release at run time: the line under the table names the file, the field
    and the fix, and reads as a schema error at load does (`error: FILE: FIELD: ...`), instead
    of 'the lab or the input failed'."""
    from vllm_repro.cli import main
    from vllm_repro.console import print_results
    from vllm_repro.lab import RunItem
    from vllm_repro.records import RunResult
    from vllm_repro.scenario.release_fields import unknown_passthrough
    from vllm_repro.verdict import judge

    from .test_release_fields import tree

    p = write(tmp_path, GOOD.replace("config: {num_gpu_blocks: 8}",
                                     "config: {num_gpu_blocks: 8, max_num_partial_prefils: 4}"))
    sc = load_scenario(p)
    refusal = unknown_passthrough(sc.config, "9.9.9", tree(tmp_path / "tree"))
    item = RunItem(sc, "9.9.9")
    item.result = RunResult.failed("input", refusal, scenario=sc.name, vllm="9.9.9")
    item.verdict = judge(sc, "9.9.9", item.result)
    assert print_results([item], as_json=False, sched_log=False) == 2
    said = [" ".join(line.split()) for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert said == [f"error: {p}: config.max_num_partial_prefils: vLLM 9.9.9 has no such field in "
                    "SchedulerConfig, CacheConfig, ParallelConfig, SpeculativeConfig; did you mean "
                    "max_num_partial_prefills? If not, check the name against that release's vllm/config, "
                    "or drop it for this release"], said
    # --json: the verdicts on stdout, parseable, and the same one line on stderr
    assert print_results([item], as_json=True, sched_log=False) == 2
    cap = capsys.readouterr()
    assert json.loads(cap.out)[0]["outcome"] == "error"
    said_json = [" ".join(line.split()) for line in cap.err.splitlines() if line.strip()]
    assert said_json == said, said_json
    # the same refusal from two releases is one line naming both, not the line twice
    items = []
    for version in ("9.9.8", "9.9.9"):
        item = RunItem(sc, version)
        refusal = unknown_passthrough(sc.config, version, tree(tmp_path / f"tree-{version}"))
        item.result = RunResult.failed("input", refusal, scenario=sc.name, vllm=version)
        item.verdict = judge(sc, version, item.result)
        items.append(item)
    assert print_results(items, as_json=False, sched_log=False) == 2
    said = [" ".join(line.split()) for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith(
        f"error: {p}: config.max_num_partial_prefils: vLLM 9.9.8, 9.9.9 have no such field in "), said
    # and its fix speaks of those releases, not of one
    assert said[0].endswith("check the name against those releases' vllm/config, or drop it for "
                            "these releases"), said
    # the prefix a load error has: the same file with a schema error, through the entry point
    bad = write(tmp_path, GOOD.replace("prompt_len: 10", "prompt_len: -4"))
    with pytest.raises(SystemExit) as out:
        main(["run", str(bad)], signals=False)
    assert out.value.code == 2
    load_line = " ".join(capsys.readouterr().err.split())
    assert load_line.startswith(f"error: {bad}: requests[0].prompt_len: "), load_line
