"""Apply a fix to a copy of a release's tree: checked with a dry run first, never in place.

A patch is a unified diff whose paths are ``vllm/...`` (``a/vllm/...`` and ``b/vllm/...`` as git
writes them, or bare ``vllm/...``). It is applied with ``git apply`` (no fuzz: it applies
cleanly or not at all) to a copy of ``trees/<version>`` kept under ``patched/<version>-<sha>/``
in the cache, so the pristine tree stays as the release shipped it.

A patch may change and create regular files only: one that makes a symlink (mode 120000), a
submodule (160000) or any other non-regular file is refused (exit 2) before it is applied, and
the patched copy is checked again after ``git apply`` (a link there refuses the patch too).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import EnvError, InputError
from ..settings import cache_dir
from ..sources.env import is_slice_tree

_HEADER = re.compile(r"^(?:\+\+\+|---) (\S+)")
#: git's mode lines: a regular file is 100644 or 100755; anything else (120000 a symlink,
#: 160000 a submodule) is refused
_MODE = re.compile(r"^(?:new file mode|new mode|old mode|deleted file mode) (\d+)\s*$")
_INDEX_MODE = re.compile(r"^index [0-9a-f]+\.\.[0-9a-f]+ (\d+)\s*$")
_RENAME = re.compile(r"^(?:rename|copy) (?:from|to) (.+)$")
_FIX = "give --patch path/to/fix.diff"


def require_patch_file(patch: Path) -> None:
    """Raises :class:`InputError` when ``patch`` is missing, a folder, a link loop, a special
    file or unreadable (one line, with the fix; :func:`vllm_repro.inputs.input_file`)."""
    from ..inputs import input_file

    input_file(patch, "patch file", _FIX)


def patch_files(patch: Path) -> list[str]:
    """The files a unified diff touches, as ``vllm/...`` paths.

    Raises :class:`InputError` when the file is not a unified diff or touches anything outside
    the ``vllm`` package (the lab only patches vLLM's own code).
    """
    from ..inputs import read_text

    text = read_text(patch, "patch file", _FIX)
    files: list[str] = []
    git_headers: list[tuple[int, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        mode = _MODE.match(line) or _INDEX_MODE.match(line)
        if mode and mode.group(1) not in ("100644", "100755", "100664"):
            what = {"120000": "a symlink", "160000": "a submodule (gitlink)"}.get(
                mode.group(1), f"a file of mode {mode.group(1)}")
            raise InputError(f"{patch}: line {lineno}: the patch makes {what}; a fix may only "
                             "change or create regular files under vllm/")
        if line.startswith("diff --git "):
            git_headers.append((lineno, line))  # checked below, after the other lines
            continue
        ren = _RENAME.match(line)
        if ren:
            target = ren.group(1).strip()
            if not target.startswith("vllm/") or ".." in Path(target).parts:
                raise InputError(f"{patch}: line {lineno}: renames or copies {target!r}; a fix "
                                 "may only change files under vllm/")
        m = _HEADER.match(line)
        if not m or m.group(1) == "/dev/null":
            continue
        path = m.group(1)
        if path.startswith(("a/", "b/")):
            path = path[2:]
        if not path.startswith("vllm/") or ".." in Path(path).parts:
            raise InputError(f"{patch}: touches {m.group(1)!r}; a fix may only change files under "
                             "vllm/ (paths like a/vllm/v1/core/sched/scheduler.py)")
        if path not in files:
            files.append(path)
    # git's own header: the only line naming the file of an entry without ---/+++ (an empty
    # new file, a deletion, a mode change, a GIT binary patch), which git applies all the same
    for lineno, line in git_headers:
        for name in _git_header_paths(patch, lineno, line):
            if name not in files:
                files.append(name)
    if not files:
        raise InputError(f"{patch}: not a unified diff (no ---/+++ or diff --git file headers)")
    return files


def _git_header_paths(patch: Path, lineno: int, line: str) -> list[str]:
    """The two paths of a ``diff --git a/X b/Y`` line as ``vllm/...`` paths. Raises
    :class:`InputError` for one outside ``vllm/`` (or with ``..``), and for a line whose names
    cannot be told apart (unquoted names with spaces)."""
    import shlex

    rest = line[len("diff --git "):].strip()
    try:
        names = shlex.split(rest) if '"' in rest else rest.split()
    except ValueError:
        names = []
    if len(names) != 2:
        raise InputError(f"{patch}: line {lineno}: cannot tell the two file names of {line[:120]!r}; "
                         "a fix changes files under vllm/ (make the diff with git diff)")
    out = []
    for name in names:
        path = name[2:] if name.startswith(("a/", "b/")) else name
        if not path.startswith("vllm/") or ".." in Path(path).parts:
            raise InputError(f"{patch}: line {lineno}: touches {name!r}; a fix may only change "
                             "files under vllm/ (paths like a/vllm/v1/core/sched/scheduler.py)")
        out.append(path)
    return out


def _only_regular_files(tree: Path, patch: Path) -> None:
    """Refuse a patched tree holding anything but folders and regular files (the copy was made
    with links followed, so any link or special file there came from the patch)."""
    import stat

    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                kind = "a symlink" if stat.S_ISLNK(mode) else "a special file"
                raise InputError(f"{patch}: applying it makes {kind} "
                                 f"({p.relative_to(tree)}); a fix may only change or create "
                                 "regular files under vllm/")


def _strip_level(patch: Path) -> int:
    for line in patch.read_text().splitlines():
        m = _HEADER.match(line)
        if m and m.group(1) != "/dev/null":
            return 1 if m.group(1).startswith(("a/", "b/")) else 0
    return 1


def dry_run(patch: Path, tree: Path, version: str | None = None) -> None:
    """``git apply --check`` in ``tree`` (of vLLM ``version``; default: the tree folder's
    name). Raises :class:`InputError` with git's first complaint when the patch does not apply
    cleanly, :class:`EnvError` when git is missing."""
    patch_files(patch)
    git = shutil.which("git")
    if git is None:
        raise EnvError("git is needed to apply patches (git apply); install git")
    cmd = [git, "apply", "--check", f"-p{_strip_level(patch)}", str(patch.resolve())]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["does not apply"])[0]
        raise InputError(f"{patch}: does not apply cleanly to vLLM {version or tree.name}: {first}")


def patched_tree(tree: Path, patch: Path, version: str) -> Path:
    """A copy of ``tree`` with ``patch`` applied (made once per patch content and tree, then
    reused: the full tree's and a slice's copies are two, ``patched/<version>-<patch sha>`` and
    ``...-<tree>``, where ``<tree>`` names the slice tree the copy was made from).

    Raises :class:`InputError` if the patch does not apply cleanly.
    """
    dry_run(patch, tree, version)
    sha = hashlib.sha256(patch.read_bytes()).hexdigest()[:12]
    if is_slice_tree(tree):  # named slices/<version>-<key>
        sha += "-" + tree.name.removeprefix(f"{version}-")
    target = cache_dir() / "patched" / f"{version}-{sha}"
    source = f"tree {tree.resolve()}"
    if (target / ".patched").is_file():
        # a copy made from this tree; one made before copies were keyed by tree (a slice's
        # copy under the full tree's name, until 2026-12-06) says no tree: made again
        if source in (target / ".patched").read_text().splitlines():
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-{sha}.", dir=target.parent))
    try:
        work = tmp / "tree"
        shutil.copytree(tree, work, symlinks=False)
        proc = subprocess.run(["git", "apply", f"-p{_strip_level(patch)}", str(patch.resolve())],
                              cwd=work, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise InputError(f"{patch}: failed to apply to vLLM {version}: {proc.stderr.strip()[:300]}")
        _only_regular_files(work, patch)
        (work / ".patched").write_text(f"{patch.resolve()}\nsha256-prefix {sha}\n{source}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
