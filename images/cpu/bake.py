"""Bake vLLM releases into the CPU image's cache (run by images/cpu/Dockerfile, as root).

    PYTHONPATH=/tmp/bake VLLM_REPRO_SLICES=/tmp/bake/slices python bake.py 0.10.1.1 0.10.2 0.33.0:engine-core

For each release, with the lab's own builder (``vllm_repro.sources.prepare``, which needs only
``vllm_repro.sources`` and ``vllm_repro.slicing.spec``): fetch the sdist (sha256 checked), then

- the release's slice, where a committed ``slices/<version>.json`` records that it is equivalent
  to the full tree (what ``--tree auto`` picks; the image runs with ``VLLM_REPRO_TREE=auto``):
  only the traced files and the traced, pinned distributions (plus stubs);
- else the full tree and the release's own requirements.

Torch comes from ``TORCH_WHEEL_DIR`` or ``TORCH_INDEX_URL``. Then, so that the layer is small and
works for any user at run time:

- each environment also *imports* its release (a ``.pth`` naming the tree): the CPU image's
  stand-in for an installed vLLM (``gpu-judge`` finds it through ``baked.json``);
- static archives, C/C++ headers and type stubs of every distribution are removed (xgrammar's
  ``libxgrammar.a``: 319 MB over the catalog), as are
  torch's C++ headers, C++ test binaries and protoc (the scheduler never compiles:
  the worker runs with ``TORCHDYNAMO_DISABLE=1``); so are what no run can import: modules that
  import TensorFlow, Flax or JAX at their top level (transformers' ``modeling_tf_*`` and
  ``modeling_flax_*``), the test suites distributions ship in their packages (but a test module
  that runtime code imports: ``numpy._core.tests._natype``), and each distribution's console
  scripts (whose interpreter line made its ``RECORD`` differ in every environment); each
  ``RECORD`` then lists only what is left; every shared library loses its static
  symbol table and debug sections (binutils' ``strip``, installed and removed again by the
  Dockerfile's step);
- each release's sdist is dropped once its trees are made (its record stays: sha256, upload
  time; ``vllm_repro.sources.sdist.drop_sdist``), about 40 MB a release;
- identical files are hardlinked, uv's cache is dropped;
- the bytecode of what a run imports is written in this layer (:func:`compile_imports`:
  compiling every module instead would add about 590 MB), and one file per source shared by
  environments (:func:`share_bytecode`);
- what the lab writes at run time (locks, vLLM's cache dir, patched trees) is world-writable;
- ``baked.json`` lists each release with its kind (slice or full), tree and environment.

Exits with the lab's exit code and one line when a release cannot be fetched or built.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
import time
from pathlib import Path

#: Parts of a torch install the lab never uses (relative to site-packages/torch).
TORCH_PRUNE = ("include", "test", "share/cmake")
TORCH_BIN_KEEP = {"torch_shm_manager"}
#: Cache folders written at run time, by whatever user the container runs as.
RUNTIME_DIRS = ("locks", "vllm-cache", "patched", "labpath")


def say(msg: str) -> None:
    print(f"bake: {msg}", flush=True)


def tree_kind(version: str, level: str = "scheduler") -> str:
    """``slice`` when a committed slice of ``version`` is recorded as equivalent to the full
    tree at ``level``, else ``full`` (``vllm_repro.sources.prepare.resolve_tree``'s rule for
    ``auto``)."""
    from vllm_repro.sources.prepare import resolve_tree

    return resolve_tree(version, "auto", level)


def bake(version: str, kind: str | None = None) -> dict:
    """Bake ``version``'s ``kind`` of tree (default :func:`tree_kind`), with the lab's own
    ``vllm_repro.sources.prepare.build_tree_env`` (the same builder a native run uses)."""
    from vllm_repro.sources.prepare import build_tree_env

    t = time.perf_counter()
    kind = kind or tree_kind(version)
    env = build_tree_env(version, kind, say)
    site = next(env.root.glob("lib/python3*/site-packages"))
    (site / "vllm-repro-release.pth").write_text(f"{env.tree}\n")
    say(f"vLLM {version}: {kind} tree {env.tree}, environment {env.root} "
        f"({time.perf_counter() - t:.0f}s)")
    from vllm_repro.sources.prepare import slice_levels

    return {"kind": kind, "tree": str(env.tree), "env": str(env.root), "python": str(env.python),
            "site": str(site),
            # the levels this tree serves (a full tree: every one)
            "levels": list(slice_levels(version)) if kind == "slice" else ["all"]}


#: inode of a shared library before stripping -> its stripped copy (environments hardlink the
#: wheels they share, torch above all)
_STRIPPED: dict[int, Path] = {}


def _repaired(readelf: str, lib: Path) -> bool:
    """Whether auditwheel rewrote ``lib`` with patchelf (its ``RUNPATH``/``RPATH`` names a
    ``<package>.libs`` folder of vendored libraries): ``strip`` corrupts such files (numpy's
    ``_multiarray_umath`` then fails to import), so they are left alone."""
    import subprocess

    out = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True).stdout
    return any(("RUNPATH" in ln or "RPATH" in ln) and ".libs" in ln for ln in out.splitlines())


def _loads(python: Path, path: Path) -> bool:
    """Whether the environment's ``python`` can ``dlopen`` ``path`` (``ctypes.CDLL``), in a
    process of its own: a stripped copy beside its original (``libtorch_cpu.so.stripped``)
    must not meet the original in one process (torch's libraries abort when registered twice)."""
    import subprocess

    return subprocess.run([str(python), "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])",
                           str(path)], capture_output=True).returncode == 0


def strip_libraries(site: Path) -> int:
    """``strip --strip-unneeded`` each shared library (``*.so``, ``*.so.*``) below ``site``: the
    static symbol table and debug sections that only a debugger or a symbolised C++ backtrace
    reads (torch 2.13's ``libtorch_cpu.so``: 434 -> 345 MB; llguidance's ``_lib.abi3.so``: 56
    -> 8 MB; xgrammar's bindings: 29 -> 1.2 MB); the dynamic symbols the loader and Python's
    extension import resolve against stay. A stripped copy replaces a library only where the
    environment's Python can ``dlopen`` it as it could the original. Returns the bytes saved; 0
    (said once) where binutils is not installed. Left as they are (their hardlinks too): what
    auditwheel rewrote (:func:`_repaired`, and the vendored ``*.libs`` folders), a library
    strip refuses, or cannot make smaller, or whose stripped copy does not load."""
    import subprocess

    strip, readelf = shutil.which("strip"), shutil.which("readelf")
    if strip is None or readelf is None:
        say("no strip (binutils) here: shared libraries keep their symbol tables")
        return 0
    python = site.parents[2] / "bin" / "python"
    saved = 0
    made: list[tuple[Path, Path, os.stat_result]] = []  # (library, its stripped copy, stat)
    for lib in sorted(p for pat in ("*.so", "*.so.*") for p in site.rglob(pat)):
        if lib.is_symlink() or not lib.is_file() or lib.parent.name.endswith(".libs"):
            continue  # (a wheel's vendored libraries: rewritten by auditwheel, below)
        st = lib.stat()
        tmp = lib.with_name(lib.name + ".stripped")
        done = _STRIPPED.get(st.st_ino)
        if done is not None and done.is_file():  # the same file in another environment
            os.link(done, tmp)
            os.replace(tmp, lib)
            continue
        if _repaired(readelf, lib):
            continue
        if subprocess.run([strip, "--strip-unneeded", "-o", str(tmp), str(lib)],
                          capture_output=True).returncode != 0 or \
                tmp.stat().st_size >= st.st_size:
            tmp.unlink(missing_ok=True)
            continue
        made.append((lib, tmp, st))
    for lib, tmp, st in made:
        if not _loads(python, tmp) and _loads(python, lib):
            say(f"{lib.name}: loads, but not stripped; kept as it is")
            tmp.unlink()
            continue
        shutil.copymode(lib, tmp)
        os.replace(tmp, lib)
        _STRIPPED[st.st_ino] = lib
        saved += st.st_size - lib.stat().st_size
    return saved


def prune_torch(site: Path) -> None:
    torch = site / "torch"
    for part in TORCH_PRUNE:
        shutil.rmtree(torch / part, ignore_errors=True)
    bindir = torch / "bin"
    if bindir.is_dir():
        for f in bindir.iterdir():
            if f.name not in TORCH_BIN_KEEP:
                shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()


#: What a C or C++ build or a type checker reads and a run never does: static archives
#: (xgrammar ships a 50 to 65 MB ``libxgrammar.a`` and gtest's beside its Python bindings: 319 MB
#: over the catalog's environments), headers and type stubs (``.pyi``: Python's import system
#: never reads one; 9 MB). Nothing in a run compiles or links (torch's headers are gone too,
#: :data:`TORCH_PRUNE`); a static archive cannot be imported or ``dlopen``-ed.
BUILD_ONLY_SUFFIXES = (".a", ".h", ".hh", ".hpp", ".hxx", ".cuh", ".pyi")


def prune_build_files(site: Path) -> int:
    """Remove :data:`BUILD_ONLY_SUFFIXES` files below ``site``; returns the bytes removed."""
    freed = 0
    for dirpath, _, files in os.walk(site):
        for name in files:
            if name.endswith(BUILD_ONLY_SUFFIXES):
                p = Path(dirpath, name)
                if p.is_file() and not p.is_symlink():
                    freed += p.stat().st_size
                    p.unlink()
    return freed


#: Frameworks no release environment holds (vLLM's CPU path is torch): a module that imports one
#: of them unconditionally, at its top level, cannot be imported there at all.
ABSENT_FRAMEWORKS = ("tensorflow", "flax", "jax")
_TOP_IMPORT = re.compile(rb"^(?:import|from)[ \t]+(" + b"|".join(
    f.encode() for f in ABSENT_FRAMEWORKS) + rb")\b", re.M)


def _installed(site: Path, name: str) -> bool:
    """Whether ``site`` holds distribution ``name`` or a top-level package of that name."""
    return (site / name).exists() or any(site.glob(f"{name}-*.dist-info"))


def prune_unimportable(site: Path) -> int:
    """Remove the modules below ``site`` that import one of :data:`ABSENT_FRAMEWORKS` at their top
    level (an ``import``/``from`` statement in the module's own body, found with :mod:`ast`, not
    one inside a ``try``, a function or a ``TYPE_CHECKING`` block) where this environment holds
    none of that framework: importing such a module raises ``ModuleNotFoundError``, so no run
    loads it. These are transformers' TensorFlow and Flax model code (``modeling_tf_*.py``,
    ``modeling_flax_*.py``: 36 MB over the catalog image), which its lazy ``__init__`` names
    and imports only when ``is_tf_available()`` / ``is_flax_available()``. Returns the bytes
    removed."""
    import ast

    absent = {f for f in ABSENT_FRAMEWORKS if not _installed(site, f)}
    freed = 0
    for py in sorted(site.rglob("*.py")):
        # a package's __init__.py stays: without it the folder would import as a namespace
        # package where importing it failed before
        if py.is_symlink() or not py.is_file() or py.name == "__init__.py":
            continue
        data = py.read_bytes()
        if not any(m.group(1).decode() in absent for m in _TOP_IMPORT.finditer(data)):
            continue
        try:
            body = ast.parse(data).body
        except (SyntaxError, ValueError):
            continue
        tops = {alias.name.split(".")[0] for node in body if isinstance(node, ast.Import)
                for alias in node.names}
        tops |= {node.module.split(".")[0] for node in body
                 if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
        if tops & absent:
            freed += py.stat().st_size
            py.unlink()
    return freed


_IMPORT = re.compile(rb"^[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]+)"
                     rb"|import[ \t]+([^\n#;]+))", re.M)
#: a dotted name with a ``tests`` part in a string (``importlib.import_module("pkg.tests.x")``)
_DOTTED_TESTS = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\.tests(?:\.[A-Za-z_]\w*)*$")


def _resolve(base: str, level: int, pkg: list[str]) -> str:
    """``from <level dots><base> import ...`` in a module of package ``pkg``, made absolute."""
    if not level:
        return base
    up = pkg[:len(pkg) - level + 1] if level - 1 <= len(pkg) else []
    return ".".join([*up, base] if base else up)


#: (inode, device, path below site-packages) -> _imported_names: environments hardlink the files
#: they share, and parsing them once is enough
_NAMES: dict[tuple[int, int, str], set[str]] = {}


def _imported_names(py: Path, site: Path) -> set[str]:
    """The absolute module names ``py`` may import: every ``import``/``from`` statement anywhere
    in it (in a function, under ``try``, on continued lines: read with :mod:`ast`; ``from X import
    a`` gives ``X`` and ``X.a``; a relative ``X`` is resolved against ``py``'s package), and every
    string that is a dotted name with a ``tests`` part (``importlib.import_module("pkg.tests.x")``).
    A file :mod:`ast` cannot parse is read with a regular expression. Either way it may name more
    than Python would import, never less."""
    st = py.stat()
    key = (st.st_ino, st.st_dev, py.relative_to(site).as_posix())
    if key not in _NAMES:
        _NAMES[key] = _read_names(py, site)
    return _NAMES[key]


def _read_names(py: Path, site: Path) -> set[str]:
    """:func:`_imported_names`, read."""
    import ast

    pkg = list(py.relative_to(site).with_suffix("").parts)[:-1]
    data = py.read_bytes()
    names: set[str] = set()
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        for m in _IMPORT.finditer(data):
            if m.group(3) is not None:
                base, chunk = "", m.group(3)
            else:
                raw = m.group(1).decode()
                base = _resolve(raw.lstrip("."), len(raw) - len(raw.lstrip(".")), pkg)
                names.add(base)
                chunk = m.group(2)
            for item in chunk.decode(errors="replace").strip("()").split(","):
                word = item.split()
                if word and word[0] != "*":
                    names.add(f"{base}.{word[0]}" if base else word[0])
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, pkg)
            names.add(base)
            names.update(f"{base}.{a.name}" if base else a.name for a in node.names if a.name != "*")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _DOTTED_TESTS.match(node.value):
            names.add(node.value)
    return names


def prune_test_suites(site: Path) -> int:
    """Remove the test suites that distributions ship inside their packages: every folder named
    ``tests`` below a top-level package of ``site`` (``numpy/_core/tests``, ``scipy/stats/tests``,
    ``sympy/core/tests``...: 76 MB over the catalog image), except the modules that code outside
    them imports, and what those import in turn (numpy's ``numpy.testing`` imports
    ``numpy._core.tests._natype`` at its top level: it stays, with its folder's ``__init__.py``
    and data files). A run imports no test suite otherwise (they are pytest's to collect).
    Returns the bytes removed."""
    suites = [d for d in site.glob("*/**/tests") if d.is_dir() and not d.is_symlink()
              and "tests" not in (rel := d.relative_to(site).parts)[:-1]
              and not rel[0].endswith((".dist-info", ".libs"))]
    if not suites:
        return 0
    dotted = {".".join(d.relative_to(site).parts): d for d in suites}

    def in_suite(p: Path) -> bool:
        parts = p.relative_to(site).parts
        return any(".".join(parts[:i + 1]) in dotted for i, n in enumerate(parts[:-1]) if n == "tests")

    keep: set[Path] = set()
    todo = [p for p in site.rglob("*.py") if not in_suite(p) and b"tests" in p.read_bytes()]
    seen: set[Path] = set()
    while todo:
        py = todo.pop()
        if py in seen:
            continue
        seen.add(py)
        for name in _imported_names(py, site):
            parts = name.split(".")
            if "tests" not in parts:
                continue
            d = dotted.get(".".join(parts[:parts.index("tests") + 1]))
            if d is None:
                continue
            target = site.joinpath(*parts)
            # the module (a file, or a package's __init__.py) and every package above it up
            # to the suite's own __init__.py, each with its folder's data files
            found = [target.with_suffix(".py"), target / "__init__.py"]
            found += [q / "__init__.py" for q in target.parents if q == d or d in q.parents]
            for f in found:
                if f.is_file() and f not in keep:
                    keep.add(f)
                    # its folder's data, and its subfolders' (a data/ folder it may read)
                    keep.update(x for x in f.parent.rglob("*") if x.is_file() and x.suffix != ".py")
                    todo.append(f)
    freed = 0
    for d in suites:  # the folders left empty go with prune_empty_dirs
        for f in list(d.rglob("*")):
            if (f.is_symlink() or f.is_file()) and f not in keep:
                freed += f.lstat().st_size
                f.unlink()
    return freed


def prune_console_scripts(site: Path) -> int:
    """Remove the console scripts each distribution installed in the environment's ``bin``
    (``torchrun``, ``huggingface-cli``, ``uvicorn``...: the lab runs only ``bin/python``);
    :func:`trim_records` then drops their lines from each ``RECORD``. Each script's first line
    names its own environment's interpreter, so the ``RECORD`` of one torch differed in every
    environment; without them the ``RECORD`` files of one distribution are one file
    (:func:`dedupe`): torch's is 1.3 MB, 24 times over the catalog. Returns the bytes removed."""
    freed = 0
    bindir = site.parents[2] / "bin"
    for record in site.glob("*.dist-info/RECORD"):
        for line in record.read_text().splitlines():
            target = Path(os.path.normpath(site / next(csv.reader([line]), [""])[0]))
            if target.parent == bindir and not target.name.startswith("python") \
                    and (target.is_file() or target.is_symlink()):
                freed += target.lstat().st_size
                target.unlink()
    return freed


def trim_records(site: Path) -> int:
    """Drop, from every ``RECORD`` below ``site``, the lines of files that are no longer there
    (what the pruning above removed), so that ``importlib.metadata``'s ``files()`` and ``pip``
    see what the image holds. Returns the number of lines dropped."""
    dropped = 0
    for record in site.glob("*.dist-info/RECORD"):
        lines = record.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if not (rel := next(csv.reader([ln]), [""])[0])
                or os.path.lexists(os.path.normpath(site / rel))]
        if len(kept) != len(lines):
            dropped += len(lines) - len(kept)
            _rewrite(record, "".join(kept))
    return dropped


