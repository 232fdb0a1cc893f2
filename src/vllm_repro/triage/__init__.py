"""Crash-log triage: a vLLM crash log -> :class:`TriageReport` (+ a draft scenario).

``triage_log(path)`` streams the log through :class:`~.scan.LogScanner` (bounded memory) and
:func:`~.analyze.analyze`; ``draft_scenario`` turns the ``dump_input.py`` dump into a scenario.
"""

from .analyze import TriageReport
from .core import scan_log, triage_log

__all__ = ["TriageReport", "scan_log", "triage_log"]
