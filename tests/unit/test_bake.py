"""images/cpu/bake.py's bytecode sharing, as the CPU image's warm-up uses it: two release
environments hold one (hardlinked) copy of a source; after the warm-up wrote each its own
``.pyc``, sharing leaves one bytecode file, which each environment still loads as its own (no
rewrite, tracebacks naming its own path)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from ..conftest import ROOT


def _bake():
    spec = importlib.util.spec_from_file_location("bake", ROOT / "images/cpu/bake.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _import(site: Path) -> subprocess.CompletedProcess:
    """Import ``sched`` from ``site`` in a fresh interpreter that may write bytecode; print where
    its code says it lives and the traceback's last frame of a call that raises."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    code = ("import sched_mod, traceback\n"
            "print(sched_mod.schedule.__code__.co_filename)\n"
            "try:\n    sched_mod.schedule()\n"
            "except AssertionError as e:\n    print(traceback.extract_tb(e.__traceback__)[-1].filename)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=site, env=env, capture_output=True,
                          text=True, check=True)


def test_shared_bytecode_loads_in_each_environment_as_its_own(tmp_path):
    bake = _bake()
    a, b = tmp_path / "envs/a/site-packages", tmp_path / "envs/b/site-packages"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (a / "sched_mod.py").write_text("def schedule():\n    assert False, 'preempted'\n" + "x = 1\n" * 2000)
    os.link(a / "sched_mod.py", b / "sched_mod.py")  # what bake.dedupe made of two copies
    (a / "only_a.py").write_text("y = 2\n")
    for site in (a, b):
        _import(site)
    pyc_a = next((a / "__pycache__").glob("sched_mod.*.pyc"))
    pyc_b = next((b / "__pycache__").glob("sched_mod.*.pyc"))
    assert pyc_a.stat().st_ino != pyc_b.stat().st_ino

    linked, saved = bake.share_bytecode(tmp_path)
    assert (linked, saved) == (1, pyc_b.stat().st_size)
    assert pyc_a.stat().st_ino == pyc_b.stat().st_ino
    assert bake.share_bytecode(tmp_path) == (0, 0)  # nothing left to share

    for site in (a, b):
        inode = pyc_a.stat().st_ino
        out = _import(site).stdout.split()
        # the code and its traceback name this environment's file, not the one compiled first
        assert out == [str(site / "sched_mod.py")] * 2
        # and Python took the shared bytecode as valid: it would have replaced an invalid one
        assert pyc_a.stat().st_ino == inode == pyc_b.stat().st_ino


def test_bytecode_of_a_different_source_is_never_shared(tmp_path):
    bake = _bake()
    a, b = tmp_path / "a", tmp_path / "b"
    for site, body in ((a, "x = 1\n"), (b, "x = 2\n")):  # same name, two files
        site.mkdir()
        (site / "sched_mod.py").write_text("def schedule():\n    assert False\n" + body)
        _import(site)
    assert bake.share_bytecode(tmp_path) == (0, 0)


def test_a_module_name_with_a_dot_keeps_its_own_bytecode(tmp_path):
    """``foo.bar.py`` beside a shared ``foo.py``: its bytecode belongs to ``foo.bar.py``, not
    to ``foo.py`` (a name taken up to its first dot would share A's with B)."""
    bake = _bake()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "foo.py").write_text("X = 0\n")
    os.link(a / "foo.py", b / "foo.py")
    for site, value in ((a, "AAA"), (b, "BBB")):
        (site / "foo.bar.py").write_text(f"X = {value!r}\n")
        os.utime(site / "foo.bar.py", (1_700_000_000, 1_700_000_000))  # same size and mtime
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        subprocess.run([sys.executable, "-c", "import py_compile; py_compile.compile('foo.py'); "
                        "py_compile.compile('foo.bar.py')"], cwd=site, env=env, check=True)
    assert bake.share_bytecode(tmp_path)[0] == 1  # foo.py's, and only it
    for site in (a, b):
        pycs = {p.name: p.stat().st_ino for p in (site / "__pycache__").iterdir()}
        assert len(pycs) == 2
    assert (a / "__pycache__").joinpath(next(n for n in pycs if n.startswith("foo.bar"))).stat().st_ino \
        != (b / "__pycache__").joinpath(next(n for n in pycs if n.startswith("foo.bar"))).stat().st_ino


