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
- static archives and C/C++ headers of every distribution are removed (xgrammar's
  ``libxgrammar.a``: 319 MB over the catalog), as are
  torch's C++ headers, C++ test binaries and protoc (the scheduler never compiles:
  the worker runs with ``TORCHDYNAMO_DISABLE=1``); every shared library loses its static
  symbol table and debug sections (binutils' ``strip``, installed and removed again by the
  Dockerfile's step);
- each release's sdist is dropped once its trees are made (its record stays: sha256, upload
  time; ``vllm_repro.sources.sdist.drop_sdist``), about 40 MB a release;
- identical files are hardlinked, uv's cache is dropped (bytecode is left to the Dockerfile's
  warm-up run, which compiles exactly what a run imports: compiling everything would add
  about 590 MB);
- what the lab writes at run time (locks, vLLM's cache dir, patched trees) is world-writable;
- ``baked.json`` lists each release with its kind (slice or full), tree and environment.

Exits with the lab's exit code and one line when a release cannot be fetched or built.

    python bake.py --share-bytecode /opt/vllm-repro/cache

(the Dockerfile's warm-up step, after its run wrote the bytecode): :func:`share_bytecode`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
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


#: What a C or C++ build reads and a run never does: static archives (xgrammar ships a 50 to
#: 65 MB ``libxgrammar.a`` and gtest's beside its Python bindings: 319 MB over the catalog's
#: environments) and headers. Nothing in a run compiles or links (torch's headers are gone too,
#: :data:`TORCH_PRUNE`); a static archive cannot be imported or ``dlopen``-ed.
BUILD_ONLY_SUFFIXES = (".a", ".h", ".hh", ".hpp", ".hxx", ".cuh")


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
    stripped = pruned = 0
    for info in baked.values():
        prune_torch(Path(info["site"]))
        pruned += prune_build_files(Path(info["site"]))
        stripped += strip_libraries(Path(info["site"]))
    say(f"removed static archives and headers ({pruned / 1e6:.0f} MB, before hardlinking)")
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
    if sys.argv[1:2] == ["--share-bytecode"]:  # the Dockerfile's warm-up step, after its run
        for folder in sys.argv[2:]:
            n, b = share_bytecode(Path(folder))
            say(f"{folder}: {n} bytecode files of shared sources hardlinked ({b / 1e6:.0f} MB)")
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
