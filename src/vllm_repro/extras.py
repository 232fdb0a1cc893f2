"""The lab's optional parts (pyproject.toml's extras): which module each extra brings and the
one line a command says when its extra is missing. No third-party import here.

``fuzz`` (hypothesis: ``fuzz``, ``campaign``), ``remote`` (fabric: ``gpu-verify``), ``plots``
(matplotlib: ``timeline.png``, ``matrix.png``, ``heatmap.png``), ``ray`` (``--ray``).
``make venv`` (the ``dev`` extra) installs them all.
"""

from __future__ import annotations

import importlib.util

from .errors import EnvError

#: the module whose absence means an extra is missing -> that extra
EXTRA_OF = {"hypothesis": "fuzz", "fabric": "remote", "paramiko": "remote",
            "invoke": "remote", "matplotlib": "plots", "ray": "ray"}


def install_hint(module: str) -> str:
    """``"pip install 'vllm-repro[EXTRA]'"`` for ``module``'s extra."""
    return f"pip install 'vllm-repro[{EXTRA_OF.get(module, 'all')}]'"


def missing_line(module: str, what: str) -> str:
    """The one line: ``WHAT needs MODULE (the EXTRA extra), which is not installed: pip ...``."""
    return (f"{what} needs {module} (the lab's {EXTRA_OF.get(module, 'all')} extra), which is not "
            f"installed here: {install_hint(module)} (make venv installs every extra)")


def require(module: str, what: str) -> None:
    """Raise :class:`EnvError` (exit 3) with :func:`missing_line` when ``module`` cannot be
    found; ``what`` is the command or option that needs it (``vllm-repro fuzz``)."""
    if importlib.util.find_spec(module) is None:
        raise EnvError(missing_line(module, what))


def why(exc: BaseException) -> str:
    """Why an optional step failed, in words: for a missing extra's module, that and the pip
    command; otherwise ``Type: message``."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRA_OF:
        module = exc.name.split(".")[0]
        return f"{module} is not installed: {install_hint(module)}"
    return f"{type(exc).__name__}: {exc}"
