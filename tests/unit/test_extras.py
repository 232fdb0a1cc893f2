"""The lab without its extras (pyproject.toml: fuzz, remote, plots): what needs no extra still
works, and a command whose extra is missing says so in one line with the pip command, exit 3.
The extras' modules are hidden from a subprocess by an import hook, as in a plain
`pip install vllm-repro`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import ROOT

HIDE = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"hypothesis", "fabric", "paramiko", "invoke", "matplotlib", "ray"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hide())
import importlib.util
_find = importlib.util.find_spec
def find_spec(name, package=None):
    if name.split(".")[0] in {"hypothesis", "fabric", "paramiko", "invoke", "matplotlib", "ray"}:
        return None
    return _find(name, package)
importlib.util.find_spec = find_spec
from vllm_repro.cli import main
main(sys.argv[1:])
"""


def bare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("args,extra,module", [
    (("fuzz", "--vllm", "0.10.2", "--time", "1s"), "fuzz", "hypothesis"),
    (("campaign", "--releases", "==0.10.2"), "fuzz", "hypothesis"),
    (("gpu-verify", "--remote", "gpu-box", "--bundle", "b"), "remote", "fabric"),
])
def test_a_command_without_its_extra_says_which_in_one_line(args, extra, module):
    proc = bare(*args)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: vllm-repro {args[0]} needs {module} (the lab's {extra} extra)")
    assert f"pip install 'vllm-repro[{extra}]'" in line and "Traceback" not in proc.stderr


def test_what_needs_no_extra_runs_without_them(tmp_path):
    for args in (("--help",), ("run", "--help"), ("--version",),
                 ("catalog", "--reports", str(tmp_path))):
        proc = bare(*args)
        assert proc.returncode == 0, (args, proc.stderr)
    assert "vllm-23347-priority-preempt-scheduled" in proc.stdout


def test_every_extra_is_in_dev_and_the_lock():
    """make venv (the dev extra, as CI) installs every extra; the lock pins each of them."""
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"fuzz", "remote", "plots", "ray"} <= set(extras)
    assert "vllm-repro[fuzz,remote,plots,ray]" in extras["dev"]
    core = " ".join(project["dependencies"])
    assert not any(m in core for m in ("hypothesis", "fabric", "matplotlib", "ray"))
    lock = (ROOT / "requirements.lock").read_text()
    for name in ("hypothesis", "fabric", "matplotlib", "ray", "typer", "pytest", "uv"):
        assert f"\n{name}==" in lock, name
