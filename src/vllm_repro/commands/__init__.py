"""The ``vllm-repro`` commands, one module each (typer lives here and in :mod:`vllm_repro.cli`,
nowhere else). Each module defines its command function(s) with typer's annotations;
:mod:`vllm_repro.cli` adds them to the app. Imports of the features stay inside the commands,
so that ``vllm-repro --help`` loads none of them.

The features never import this package or :mod:`vllm_repro.cli`; what the commands print with
is :mod:`vllm_repro.console`.
"""

import os
from enum import Enum

#: the ``--cold`` option's help (run, verify, bisect, fuzz, catalog run)
COLD_HELP = ("Start every engine worker cold, without the release's warm parent "
             "(docs/warm-runs.md; VLLM_REPRO_WARM=off does the same).")


def warm_setting(cold: bool) -> None:
    """``--cold``: ``VLLM_REPRO_WARM=off`` for this command and every process it starts (the
    fuzzer's search processes); otherwise the warm settings are checked now (a bad value is
    exit 2, before any run: the idle time and the parents' limit are read only when a parent
    is started, which a run served by a running parent never does)."""
    from ..engine.warm_client import SETTING, enabled, idle_seconds, max_parents

    if cold:
        os.environ[SETTING] = "off"
    elif enabled():
        idle_seconds()
        max_parents()


# ---- the options that take one of a fixed set: `--help` lists the choices, a typo is exit 2 ----
class Tree(str, Enum):
    """``--tree``: which of a release's trees runs (:data:`vllm_repro.sources.prepare.TREES`)."""

    full = "full"
    slice = "slice"
    auto = "auto"


class Level(str, Enum):
    """``--level``: the level a fuzzer's scenarios run at (a scenario's ``level``)."""

    scheduler = "scheduler"
    engine_core = "engine-core"
    v0_engine = "v0-engine"


class Policy(str, Enum):
    """``--policy``: vLLM's scheduling policy (``SchedulerConfig.policy``)."""

    fcfs = "fcfs"
    priority = "priority"


class Mode(str, Enum):
    """``matrix --mode`` (:data:`vllm_repro.matrix.MODES`)."""

    plain = "plain"
    async_ = "async"
    spec = "spec"
    prefix_caching = "prefix-caching"


def value(choice):
    """An option's Enum member as its plain string (``None`` stays ``None``)."""
    return choice.value if isinstance(choice, Enum) else choice
