"""Release -> cached, hash-checked sdist -> safely extracted source tree.

Cache layout under :func:`vllm_repro.settings.cache_dir`::

    sdists/vllm-0.10.1.1.tar.gz        the file as the index served it (sha256 checked)
    sdists/vllm-0.10.1.1.tar.gz.json   what the index said: url, sha256, size, upload_time
    trees/0.10.1.1/vllm/...            the package, extracted (only what the lab needs)
    trees/0.10.1.1/requirements/...    the release's requirement files
    trees/0.10.1.1/vllm-0.10.1.1+cpu.dist-info/   metadata that makes vLLM see a CPU build
    trees/0.10.1.1/.manifest.json      sha256 of every file, checked before each run (manifest.py)
    sdists/vllm-0.15.1-cp38-abi3-manylinux_2_31_aarch64.whl   a release the index has only as
    sdists/vllm-0.15.1.wheel.json      wheels: one of them (sha256 checked); its tree holds the
                                       wheel's Python files and its METADATA's requirements

Downloads and extractions write to a temporary name in the same folder and are renamed into
place, so an interrupted run never leaves a partial file where a good one is expected.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Callable

from ..errors import EnvError, InputError
from ..settings import IndexSettings, cache_dir
from . import manifest
from .manifest import sha256_file
from .index import SdistInfo, find_sdist, open_url

#: Parts of the sdist the lab extracts, as path prefixes below the top folder.
DEFAULT_PARTS = ("vllm/", "requirements/", "requirements-", "requirements.txt", "tests/v1/core/",
                 "tests/v1/kv_connector/unit/", "tests/v1/__init__", "tests/__init__", "pyproject.toml",
                 "tests/core/")
#: ``tests/core/``: the V0 engine's scheduler and block-manager tests, which the slicer runs
#: where a release has the V0 engine (``vllm_repro.slicing.runs.core_test_selection``); added
#: on 2026-12-06 to trees extracted before (:func:`_top_up`), never by extracting them again

ProgressFn = Callable[[int, int | None], None]


@dataclass(frozen=True)
class Release:
    """A fetched release: its version, sdist path, sha256 and upload time (UTC); ``dropped``:
    why the sdist file itself is no longer in the cache (the CPU image drops each one once its
    trees are made and checked: :func:`drop_sdist`), else None."""

    version: str
    sdist: Path
    sha256: str
    upload_time: datetime
    dropped: str | None = None

    def require_sdist(self) -> Path:
        """The sdist's path, for making a tree from it. Raises :class:`EnvError` (one line:
        why it is not there and what to do) when it was dropped."""
        if self.dropped and not self.sdist.is_file():
            raise EnvError(f"vLLM {self.version}'s sdist is not in this cache ({self.dropped}): "
                           "no tree of it can be made or restored here; use the trees that were "
                           "made, or a cache that can fetch it (natively: vllm-repro prepare "
                           f"{self.version})")
        return self.sdist

    @property
    def from_wheel(self) -> bool:
        """Whether the sources come from a wheel (the index has no sdist of the release)."""
        return self.sdist.suffix == ".whl"

    def source_note(self) -> str | None:
        """One line saying the sources are not the sdist's (shown with every run), or None."""
        if not self.from_wheel:
            return None
        return (f"vllm sources from {self.sdist.name} (the index has no sdist of {self.version}; "
                "its Python files, requirements from its METADATA)")


def _sdist_paths(version: str) -> tuple[Path, Path]:
    d = cache_dir() / "sdists"
    return d / f"vllm-{version}.tar.gz", d / f"vllm-{version}.tar.gz.json"


def _wheel_meta(version: str) -> Path:
    """Where the record of a release taken from a wheel is kept (it names the wheel's file)."""
    return cache_dir() / "sdists" / f"vllm-{version}.wheel.json"


def _tar_upload_time(path: Path) -> datetime:
    """Fallback for indexes without PEP 700 upload times: the newest member mtime of the sdist."""
    with tarfile.open(path, "r:gz") as tf:
        newest = max((m.mtime for m in tf.getmembers()), default=0)
    return datetime.fromtimestamp(newest, tz=timezone.utc)