def _rewrite(path: Path, text: str) -> None:
    """Replace ``path`` by a new file of ``text`` (never writing through a hardlink the file
    shares with another environment)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    shutil.copymode(path, tmp)
    os.replace(tmp, path)


def prune_empty_dirs(site: Path) -> int:
    """Remove the folders below ``site`` the pruning left empty; returns how many."""
    n = 0
    for dirpath, _dirs, files in os.walk(site, topdown=False):
        p = Path(dirpath)
        if p != site and not files and not any(p.iterdir()):
            p.rmdir()
            n += 1
    return n


#: What the engine worker's environment sets that decides what importing vLLM does
#: (``vllm_repro.engine.host.child_environment``): the CPU platform, no hub, no compile.
IMPORT_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1",
              "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONNOUSERSITE": "1"}
#: A full tree's modules a run starts from (a slice's are all of its ``vllm`` files).
FULL_TREE_ENTRIES = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.scheduler", "vllm.v1.engine.core",
                     "vllm.core.scheduler", "vllm.engine.llm_engine")
_COMPILE = r"""
import importlib, os, sys
tree, kind = sys.argv[1], sys.argv[2]
mods = ["sitecustomize"]
if kind == "slice":
    for root, _, files in os.walk(os.path.join(tree, "vllm")):
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), tree)[:-3].replace(os.sep, ".")
                mods.append(rel[:-len(".__init__")] if rel.endswith(".__init__") else rel)
