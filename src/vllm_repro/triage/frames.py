"""Traceback frames and what counts as a vLLM module.

A frame's file is a *vLLM module* when it lies inside the ``vllm`` package: the path from the
last directory named ``vllm`` that is a package root (``site-packages/vllm/...``, a source
checkout ``.../vllm/vllm/...``, or a relative ``vllm/...``). Files that only live somewhere
under a directory named vllm are not: a venv inside a vLLM checkout
(``~/vllm/.venv/lib/.../site-packages/torch/...``), vLLM's caches
(``~/.cache/vllm/torch_compile_cache/...``), a checkout's ``tests/`` or ``benchmarks/``, or a
module merely *named* vllm (``langchain/llms/vllm.py``). Plugin packages (``vllm_ascend/...``)
are reported separately.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# top-level folders of a vLLM *checkout* that are not part of the installed package
_CHECKOUT_ONLY = frozenset({"tests", "benchmarks", "examples", "docs", "csrc", "build", "tools",
                            "cmake", "requirements", "docker", "dist"})
_PKG_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLUGIN_ROOT = re.compile(r"vllm_[A-Za-z0-9_]+")
_SITE = ("site-packages", "dist-packages")
# folders another project keeps its vLLM integration in (lmcache/integration/vllm/...): a
# ``vllm`` folder under one of these is that project's code, not the vLLM package
_INTEGRATION_PARENTS = frozenset({"integration", "integrations", "contrib", "adapters", "llms",
                                  "providers", "third_party_integrations"})


@dataclass
class Frame:
    """One traceback frame: ``file`` as printed, ``line`` (1-based, None when not printed),
    ``function``; ``module`` is the vLLM-normalised path (``vllm/v1/core/block_pool.py``) or
    None; ``plugin`` the normalised path for a vLLM plugin package (``vllm_ascend/...``)."""

    file: str
    line: int | None
    function: str
    module: str | None = None
    plugin: str | None = None

    @classmethod
    def make(cls, file: str, line: int | None, function: str) -> "Frame":
        return cls(file, line, function, vllm_module(file), plugin_module(file))

    def as_dict(self) -> dict:
        return {"module": self.module, "function": self.function, "line": self.line}


def _parts(path: str) -> list[str]:
    return [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]


def _package_tail(parts: list[str], i: int) -> str | None:
    """``parts[i:]`` joined when they look like a module of the package rooted at parts[i]."""
    rest = parts[i + 1:]
    if not rest or not rest[-1].endswith(".py"):
        return None
    if rest[0] in _CHECKOUT_ONLY or any(p in _SITE for p in rest):
        return None
    if not all(_PKG_PART.fullmatch(p) for p in rest[:-1]):
        return None
    if not _PKG_PART.fullmatch(rest[-1][:-3]):
        return None
    if i > 0 and parts[i - 1].startswith("."):  # ~/.cache/vllm, ~/.config/vllm: not a package
        return None
    if i > 0 and parts[i - 1] in _INTEGRATION_PARENTS and parts[i] == "vllm":
        return None
    return "/".join(parts[i:])


def vllm_module(path: str) -> str | None:
    """``vllm/...py`` for a file of the vLLM package, else None.

    >>> vllm_module("/usr/lib/python3.12/site-packages/vllm/v1/core/block_pool.py")
    'vllm/v1/core/block_pool.py'
    >>> vllm_module("/root/.cache/vllm/torch_compile_cache/ab/rank_0/x.py") is None
    True
    """
    parts = _parts(path)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == "vllm":
            tail = _package_tail(parts, i)
            if tail is not None:
                return tail
    return None


def plugin_module(path: str) -> str | None:
    """``vllm_<name>/...py`` for a file of a vLLM plugin package (vllm_ascend, ...), else None."""
    parts = _parts(path)
    for i in range(len(parts) - 1, -1, -1):
        if _PLUGIN_ROOT.fullmatch(parts[i]):
            tail = _package_tail(parts, i)
            if tail is not None:
                return tail
    return None


def innermost_vllm(frames: list[Frame]) -> Frame | None:
    """The innermost frame (frames are outermost first) whose file is a vLLM module."""
    for f in reversed(frames):
        if f.module:
            return f
    return None


def innermost_plugin(frames: list[Frame]) -> Frame | None:
    """The innermost plugin frame (``vllm_ascend/...``), or None."""
    for f in reversed(frames):
        if f.plugin:
            return f
    return None