def test_static_archives_and_headers_go_and_what_a_run_loads_stays(tmp_path):
    """xgrammar's libxgrammar.a (50 to 65 MB a release, 319 MB over the catalog image) and
    headers are for building against the package; its bindings (.so) and Python stay."""
    site = tmp_path / "site-packages"
    files = {"xgrammar/lib/libxgrammar.a": 7, "xgrammar/lib64/libgtest.a": 3,
             "xgrammar/include/xgrammar/grammar.h": 2, "numpy/_core/include/numpy/ndarraytypes.h": 2,
             "xgrammar/libxgrammar_bindings.so": 5, "xgrammar/__init__.py": 1,
             "numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so": 4,
             "pkg/data/archive.a.json": 1}
    for rel, size in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(b"x" * size)
    assert _bake().prune_build_files(site) == 7 + 3 + 2 + 2
    left = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    assert left == ["numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so",
                    "pkg/data/archive.a.json", "xgrammar/__init__.py", "xgrammar/libxgrammar_bindings.so"]


def _write(site: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_test_suites_go_but_a_test_module_runtime_code_imports_stays_and_still_imports(tmp_path):
    """numpy's ``numpy.testing`` imports ``numpy._core.tests._natype`` at its top level: that
    module (and what it imports from its suite, and its folder's data) stays; the rest of every
    ``tests`` folder inside a package goes, and the package still imports."""
    site = tmp_path / "site-packages"
    _write(site, {
        "numpy/__init__.py": "from . import testing\n",
        "numpy/testing/__init__.py": "from ._private.utils import pd_NA\n",
        "numpy/testing/_private/__init__.py": "",
        "numpy/testing/_private/utils.py": "from numpy._core.tests._natype import pd_NA\n",
        "numpy/_core/__init__.py": "",
        "numpy/_core/tests/_natype.py": "from ._helper import NA as pd_NA\n",
        "numpy/_core/tests/_helper.py": "NA = 'NA'\n",
        "numpy/_core/tests/test_multiarray.py": "import numpy\n",
        "numpy/_core/tests/data/table.csv": "1,2\n",  # data a kept module may read stays
        "numpy/_core/tests/nested/tests/test_deep.py": "",
        "scipy/__init__.py": "",
        "scipy/stats/tests/__init__.py": "",
        "scipy/stats/tests/test_stats.py": "from scipy.stats.tests import common\n",
        "scipy/stats/tests/common.py": "",
        "scipy/stats/tests/data/table.txt": "x" * 500,
        # the ways runtime code may name a test module, each of which keeps it
        "lib/__init__.py": "from lib.tests import \\\n    cont\n"
                           "try: from lib.tests import compound\nexcept ImportError: pass\n"
                           "from .tests import (a,  # see (b)\n    paren)\n"
                           "def f():\n    import importlib\n"
                           "    return importlib.import_module('lib.tests.dynamic')\n",
        "lib/tests/__init__.py": "",
        "lib/tests/cont.py": "", "lib/tests/compound.py": "", "lib/tests/paren.py": "",
        "lib/tests/dynamic.py": "", "lib/tests/test_lib.py": "",
        "mpmath/__init__.py": "def runtests():\n    from .tests import runtests\n",
        "mpmath/tests/__init__.py": "",
        "mpmath/tests/runtests.py": "",
        "mpmath/tests/test_basic.py": "",
        "pkg/tests_helpers.py": "",
        "tests/conftest.py": "",  # a top-level `tests` is no package's suite: left alone
        "pkg-1.0.dist-info/tests/x.txt": "",
    })
    freed = _bake().prune_test_suites(site)
    _bake().prune_empty_dirs(site)
    assert freed > 500
    assert _files(site) == [
        "lib/__init__.py", "lib/tests/__init__.py", "lib/tests/compound.py", "lib/tests/cont.py",
        "lib/tests/dynamic.py", "lib/tests/paren.py",
        "mpmath/__init__.py", "mpmath/tests/__init__.py", "mpmath/tests/runtests.py",
        "numpy/__init__.py", "numpy/_core/__init__.py", "numpy/_core/tests/_helper.py",
        "numpy/_core/tests/_natype.py", "numpy/_core/tests/data/table.csv", "numpy/testing/__init__.py",
        "numpy/testing/_private/__init__.py", "numpy/testing/_private/utils.py",
        "pkg-1.0.dist-info/tests/x.txt", "pkg/tests_helpers.py", "scipy/__init__.py",
        "tests/conftest.py"]
    assert not (site / "scipy/stats/tests").exists()
    out = subprocess.run([sys.executable, "-c", "import numpy; print(numpy.testing.pd_NA)"],
                         cwd=site, capture_output=True, text=True)
    assert out.stdout.strip() == "NA", out.stderr


def test_modules_that_import_an_absent_framework_at_top_level_go(tmp_path):
    """transformers' TensorFlow and Flax model files cannot be imported where neither is
    installed; a torch file that mentions tensorflow in a docstring or imports it under a
    ``try`` stays; with tensorflow installed, its files stay."""
    site = tmp_path / "site-packages"
    _write(site, {
        "transformers/models/bert/modeling_tf_bert.py": "import numpy as np\nimport tensorflow as tf\n",
        "transformers/models/bert/modeling_flax_bert.py": "from flax.core import freeze\n",
        "transformers/models/bert/modeling_bert.py": 'doc = """\nimport tensorflow as tf\n"""\nimport torch\n',
        "transformers/utils/import_utils.py": "try:\n    import tensorflow\nexcept ImportError:\n    pass\n",
        "transformers/jax_compat.py": "def f():\n    import jax\n",
        # a package that imports tensorflow keeps its __init__.py: without it, the folder would
        # import (as a namespace package) where it failed before
        "tf_only/__init__.py": "import tensorflow\n",
    })
    bake = _bake()
    other = tmp_path / "with-tf"
    _write(other, {"tensorflow-2.0.dist-info/METADATA": "",
                   "transformers/models/bert/modeling_tf_bert.py": "import tensorflow as tf\n"})
    assert bake.prune_unimportable(other) == 0
    assert bake.prune_unimportable(site) > 0
    assert _files(site) == ["tf_only/__init__.py", "transformers/jax_compat.py",
                            "transformers/models/bert/modeling_bert.py",
                            "transformers/utils/import_utils.py"]


def test_without_console_scripts_one_distribution_has_one_record_in_every_environment(tmp_path):
    """Each environment's ``bin/torchrun`` names its own interpreter, so torch's RECORD (1.3 MB)
    differed in each of 24 environments; with the scripts and their lines gone, and the lines of
    pruned files dropped, the RECORD files are equal and dedupe makes them one."""
    bake = _bake()
    sites = []
    for name in ("a", "b"):
        env = tmp_path / name
        site = env / "lib/python3.11/site-packages"
        script = f"#!{env}/bin/python\nfrom torch.distributed.run import main\n"
        _write(env, {"bin/torchrun": script, "bin/python": "", "bin/activate": ""})
        _write(site, {
            "torch/__init__.py": "", "torch/include/x.h": "",
            "torch-2.13.0.dist-info/RECORD": (
                f"../../../bin/torchrun,sha256={hash(script)},{len(script)}\n"
                "torch/__init__.py,sha256=e3b0,0\n"
                "torch/include/x.h,sha256=e3b0,0\n"
                '"torch/odd,name.py",sha256=e3b0,0\n'
                "torch-2.13.0.dist-info/RECORD,,\n")})
        (site / "torch/include/x.h").unlink()
        assert bake.prune_console_scripts(site) == len(script)
        assert bake.trim_records(site) == 3  # the script's, the header's and the odd name's
        assert bake.prune_empty_dirs(site) == 1  # torch/include
        assert _files(env / "bin") == ["activate", "python"]
        sites.append(site)
    a, b = ((s / "torch-2.13.0.dist-info/RECORD").read_text() for s in sites)
    assert a == b == "torch/__init__.py,sha256=e3b0,0\ntorch-2.13.0.dist-info/RECORD,,\n"
    assert bake.dedupe(tmp_path) > 0
    assert len({(s / "torch-2.13.0.dist-info/RECORD").stat().st_ino for s in sites}) == 1


def test_bake_writes_the_bytecode_of_what_a_run_imports_in_its_own_layer(tmp_path):
    """compile_imports: the environment's interpreter imports every vllm module of a slice tree,
    so their bytecode and that of what they import is written where the files are; a module
    that fails to import is compiled all the same, and what no vllm module imports gets none."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next(env.glob("lib/python3*/site-packages"))
    tree = tmp_path / "tree"
    _write(tree, {"vllm/__init__.py": "", "vllm/core/__init__.py": "",
                  "vllm/core/sched.py": "import helper, grammar\n",
                  "vllm/cuda_only.py": "raise ImportError('no CUDA')\n"})
    _write(site, {"helper.py": "X = 1\n", "grammar/__init__.py": "from . import compiler\n",
                  "grammar/compiler.py": "", "grammar/unused.py": "",
                  "vllm-repro-release.pth": f"{tree}\n"})
    line = _bake().compile_imports({"env": str(env), "python": str(env / "bin/python"),
                                    "tree": str(tree), "kind": "slice"})
    # tried: sitecustomize (none here), vllm, vllm.core, vllm.core.sched, vllm.cuda_only
    assert line.startswith("env: 3 5 "), line
    compiled = sorted(Path(importlib.util.source_from_cache(str(p))).relative_to(tmp_path).as_posix()
                      for p in tmp_path.rglob("__pycache__/*.pyc"))
    rel = site.relative_to(tmp_path).as_posix()
    assert compiled == sorted([f"{rel}/grammar/__init__.py", f"{rel}/grammar/compiler.py",
                               f"{rel}/helper.py", "tree/vllm/__init__.py", "tree/vllm/core/__init__.py",
                               "tree/vllm/core/sched.py", "tree/vllm/cuda_only.py"]), compiled