def _zip_upload_time(path: Path) -> datetime:
    """:func:`_tar_upload_time` for a wheel: its newest member's date."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        newest = max((datetime(*i.date_time, tzinfo=timezone.utc) for i in zf.infolist()),
                     default=datetime.fromtimestamp(0, tz=timezone.utc))
    return newest


def cached_release(version: str) -> Release | None:
    """The cached sdist of ``version`` if present and its sha256 still matches the record, or
    its record alone where the sdist was dropped (:func:`drop_sdist`)."""
    path, meta = _sdist_paths(version)
    if not path.is_file() and meta.is_file():
        try:
            info = json.loads(meta.read_text())
            if info.get("dropped"):
                return Release(version, path, info["sha256"],
                               datetime.fromisoformat(info["upload_time"]), dropped=info["dropped"])
        except (ValueError, KeyError, OSError, TypeError):
            return None
    if not (path.is_file() and meta.is_file()):
        meta = _wheel_meta(version)
        try:
            path = meta.parent / PurePosixPath(json.loads(meta.read_text())["filename"]).name
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not path.is_file():
            return None
    try:
        info = json.loads(meta.read_text())
        if sha256_file(path) != info["sha256"]:
            return None
        return Release(version, path, info["sha256"], datetime.fromisoformat(info["upload_time"]))
    except (ValueError, KeyError, OSError):
        return None


def drop_sdist(version: str, why: str) -> int:
    """Remove the cached sdist of ``version`` and keep its record (sha256, upload time) with
    ``dropped: why``: the CPU image's bake, once the release's trees are made from it and
    checked (each tree's manifest keeps every file's sha256), since nothing a run does reads it
    again (about 40 MB a release). :func:`cached_release` then answers from the record, and
    making a tree from it raises (:meth:`Release.require_sdist`). Returns the bytes freed (0
    when there was nothing to drop). Raises ``OSError`` when the cache cannot be written."""
    path, meta = _sdist_paths(version)
    if not (path.is_file() and meta.is_file()):
        return 0
    info = json.loads(meta.read_text())
    size = path.stat().st_size
    _atomic_write_text(meta, json.dumps({**info, "dropped": why}, indent=1))
    path.unlink()
    return size


def fetch_sdist(version: str, settings: IndexSettings | None = None,
                progress: ProgressFn | None = None) -> Release:
    """Return the cached sdist of vLLM ``version``, downloading it first if needed.

    The download is checked against the sha256 the index gives and renamed into the cache only
    when it matches. A release the index has only as wheels (0.15.0, 0.15.1) is fetched as one
    of its wheels (:func:`~vllm_repro.sources.index.find_sdist`), checked the same way. Raises
    :class:`InputError` for a version the index does not have and :class:`EnvError` for an
    unreachable index or a hash mismatch (nothing is left in the cache).
    """
    cached = cached_release(version)
    if cached:
        return cached
    settings = settings or IndexSettings.from_pip()
    info: SdistInfo = find_sdist(version, settings=settings)
    path, meta = _sdist_paths(version)
    if info.kind == "wheel":
        meta = _wheel_meta(version)
        path = meta.parent / PurePosixPath(info.filename).name
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        done = 0
        with os.fdopen(fd, "wb") as out, open_url(info.url, settings) as resp:
            total = info.size or int(resp.headers.get("Content-Length") or 0) or None
            while True:
                try:
                    chunk = resp.read(1 << 20)
                except OSError as exc:
                    raise EnvError(f"download of {info.filename} broke off: {exc}") from exc
                if not chunk:
                    break
                out.write(chunk)
                h.update(chunk)
                done += len(chunk)
                if progress:
                    progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        got = h.hexdigest()
        if got != info.sha256:
            raise EnvError(
                f"sha256 mismatch for {info.filename}: index says {info.sha256}, got {got}; "
                "nothing was cached")
        upload = info.upload_time or (_zip_upload_time(tmp) if info.kind == "wheel"
                                      else _tar_upload_time(tmp))
        os.replace(tmp, path)
        _atomic_write_text(meta, json.dumps({
            "url": info.url, "sha256": info.sha256, "size": info.size,
            "upload_time": upload.isoformat(), "filename": info.filename}, indent=1))
        return Release(version, path, info.sha256, upload)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def safe_members(tf: tarfile.TarFile, parts: tuple[str, ...]) -> list[tuple[tarfile.TarInfo, str]]:
    """Members under the sdist's top folder that start with one of ``parts``, with their path
    relative to the top folder. Rejects links, devices and paths that would leave the target."""
    chosen = []
    for m in tf.getmembers():
        p = PurePosixPath(m.name)
        if p.is_absolute() or ".." in p.parts:
            raise EnvError(f"sdist member {m.name!r} leaves the extraction folder; refusing the sdist")
        if len(p.parts) < 2:
            continue
        rel = str(PurePosixPath(*p.parts[1:]))
        if not any(rel.startswith(prefix) for prefix in parts):
            continue
        if m.issym() or m.islnk():
            raise EnvError(f"sdist member {m.name!r} is a link; refusing to extract it")
        if not (m.isfile() or m.isdir()):
            raise EnvError(f"sdist member {m.name!r} is not a plain file; refusing to extract it")
        chosen.append((m, rel))
    return chosen


def tree_dir(version: str) -> Path:
    return cache_dir() / "trees" / version


def extract_tree(release: Release, parts: tuple[str, ...] = DEFAULT_PARTS) -> Path:
    """Extract ``parts`` of the release's sdist into ``trees/<version>/`` (once) and return it.

    Adds ``vllm-<version>+cpu.dist-info`` so that ``importlib.metadata.version("vllm")`` names a
    CPU build: releases that detect the CPU platform from the installed version (0.8 to 0.10)
    then pick it, without any edit to vLLM's files. Raises :class:`EnvError` for an sdist with
    links or paths outside the target. A release fetched as a wheel gets the wheel's Python files
    instead (:func:`extract_wheel`).
    """
    target = tree_dir(release.version)
    stamp = target / ".extracted.json"
    if stamp.is_file():
        try:
            done = json.loads(stamp.read_text())
            if done.get("sha256") == release.sha256:
                if not manifest.has_manifest(target):  # a tree made before manifests
                    _manifest_from_sdist(release, target, parts)
                # a stamp without its parts (none before the lab wrote them): every part is
                # checked, and only what the tree lacks is added
                had = done.get("parts") or ()
                missing = tuple(p for p in parts if p not in had)
                if missing and not release.from_wheel and not release.dropped:
                    _top_up(release, target, missing, done)
                return target
        except ValueError:
            pass
    release.require_sdist()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{release.version}.", dir=target.parent))
    try:
        if release.from_wheel:
            extract_wheel(release, tmp)
            parts = WHEEL_PARTS
        else:
            _extract_sdist(release, tmp, parts)
        write_dist_info(tmp, release.version)
        (tmp / ".extracted.json").write_text(json.dumps({"sha256": release.sha256, "parts": parts,
                                                         "source": release.source_note()}))
        manifest.write(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except tarfile.TarError as exc:
        raise EnvError(f"{release.sdist.name} is not a readable tar.gz: {exc}") from exc
    except zipfile.BadZipFile as exc:
        raise EnvError(f"{release.sdist.name} is not a readable wheel: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _extract_sdist(release: Release, tmp: Path, parts: tuple[str, ...]) -> None:
    with tarfile.open(release.sdist, "r:gz") as tf:
        members = safe_members(tf, parts)
        if not any(rel.startswith("vllm/") for _, rel in members):
            raise EnvError(f"{release.sdist.name} holds no vllm/ package")
        for m, rel in members:
            if hasattr(tarfile, "data_filter"):
                tf.extract(m.replace(name=rel), tmp, filter="data")
            else:  # Python < 3.11.4 / 3.10.12 (Debian 12's 3.11.2): no filters; members are
                m = copy.copy(m)  # already checked by safe_members (no links, no escapes)
                m.name = rel
                m.mode &= 0o755
                tf.extract(m, tmp, set_attrs=False)


#: what a tree taken from a wheel holds: the package's Python files, and the requirements its
#: METADATA declares (written as ``requirements/common.txt``, :func:`extract_wheel`)
WHEEL_PARTS = ("vllm/*.py", "requirements/common.txt")
#: the wheel's own requirements for its GPU build (what ``requirements/cuda.txt`` adds to
#: ``common.txt`` in the sdists around it: numba, ray[cgraph], which pulls cupy); the
#: environment builder drops torch, flashinfer and the rest of its GPU toolchain itself
WHEEL_GPU_REQUIREMENTS = frozenset({"numba", "ray", "cupy-cuda12x"})


def wheel_members(zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    """The wheel's Python files under ``vllm/``. Rejects paths that would leave the target and
    links (a zip member's Unix mode); compiled extensions, data files and ``*.dist-info`` are
    left out."""
    chosen = []
    for info in zf.infolist():
        p = PurePosixPath(info.filename)
        if p.is_absolute() or ".." in p.parts or "\\" in info.filename:
            raise EnvError(f"wheel member {info.filename!r} leaves the extraction folder; "
                           "refusing the wheel")
        if info.is_dir() or p.parts[0] != "vllm" or p.suffix != ".py":
            continue
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0: a zip tool that wrote no Unix mode
        if kind and kind != stat.S_IFREG:
            raise EnvError(f"wheel member {info.filename!r} is not a plain file; refusing the wheel")
        chosen.append(info)
    return chosen


def wheel_requirements(zf: zipfile.ZipFile) -> list[str]:
    """The ``Requires-Dist`` lines of the wheel's METADATA that hold without an extra, less
    :data:`WHEEL_GPU_REQUIREMENTS` (PEP 508 strings, markers kept)."""
    import email.parser
    import re

    meta = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
    if not meta:
        raise EnvError("the wheel has no *.dist-info/METADATA; refusing it")
    msg = email.parser.Parser().parsestr(zf.read(meta[0]).decode("utf-8", "replace"))
    out = []
    for req in msg.get_all("Requires-Dist") or []:
        if re.search(r"\bextra\s*==", req):
            continue
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if name and re.sub(r"[-_.]+", "-", name.group(1)).lower() in WHEEL_GPU_REQUIREMENTS:
            continue
        out.append(req.strip())
    return out


def extract_wheel(release: Release, tmp: Path) -> None:
    """The tree of a release the index has only as wheels, in ``tmp``: the wheel's Python files
    under ``vllm/`` (:func:`wheel_members`) and ``requirements/common.txt`` from its METADATA
    (:func:`wheel_requirements`). Raises :class:`EnvError` for a wheel with links or paths
    outside the target, or without a ``vllm/`` package."""
    with zipfile.ZipFile(release.sdist) as zf:
        members = wheel_members(zf)
        if not members:
            raise EnvError(f"{release.sdist.name} holds no vllm/ package")
        for info in members:
            dest = tmp / info.filename
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            dest.chmod(0o644)
        reqs = tmp / "requirements" / "common.txt"
        reqs.parent.mkdir(parents=True, exist_ok=True)
        reqs.write_text(f"# from {release.sdist.name}'s METADATA (Requires-Dist, no extras; "
                        "its GPU build's own left out): the index has no sdist of this release\n"
                        + "".join(f"{r}\n" for r in wheel_requirements(zf)))


def _top_up(release: Release, tree: Path, missing: tuple[str, ...], stamp: dict) -> None:
    """Add the sdist's files under ``missing`` (parts the lab extracts now that it did not when
    ``tree`` was made) to an existing tree, without touching a file already there (a tree the
    debugger edited keeps the edit, and the manifest keeps reporting it), and record them in the
    manifest and the stamp. Nothing where the cache is read-only (the CPU image's trees are
    made by its own build). Raises :class:`EnvError` for an sdist member that is a link or
    leaves the tree (:func:`safe_members`)."""
    added: list[str] = []
    recorded = manifest.recorded(tree)
    try:
        with tarfile.open(release.sdist, "r:gz") as tf:
            for m, rel in safe_members(tf, missing):
                dest = tree / rel
                if m.isdir():
                    dest.mkdir(parents=True, exist_ok=True)
                    continue
                src = tf.extractfile(m)
                data = src.read() if src is not None else b""
                if dest.exists() or dest.is_symlink():
                    # written by a top-up that failed before it recorded it (a full disk): the
                    # sdist's bytes are recorded as such; anything else stays reported
                    if (recorded is not None and rel not in recorded and dest.is_file()
                            and not dest.is_symlink()
                            and sha256_file(dest) == hashlib.sha256(data).hexdigest()):
                        added.append(rel)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.tmp")
                try:
                    tmp.write_bytes(data)
                    os.replace(tmp, dest)
                finally:
                    if tmp.exists():
                        tmp.unlink()
                added.append(rel)
        manifest.add(tree, added)
        stamp["parts"] = list(dict.fromkeys([*(stamp.get("parts") or []), *missing]))
        (tree / ".extracted.json").write_text(json.dumps(stamp))
    except OSError:  # a read-only cache, or a failure midway: the next prepare goes on
        if added:
            try:
                manifest.add(tree, added)
            except OSError:
                pass
    except tarfile.TarError as exc:
        raise EnvError(f"{release.sdist.name} is not a readable tar.gz: {exc}") from exc


def _manifest_from_sdist(release: Release, tree: Path, parts: tuple[str, ...]) -> None:
    """The manifest of a tree extracted before manifests, with the sdist's own hashes (so an
    edit made since shows as one); nothing where the cache is read-only."""
    expected = {}
    try:
        with tarfile.open(release.sdist, "r:gz") as tf:
            for m, rel in safe_members(tf, parts):
                if m.isfile():
                    expected[rel] = hashlib.sha256(tf.extractfile(m).read()).hexdigest()
        manifest.write(tree, expected)
    except (OSError, tarfile.TarError):
        pass


def write_dist_info(tree: Path, version: str) -> Path:
    """Write ``vllm-<version>+cpu.dist-info`` into ``tree`` (see :func:`extract_tree`)."""
    dist = tree / f"vllm-{version}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: vLLM source tree extracted by vllm-repro (CPU, no compiled extensions)\n")
    (dist / "INSTALLER").write_text("vllm-repro\n")
    (dist / "RECORD").write_text("")
    return dist


def known_release(version: str, flag: str = "--vllm", settings: IndexSettings | None = None) -> str:
    """``version`` as the index spells it (:func:`validate_version`), once it is known to be a
    release of vLLM: its sdist (or wheel) is in the cache (no network), else the index has it,
    looked up as ``run`` and ``prepare`` look it up (:func:`~vllm_repro.sources.index.
    find_sdist`). Raises :class:`InputError` naming ``flag``, the nearest releases and how to
    list them (exit 2); :class:`~vllm_repro.errors.IndexUnreachable` when the index cannot be
    read and nothing is cached."""
    try:
        text = validate_version(version)
        if _sdist_paths(text)[1].is_file() or _wheel_meta(text).is_file():
            return text
        find_sdist(text, settings=settings or IndexSettings.from_pip())
    except InputError as exc:
        raise InputError(f"{flag} {version}: {exc}") from None
    return text


def checked_release(version: str, flag: str = "--vllm", *, needed: bool = True,
                    say=lambda _msg: None) -> str:
    """A release named on the command line (``--vllm``, ``--also-on``: ``flag``), checked before
    anything runs by :func:`known_release` (the cache, else the index): raises
    :class:`InputError` (exit 2, one line: the flag, the nearest releases, how to list them) for
    one that is not a release. When the index cannot be read and the release is not cached: a
    command that must fetch it (``needed``: ``run``, ``catalog run``, a replay) stops there
    (:class:`~vllm_repro.errors.IndexUnreachable`, exit 3: it could not run it anyway); one that
    only names it (triage's draft) goes on with it unchecked, said through ``say``."""
    from ..errors import IndexUnreachable

    try:
        return known_release(version, flag)
    except IndexUnreachable as exc:
        if needed:
            raise
        say(f"{flag} {version}: not checked against the index ({exc}); the draft names it as given")
        return validate_version(version)


def validate_version(version: str) -> str:
    """The release string as the index spells it, from what a user typed: surrounding spaces and
    a tag's leading ``v`` (``v0.10.2``) dropped. Raises :class:`InputError` for a string that
    cannot be a version, before touching the network."""
    from packaging.version import InvalidVersion, Version

    text = version.strip()
    text = text[1:] if text[:1] in ("v", "V") and text[1:2].isdigit() else text
    try:
        Version(text)
    except InvalidVersion as exc:
        raise InputError(f"{version!r} is not a vLLM version number (e.g. 0.10.1.1)") from exc
    return text
