"""The ``vllm-repro`` commands, one module each (typer lives here and in :mod:`vllm_repro.cli`,
nowhere else). Each module defines its command function(s) with typer's annotations;
:mod:`vllm_repro.cli` adds them to the app. Imports of the features stay inside the commands,
so that ``vllm-repro --help`` loads none of them.

The features never import this package or :mod:`vllm_repro.cli`; what the commands print with
is :mod:`vllm_repro.console`.
"""
