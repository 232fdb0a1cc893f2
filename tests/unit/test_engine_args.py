"""A V0 pass-through value against the release's ``EngineArgs`` annotation
(``engine/engine_args.py``): what vLLM's own command line could never have produced is refused."""

from __future__ import annotations

from typing import Literal, Optional, Union

import pytest

from vllm_repro.engine.engine_args import engine_arg_refusal, engine_arg_type_error

BlockSize = Literal[1, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("key, value, annotation, want", [
    # a truthy string would turn the setting on: "no" is not false
    ("disable_async_output_proc", "no", bool, "write true or false (without quotes)"),
    ("swap_space", True, float, "write a number"),
    ("preemption_mode", True, Optional[str], "write a string"),
    ("num_scheduler_steps", 2.5, int, "write a whole number"),
    ("num_scheduler_steps", False, int, "write a whole number"),
    ("block_size", 15, Optional[BlockSize], "write one of 1, 8, 16, 32, 64, 128"),
    ("block_size", True, BlockSize, "write one of 1, 8, 16, 32, 64, 128"),  # True == 1, still no
    ("scheduling_policy", "lifo", Literal["fcfs", "priority"], "write one of 'fcfs', 'priority'"),
])
def test_a_value_the_annotation_does_not_take_is_refused_in_one_line(key, value, annotation, want):
    msg = engine_arg_type_error(key, value, annotation, "0.8.5")
    shown = {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) \
        else repr(value)  # (as the scenario's YAML wrote it)
    assert msg.startswith(f"config.{key}: {shown} does not fit EngineArgs.{key} (")
    assert " of vLLM 0.8.5; " in msg
    assert msg.endswith(want) and "\n" not in msg


@pytest.mark.parametrize("value, annotation", [
    (True, bool), (False, bool), (1, float), (1.5, float), (4, int), ("swap", Optional[str]),
    (None, Optional[int]), (16, Optional[BlockSize]), ("priority", Literal["fcfs", "priority"]),
    (3, Union[int, str]), (3, int | None),
    # not a kind checked here: left to vLLM
    ({"a": 1}, dict), ("x", "SomeForwardRef"), (object(), Union[int, dict]),
])
def test_a_value_that_fits_or_an_annotation_not_checked_passes(value, annotation):
    assert engine_arg_type_error("f", value, annotation, "0.8.5") is None


def test_a_missing_field_names_the_one_it_likely_misspells_else_says_drop_it():
    known = {"preemption_mode", "swap_space", "disable_async_output_proc"}
    assert engine_arg_refusal("preemtion_mode", "0.6.3.post1", known).endswith(
        "(level: v0-engine); did you mean preemption_mode?")
    assert engine_arg_refusal("kv_connector", "0.6.3.post1", known).endswith(
        "(level: v0-engine); drop it for this release")


def test_a_number_for_a_text_field_is_given_as_its_text_as_the_command_line_would():
    from vllm_repro.engine.engine_args import as_command_line_text

    assert as_command_line_text(0.7, Optional[str]) == "0.7"  # show_hidden_metrics_for_version
    assert as_command_line_text(1.0, str) == "1.0"            # revision
    assert as_command_line_text(7, Optional[str]) == "7"
    # a field that takes the number, a Literal of strings, a flag, a value of no checked kind: kept
    assert as_command_line_text(4, float) == 4
    assert as_command_line_text(3, Union[int, str]) == 3
    assert as_command_line_text(7, Literal["swap", "recompute"]) == 7
    assert as_command_line_text(True, Optional[str]) is True
    assert as_command_line_text(7, dict) == 7
