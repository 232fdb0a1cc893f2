"""A slice tree's run-time behaviour, in a fresh interpreter as the worker sees it: modules left
out of the slice and stubbed packages fail loudly and say what to do; stubs import cleanly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_repro.slicing.spec import RUNTIME


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A minimal slice tree: a ``vllm`` package with one module, ``vllm.gone`` sliced out,
    ``fakepkg`` stubbed (distribution fake-pkg 1.2.3)."""
    t = tmp_path / "slice"
    (t / "vllm").mkdir(parents=True)
    (t / "vllm" / "__init__.py").write_text("")
    (t / "vllm" / "here.py").write_text("X = 1\n")
    (t / "_vllm_slice.json").write_text(json.dumps({
        "vllm": "0.99.0", "absent": ["vllm.gone", "vllm.sub.deep"],
        "stubs": {"fakepkg": {"distribution": "fake-pkg", "version": "1.2.3"}}}))
    shutil.copy(RUNTIME, t / "_vllm_slice.py")
    (t / "sitecustomize.py").write_text("import _vllm_slice\n")
    (t / "fakepkg").mkdir()
    (t / "fakepkg" / "__init__.py").write_text(
        "import _vllm_slice\n_vllm_slice.stub_module(__name__, __file__)\n")
    return t


def run(tree: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tree,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)


def test_module_left_out_names_the_slice_and_the_fix(tree):
    p = run(tree, "import vllm.here\nimport vllm.gone\n")
    assert p.returncode == 1
    assert ("ModuleNotFoundError: vllm.gone is not in the slice of vLLM 0.99.0; "
            "re-slice with --include vllm.gone") in p.stderr


def test_module_absent_from_the_release_keeps_the_ordinary_error(tree):
    p = run(tree, "import vllm.never_existed\n")
    assert "No module named 'vllm.never_existed'" in p.stderr
    assert "slice" not in p.stderr


def test_probe_of_a_left_out_module_is_an_import_error(tree):
    p = run(tree, """
        try:
            from vllm.sub import deep
        except ImportError as e:
            print("caught", type(e).__name__)
    """)
    assert p.stdout.strip() == "caught ModuleNotFoundError", p.stderr


def test_stub_imports_cleanly_and_serves_annotations(tree):
    p = run(tree, """
        import typing
        import fakepkg
        from fakepkg.types.chat import Message, Other
        class Mine(Message):
            x: int = 1
        U = Message | None
        A = typing.Union[Message, Other]
        L = list[Message]
        G = Message[int]
        print(fakepkg.__version__, isinstance(3, Message), Mine.__name__)
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1.2.3", "False", "Mine"]


@pytest.mark.parametrize("use", ["Message()", "Mine()", "fakepkg.make(1)", "Message.build()",
                                 # lmformatenforcer registers into yaml's at import time
                                 "fakepkg.SafeLoader.yaml_constructors['!x'] = print",
                                 "del Message.table['k']"])
def test_anything_real_asked_of_a_stub_fails_loudly(tree, use):
    p = run(tree, f"""
        import fakepkg
        from fakepkg.types import Message
        class Mine(Message):
            pass
        {use}
    """)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("_vllm_slice.SliceStubError")
    assert "'fakepkg' (distribution 'fake-pkg') is a stub in the slice of vLLM 0.99.0" in last


def test_stub_use_is_logged_for_the_slicer(tree, tmp_path):
    log = tmp_path / "events.jsonl"
    p = subprocess.run([sys.executable, "-c", "import fakepkg\ntry:\n fakepkg.X()\nexcept Exception:\n pass\n"
                        "try:\n import vllm.gone\nexcept ImportError:\n pass\n"],
                       cwd=tree, capture_output=True, text=True,
                       env={"PYTHONPATH": str(tree), "VLLM_REPRO_SLICE_LOG": str(log)})
    assert p.returncode == 0, p.stderr
    events = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(e["kind"], e["name"], e["package"]) for e in events] == [
        ("stub", "fakepkg.X()", "fake-pkg"), ("missing", "vllm.gone", None)]