else:
    mods += sys.argv[3].split(",")
ok = 0
for m in mods:
    try:
        importlib.import_module(m)
        ok += 1
    except BaseException:
        pass
print(ok, len(mods), len(sys.modules))
"""


def compile_imports(info: dict) -> str:
    """Write, in the bake's own layer, the bytecode of what a run of the baked release imports:
    its environment's interpreter imports, with the engine worker's settings
    (:data:`IMPORT_ENV`), every ``vllm`` module of a slice tree (the traced files: what the
    slice's runs import; a full tree: :data:`FULL_TREE_ENTRIES`) and the slice's
    ``sitecustomize``, and Python writes their bytecode, and that of all they import, beside
    each source. A module that fails to import (one the slice leaves out, a CUDA-only one) is
    compiled all the same, and passed over. Measured on the catalog: the whole catalog's run
    afterwards compiled 57 more files (0.3 MB: what a run imports only when it needs it,
    xgrammar's and tiktoken's modules), so the image has no layer of bytecode of its own (the
    warm-up runs without writing any). Importing every top-level package of the environment
    too added 10 MB of bytecode that no run loads (the catalog image's releases layer: 2,530
    MB with, 2,520 without). Returns a one-line summary (modules
    imported of those tried, and the seconds taken)."""
    import subprocess

    t = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM_"))}
    env.update(IMPORT_ENV, VLLM_CACHE_ROOT=f"/tmp/vllm-cache-{Path(info['env']).name}")
    try:
        proc = subprocess.run([info["python"], "-c", _COMPILE, info["tree"], info["kind"],
                               ",".join(FULL_TREE_ENTRIES)], env=env, capture_output=True,
                              text=True, timeout=900, cwd="/")
        counts = (proc.stdout.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired:
        counts = "timed out"
    finally:
        shutil.rmtree(f"/tmp/vllm-cache-{Path(info['env']).name}", ignore_errors=True)
    return f"{Path(info['env']).name}: {counts} ({time.perf_counter() - t:.0f}s)"


def dedupe(root: Path) -> int:
    """Hardlink identical regular files below ``root``; returns the bytes saved."""
    by_size: dict[int, dict[int, Path]] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath, name)
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                by_size.setdefault(st.st_size, {}).setdefault(st.st_ino, p)
    saved = 0
    for size, inodes in by_size.items():
        if len(inodes) < 2:
            continue
        first: dict[tuple, Path] = {}
        for p in inodes.values():
            key = (hashlib.sha256(p.read_bytes()).digest(), p.lstat().st_mode)
            keep = first.setdefault(key, p)
            if keep is p:
                continue
            tmp = p.with_name(p.name + ".dedupe")
            os.link(keep, tmp)
            os.replace(tmp, p)
            saved += size
    return saved


def share_bytecode(root: Path) -> tuple[int, int]:
    """Hardlink the bytecode Python wrote for hardlinked sources below ``root`` (the warm-up's
    ``__pycache__/<module>.<tag>.pyc`` files, after :func:`dedupe` made identical sources one
    file: torch, numpy, transformers... in every environment of their version, a vLLM file in
    every release that ships it unchanged) into one file per source and tag. Their bytes differ
    only in the ``co_filename`` the compiler stored; Python checks a ``.pyc`` against its
    source's mtime and size (the same inode: the same), and on loading one rewrites
    ``co_filename`` to the path it was found at (CPython ``SourceLoader.get_code`` ->
    ``_imp._fix_co_filename``), so a traceback names each environment's own path. A file whose
    16-byte header differs from the kept one's (another compile of another source state) is left
    as it is. Returns ``(files linked, bytes saved)``."""
    kept: dict[tuple[int, int, str], tuple[Path, bytes]] = {}
    linked = saved = 0
    for pyc in sorted(root.rglob("__pycache__/*.pyc")):
        if pyc.is_symlink() or not pyc.is_file():
            continue
        try:  # __pycache__/a.b.cpython-311.opt-1.pyc -> a.b.py (importlib's own rule)
            source = importlib.util.source_from_cache(str(pyc))
            src = Path(source).stat()
        except (ValueError, OSError):  # not a cache name, or no source: nothing says it is shared
            continue
        tag = pyc.name[len(Path(source).stem) + 1:]  # ("cpython-311.pyc", "cpython-311.opt-1.pyc")
        with pyc.open("rb") as f:
            header = f.read(16)
        first = kept.setdefault((src.st_dev, src.st_ino, tag), (pyc, header))
        if first[0] is pyc or first[1] != header:
            continue
        st = pyc.stat()
        if st.st_ino == first[0].stat().st_ino:
            continue
        tmp = pyc.with_name(pyc.name + ".share")
        os.link(first[0], tmp)
        os.replace(tmp, pyc)
        linked += 1
        saved += st.st_size
    return linked, saved


def main(versions: list[str]) -> int:
    from vllm_repro.errors import LabError
    from vllm_repro.settings import cache_dir

    if not versions:
        say("no release given")
        return 2
    cache = cache_dir()
    # VERSION[:LEVEL]: the tree_kind of runs at that level (the slice where it is proven at the
    # level, else the full tree: vllm_repro.sources.prepare.resolve_tree); keyed VERSION, or
    # VERSION:full where the release has a slice as well
    wanted: dict[str, set[str]] = {}
    for tok in versions:
        v, _, level = tok.partition(":")
        wanted.setdefault(v, set()).add(tree_kind(v, level or "scheduler"))
    try:
        baked = {}
        for v, kinds in wanted.items():
            for kind in sorted(kinds, reverse=True):  # slice first: it is keyed VERSION
                baked[v if v not in baked else f"{v}:{kind}"] = bake(v, kind)
    except LabError as exc:
        print(f"bake: error: {exc}", file=sys.stderr)
        return exc.exit_code
    t = time.perf_counter()
    stripped = pruned = unimportable = suites = scripts = 0
    for info in baked.values():
        site = Path(info["site"])
        prune_torch(site)
        pruned += prune_build_files(site)
        unimportable += prune_unimportable(site)
        suites += prune_test_suites(site)
        scripts += prune_console_scripts(site)
        trim_records(site)
        prune_empty_dirs(site)
        stripped += strip_libraries(site)
    say(f"removed static archives, headers and type stubs ({pruned / 1e6:.0f} MB), modules "
        f"that import an absent framework ({unimportable / 1e6:.0f} MB), distributions' test "
        f"suites ({suites / 1e6:.0f} MB) and console scripts ({scripts / 1e3:.0f} kB), before "
        "hardlinking")
    if stripped:
        say(f"stripped the shared libraries of their symbol tables ({stripped / 1e6:.0f} MB, "
            "before hardlinking)")
    (cache / "baked.json").write_text(json.dumps(baked, indent=1))
    # the sdists (about 40 MB a release): every tree is made and its manifest written, and a run
    # reads none of them again; their records stay (vllm_repro.sources.sdist.drop_sdist)
    from vllm_repro.sources.sdist import drop_sdist

    freed = sum(drop_sdist(v, "the CPU image's bake dropped it once the release's trees were "
                              "made from it") for v in wanted)
    say(f"dropped the sdists of {len(wanted)} release(s) ({freed / 1e6:.0f} MB)")
    shutil.rmtree(cache / "uv", ignore_errors=True)
    for log in (cache / "envs").glob("*.build.log"):
        log.unlink()
    saved = dedupe(cache)
    say(f"pruned and deduplicated in {time.perf_counter() - t:.0f}s "
        f"({saved / 1e6:.0f} MB shared by hardlinks)")
    # bytecode, after dedupe (hardlinked sources, one mtime each), in this layer: each
    # environment's imports, as many at once as there are cores, then one file per source
    from concurrent.futures import ThreadPoolExecutor

    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for line in pool.map(compile_imports, baked.values()):
            say(f"bytecode: {line}")
    n, b = share_bytecode(cache)
    say(f"bytecode written in {time.perf_counter() - t:.0f}s; {n} files of shared sources "
        f"hardlinked ({b / 1e6:.0f} MB)")
    for name in RUNTIME_DIRS:
        (cache / name).mkdir(exist_ok=True)
    for dirpath, dirs, files in os.walk(cache):
        for n in dirs + files:
            p = Path(dirpath, n)
            if not p.is_symlink():
                mode = p.lstat().st_mode
                p.chmod(mode | stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
                        | (stat.S_IXGRP | stat.S_IXOTH if mode & stat.S_IXUSR else 0))
    for name in RUNTIME_DIRS:
        d = cache / name
        for p in [d, *d.rglob("*")]:
            if not p.is_symlink():
                p.chmod(0o1777 if p.is_dir() else 0o666)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
