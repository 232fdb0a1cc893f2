"""The ``vllm-repro`` commands, one module each (typer lives here and in :mod:`vllm_repro.cli`,
nowhere else). Each module defines its command function(s) with typer's annotations;
:mod:`vllm_repro.cli` adds them to the app. Imports of the features stay inside the commands,
so that ``vllm-repro --help`` loads none of them.

The features never import this package or :mod:`vllm_repro.cli`; what the commands print with
is :mod:`vllm_repro.console`.
"""

import os

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
