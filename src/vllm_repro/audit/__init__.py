"""The audit: DESIGN.md's invariants checked over a release's live vLLM objects every step,
and hooks that catch a bad free inside the call that makes it.

Runs inside release environments (standard library + what vLLM imports). Entry point:
:class:`Auditor` (the step loop's observer); codes in :mod:`vllm_repro.audit.codes`.
"""

from . import v0  # noqa: F401 - registers the v0-engine checks (audit/registry.py)
from .auditor import AuditStop, Auditor
from .codes import CODES

__all__ = ["Auditor", "AuditStop", "CODES"]
