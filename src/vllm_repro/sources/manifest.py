"""Integrity of extracted trees: a manifest of every file's sha256, written when a tree is made
and checked before each run, so that an edit to a cached tree (a debugger's one-line change to
``scheduler.py``, or an accident) is never silent.

``<tree>/.manifest.json``::

    {"format": 1, "files": {"vllm/v1/core/sched/scheduler.py": [size, mtime_ns, sha256], ...}}

The check is cheap: a file whose size and mtime match the manifest is taken as unchanged; only
the others are hashed (an edit undone, or a ``touch``, is no change). Bytecode caches
(``__pycache__``) and the lab's own stamps are not part of a tree. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

MANIFEST = ".manifest.json"
#: the lab's stamps in a tree (not vLLM's files)
STAMPS = frozenset({MANIFEST, f"{MANIFEST}.tmp", ".extracted.json", ".materialised"})
_FORMAT = 1


@dataclass(frozen=True)
class TreeChange:
    """One file of a tree that differs from its manifest. ``kind``: ``edited`` (other bytes),
    ``added`` (not in the manifest: a new file, a link or a special file), ``removed``."""

    path: str
    kind: str

    def __str__(self) -> str:
        return f"{self.kind} {self.path}"


def sha256_file(path: Path) -> str:
    """The file's sha256 (hex), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _walk(tree: Path):
    """``(relative posix path, lstat)`` of everything in ``tree`` that is not a folder, bytecode
    caches and the lab's stamps aside."""
    for folder, dirs, files in os.walk(tree):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        base = Path(folder)
        for d in list(dirs):  # a link to a folder is a file here (os.walk would not follow it)
            if (base / d).is_symlink():
                dirs.remove(d)
                files.append(d)
        for name in sorted(files):
            rel = (base / name).relative_to(tree).as_posix()
            if rel in STAMPS:
                continue
            yield rel, (base / name).lstat()


def write(tree: Path, expected: dict[str, str] | None = None) -> None:
    """Write ``tree``'s manifest from its files as they are. ``expected`` (path -> sha256: what
    the sdist holds, for a tree made before manifests) keeps the sdist's hash of a file whose
    bytes differ, with no stamp, so that the next :func:`changes` reports it as edited rather
    than taking the edit as the release. Raises ``OSError`` (a read-only cache: the caller may
    go on without one)."""
    files: dict[str, list] = {}
    for rel, st in _walk(tree):
        if not stat.S_ISREG(st.st_mode):
            continue
        sha = sha256_file(tree / rel)
        want = (expected or {}).get(rel, sha)
        files[rel] = [st.st_size, st.st_mtime_ns, sha] if want == sha else [-1, -1, want]
    for rel, sha in (expected or {}).items():
        files.setdefault(rel, [-1, -1, sha])  # in the sdist, gone from the tree: removed
    _save(tree, files)


def _save(tree: Path, files: dict[str, list]) -> None:
    """Write ``files`` as ``tree``'s manifest, atomically. Raises ``OSError``."""
    tmp = tree / f"{MANIFEST}.tmp"
    try:
        tmp.write_text(json.dumps({"format": _FORMAT, "files": files}, sort_keys=True))
        os.replace(tmp, tree / MANIFEST)
    finally:
        if tmp.exists():
            tmp.unlink()


def recorded(tree: Path) -> set[str] | None:
    """The paths ``tree``'s manifest records, or None when it has no readable manifest."""
    files = _load(tree)
    return None if files is None else set(files)


def add(tree: Path, rels: list[str]) -> None:
    """Record the files ``rels`` (paths relative to ``tree``, as they are now) in ``tree``'s
    manifest, leaving every other entry as it was (an edit made since the manifest was written
    is still reported). No manifest: nothing (the next prepare writes one). Raises ``OSError``
    (a read-only cache)."""
    files = _load(tree)
    if files is None or not rels:
        return
    for rel in rels:
        st = (tree / rel).lstat()
        files[rel] = [st.st_size, st.st_mtime_ns, sha256_file(tree / rel)]
    _save(tree, files)


def _load(tree: Path) -> dict[str, list] | None:
    """The manifest's files (path -> ``[size, mtime_ns, sha256]``), or ``None`` when it is
    missing, unreadable or not of that shape."""
    try:
        data = json.loads((tree / MANIFEST).read_text())
        files = data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and len(v) == 3
            and isinstance(v[0], int) and isinstance(v[1], int) and isinstance(v[2], str)
            for k, v in files.items()):
        return None
    return files


def has_manifest(tree: Path) -> bool:
    """Whether ``tree`` has a manifest :func:`changes` can read (one that is missing or
    damaged is written again from the sdist by the next prepare)."""
    return _load(tree) is not None


def changes(tree: Path) -> list[TreeChange] | None:
    """How ``tree`` differs from its manifest (sorted by path), or ``None`` when it has no
    readable manifest (a tree made before manifests, or a damaged manifest, in a read-only
    cache: a writable one gets it written again by the next prepare)."""
    files = _load(tree)
    if files is None:
        return None
    found: list[TreeChange] = []
    seen = set()
    for rel, st in _walk(tree):
        seen.add(rel)
        entry = files.get(rel)
        if entry is None or not stat.S_ISREG(st.st_mode):
            found.append(TreeChange(rel, "added"))
            continue
        size, mtime_ns, sha = entry
        if st.st_size == size and st.st_mtime_ns == mtime_ns:
            continue
        try:
            if sha256_file(tree / rel) != sha:
                found.append(TreeChange(rel, "edited"))
        except OSError:
            found.append(TreeChange(rel, "edited"))
    found += [TreeChange(rel, "removed") for rel in files if rel not in seen]
    return sorted(found, key=lambda c: c.path)


def summary(found: list[TreeChange], most: int = 3) -> str:
    """``"edited vllm/a.py, added vllm/b.py and 2 more"``."""
    shown = ", ".join(map(str, found[:most]))
    return shown + (f" and {len(found) - most} more" if len(found) > most else "")


__all__ = ["MANIFEST", "TreeChange", "write", "changes", "has_manifest", "summary", "sha256_file"]
