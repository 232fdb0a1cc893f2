"""A CPU Python environment per vLLM release, built with uv.

What goes in: CPU torch from the configured torch source (:class:`vllm_repro.settings.TorchSource`)
and the release's own third-party requirements (``requirements/common.txt`` + ``cpu.txt``, or the
older ``requirements-common.txt`` + ``requirements-cpu.txt``), minus the GPU toolchain (torch
variants, triton, IPEX) that scheduling never touches, plus the ``REQUIREMENTS_BY_RELEASE``
entries whose range holds the release (:func:`vllm_repro.settings.requirements_for_release`:
triton for releases that import it at module level, an outlines that imports on today's index),
installed as uv overrides and listed with every run. Versions are resolved as the index stood
when the release was uploaded (uv's ``--exclude-newer`` at the sdist's upload time), so 0.10.x
gets the transformers 4.5x it was built against and 0.33 gets 5.x, without a table of versions.

Environments live in ``envs/<version>/`` under the cache; uv's cache is in the same file system,
so identical wheels (torch above all) are hardlinked, not copied. ``envs/<version>/.ready.json``
records the resolved set; an environment without it is rebuilt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from ..errors import EnvError
from ..settings import (IndexSettings, ReleaseRule, TorchSource, cache_dir,
                        requirements_for_release, torch_for_release)
from .sdist import Release

#: Distributions never installed into a release environment: torch comes from the torch source,
#: the rest is GPU/compiler tooling or benchmark-only.
EXCLUDED = {
    "torch", "torchvision", "torchaudio", "torchcodec", "triton", "pytorch-triton",
    "intel-openmp", "intel-extension-for-pytorch", "xformers", "flashinfer-python",
    "datasets",
}
#: Removed from the transitive closure too (uv overrides with an impossible marker).
OVERRIDDEN_AWAY = ("triton", "pytorch-triton", "nvidia-nccl-cu12")
ENV_FORMAT = 1

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def uv_bin() -> str:
    """The uv executable shipped by the ``uv`` wheel (a dependency of the lab)."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
        raise EnvError("uv is not installed, and building a release's environment needs it: run "
                       "`make venv` (pip install -e .) first; the CPU image has none: it runs the "
                       "trees baked into it (--tree auto; baked.json lists them), and make images "
                       "VLLM_VERSIONS=\"catalog X\" bakes in another") from None


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_files(tree: Path) -> list[Path]:
    """The release's requirement files for a CPU build, probed in the layouts vLLM has used."""
    for common, cpu in (("requirements/common.txt", "requirements/cpu.txt"),
                        ("requirements-common.txt", "requirements-cpu.txt")):
        if (tree / common).is_file():
            return [p for p in (tree / common, tree / cpu) if p.is_file()]
    if (tree / "requirements.txt").is_file():
        return [tree / "requirements.txt"]
    raise EnvError(f"no requirement files found in {tree} (looked for requirements/common.txt)")


def read_requirements(path: Path, seen: set[Path] | None = None) -> list[str]:
    """Requirement lines of ``path``, following ``-r`` includes; drops options, direct URLs and
    the :data:`EXCLUDED` distributions. Returns PEP 508 strings (markers kept)."""
    seen = seen or set()
    if path in seen:
        return []
    seen.add(path)
    out: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].split("\t#", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement")):
            inc = line.split(None, 1)[1].strip()
            out.extend(read_requirements((path.parent / inc).resolve(), seen))
            continue
        if line.startswith("-"):
            continue  # --extra-index-url and friends: the lab decides where torch comes from
        if " @ " in line.split(";")[0] or "://" in line:
            continue  # direct URL (e.g. triton-cpu wheels on GitHub): unreachable and unneeded
        m = _NAME.match(line)
        if not m or _canon(m.group(1)) in EXCLUDED:
            continue
        out.append(line)
    return out


def release_requirements(tree: Path) -> list[str]:
    """All third-party requirements of the release's CPU build, each file read once even when
    ``cpu.txt`` includes ``common.txt`` (see :func:`read_requirements` for what is dropped)."""
    seen: set[Path] = set()
    out: list[str] = []
    for f in requirement_files(tree):
        for r in read_requirements(f.resolve(), seen):
            if r not in out:
                out.append(r)
    return out


def is_slice_tree(tree: Path) -> bool:
    """Whether ``tree`` is a materialised slice, a patched copy of one included: its run-time,
    ``_vllm_slice.py``, at its root (``slicing/spec.py:materialise``)."""
    return (tree / "_vllm_slice.py").is_file()


@dataclass(frozen=True)
class ReleaseEnv:
    """A ready environment: the release, its tree (goes on PYTHONPATH) and the interpreter.

    ``tree`` is ``None`` for an installed vLLM (``VLLM_REPRO_VLLM=installed``, see
    :mod:`vllm_repro.sources.installed`): the interpreter imports vLLM by itself, and
    ``interpreter`` names it when it is not ``root/bin/python``.
    """

    version: str
    tree: Path | None
    root: Path
    interpreter: Path | None = None

    @property
    def python(self) -> Path:
        return self.interpreter or self.root / "bin" / "python"

    @property
    def tree_kind(self) -> str:
        """``slice`` (:func:`is_slice_tree`), ``full`` (the sdist's whole tree) or ``installed``
        (no tree)."""
        if self.tree is None:
            return "installed"
        return "slice" if is_slice_tree(self.tree) else "full"

    def freeze(self) -> list[str]:
        return self._ready().get("freeze", [])

    def substitutions(self) -> list[str]:
        """What the environment has in place of the release's own, as lines shown with every
        run's result: sources taken from a wheel (the index has no sdist of the release:
        ``.extracted.json``'s ``source``, :meth:`~vllm_repro.sources.sdist.Release.source_note`),
        and pinned requirements installed as another version (:class:`Substitution`)."""
        source = None
        if self.tree is not None:
            try:
                source = json.loads((self.tree / ".extracted.json").read_text()).get("source")
            except (OSError, ValueError, AttributeError):
                source = None
        return ([source] if isinstance(source, str) else []) \
            + list(self._ready().get("substitutions", []))

    def _ready(self) -> dict:
        try:
            data = json.loads((self.root / ".ready.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def exclude_newer(upload_time: datetime) -> str:
    """The index's state a release's dependencies resolve against: an hour after the release's
    sdist was uploaded (``upload_time``, UTC; uv's cut-off is strict and the wheels of a release
    go up within minutes of it), as uv's ``--exclude-newer`` reads it, e.g.
    ``2025-08-21T00:17:16Z`` for 0.10.1.1. The CPU environments and the CUDA image built on a
    plain Python base (images/cuda/exclude_newer.py) both use it."""
    return (upload_time + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")


def env_dir(version: str) -> Path:
    """``<cache>/envs/<version>``: the full tree's environment of ``version``."""
    return cache_dir() / "envs" / version


def uv_env(index: IndexSettings) -> dict[str, str]:
    """The process environment uv runs with: the lab's uv cache, the index's CA bundle, no
    ``VIRTUAL_ENV`` of the caller."""
    env = dict(os.environ)
    env["UV_CACHE_DIR"] = str(cache_dir() / "uv")
    env.setdefault("UV_HTTP_TIMEOUT", "180")
    if index.cert:
        env["SSL_CERT_FILE"] = index.cert
    env.pop("VIRTUAL_ENV", None)
    return env


def index_args(index: IndexSettings) -> list[str]:
    """uv's index arguments (index URL, extra indexes and find-links that exist) from pip's
    configuration."""
    args = ["--index-url", index.index_url, "--index-strategy", "unsafe-best-match"]
    for url in index.extra_index_urls:
        if url.startswith("file://") and not Path(url[7:]).is_dir():
            continue
        args += ["--extra-index-url", url]
    for link in index.find_links:
        if link.startswith(("http://", "https://")) or Path(link.removeprefix("file://")).is_dir():
            args += ["--find-links", link]
    return args


def run_uv(args: list[str], env: dict[str, str], what: str, log: Path) -> str:
    """Run ``uv ARGS``, appending the command and its output to ``log``; returns stdout. Raises
    :class:`EnvError` naming ``what`` failed, with the last lines of uv's stderr and the log."""
    cmd = [uv_bin(), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0:
        tail = " | ".join(line for line in proc.stderr.strip().splitlines()[-4:])
        raise EnvError(f"{what} failed (uv exit {proc.returncode}): {tail} (full log: {log})")
    return proc.stdout


def prepare_env(release: Release, tree: Path, index: IndexSettings | None = None,
                torch: TorchSource | None = None, python: str | None = None,
                rebuild: bool = False) -> ReleaseEnv:
    """Build (once) and return the CPU environment of ``release``.

    Takes about 10 to 60 s cold (mostly downloads), nothing warm. Raises :class:`EnvError` when uv
    cannot resolve or install; the half-built folder is removed so the next run starts over.
    """
    root = env_dir(release.version)
    ready = root / ".ready.json"
    if ready.is_file() and not rebuild:
        try:
            meta = json.loads(ready.read_text())
            # a torch chosen for this release (TORCH_BY_RELEASE) that the environment lacks: rebuild
            wanted = torch or (TorchSource.resolve(index, release.version)
                               if torch_for_release(release.version) else None)
            # and the REQUIREMENTS_BY_RELEASE entries it was built with
            extras = [r.value for r in requirements_for_release(release.version)]
            if (meta.get("format") == ENV_FORMAT and (root / "bin/python").exists()
                    and (wanted is None or meta.get("torch") == wanted.describe())
                    and meta.get("extra_requirements", []) == extras):
                return ReleaseEnv(release.version, tree, root)
        except ValueError:
            pass
    index = index or IndexSettings.from_pip()
    torch = torch or TorchSource.resolve(index, release.version)
    rules = requirements_for_release(release.version)
    env = uv_env(index)
    log = root.parent / f"{release.version}.build.log"
    with fresh_env(root, log):
        run_uv(["venv", "-q", "--python", python or base_python(), str(root)], env,
               f"creating the environment for vLLM {release.version}", log)
        py = str(root / "bin" / "python")
        torch_args, torch_req = torch_install(index, torch, torch.requirement)
        run_uv(["pip", "install", "-q", "--python", py, *torch_args, torch_req], env,
               f"installing {torch.requirement} from {torch.describe()}", log)
        reqs = release_requirements(tree) + [r.value for r in rules]
        req_file = root / "release-requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        overrides = root / "overrides.txt"
        overrides.write_text(overrides_text(rules))
        cutoff = exclude_newer(release.upload_time)
        substitutions: list[Substitution] = []
        for _ in range(MAX_SUBSTITUTIONS + 1):
            try:
                run_uv(["pip", "install", "-q", "--python", py, *index_args(index),
                        "--exclude-newer", cutoff,
                        *(a for sub in substitutions for a in sub.uv_args()),
                        "--override", str(overrides), "-r", str(req_file)],
                       env, f"installing the requirements of vLLM {release.version} (as of {cutoff})",
                       log)
                break
            except EnvError as exc:
                found = missing_pins(str(exc), reqs, substitutions, index) \
                    or late_uploads(str(exc), substitutions)
                if not found or len(substitutions) + len(found) > MAX_SUBSTITUTIONS:
                    raise
                substitutions += found
                reqs = [_substituted(r, substitutions) for r in reqs]
                req_file.write_text("\n".join(reqs) + "\n")
        freeze = run_uv(["pip", "freeze", "--python", py], env, "listing the environment", log)
        ready.write_text(json.dumps({
            "format": ENV_FORMAT, "version": release.version, "torch": torch.describe(),
            "exclude_newer": cutoff, "extra_requirements": [r.value for r in rules],
            "substitutions": [sub.describe() for sub in substitutions]
            + [extra_note(r, tree) for r in rules],
            "freeze": freeze.split()}, indent=1))
    return ReleaseEnv(release.version, tree, root)


def overrides_text(rules: list[ReleaseRule]) -> str:
    """uv's override file: :data:`OVERRIDDEN_AWAY` (an impossible marker) and each
    ``REQUIREMENTS_BY_RELEASE`` requirement (``rules``), which so wins over the release's own
    requirement of that distribution and any dependency's; a distribution an entry names is not
    overridden away (triton for 0.4.x)."""
    named = {_canon(_NAME.match(r.value).group(1)) for r in rules}
    lines = [f'{name} ; sys_platform == "never"' for name in OVERRIDDEN_AWAY if _canon(name) not in named]
    return "".join(line + "\n" for line in lines + [r.value for r in rules])


def extra_note(rule: ReleaseRule, tree: Path) -> str:
    """The line every run shows for a ``REQUIREMENTS_BY_RELEASE`` requirement, with the
    release's own requirement of that distribution where it has one, e.g. ``outlines==0.0.41
    (REQUIREMENTS_BY_RELEASE '>=0.5.0,<0.6.0=outlines==0.0.41', in place of the release's
    'outlines >= 0.0.43, < 0.1')``."""
    name = _canon(_NAME.match(rule.value).group(1))
    try:
        own = [r for r in release_requirements(tree) if _canon(_NAME.match(r).group(1)) == name]
    except EnvError:
        own = []
    where = f", in place of the release's {own[0]!r}" if own else ", added to the environment"
    return f"{rule.value} (REQUIREMENTS_BY_RELEASE {rule.entry!r}{where})"


#: at most this many pinned requirements replaced in one environment
MAX_SUBSTITUTIONS = 4
#: uv's words for a pin the index cannot satisfy: "there is no version of xgrammar{...}==0.1.16"
_NO_VERSION = re.compile(r"there is no version of ([A-Za-z0-9][A-Za-z0-9._-]*)(?:\{[^}]*\})?==([^\s,|]+)")


@dataclass(frozen=True)
class Substitution:
    """A pinned requirement of the release the index no longer has (``name==pinned``: deleted or
    never uploaded as a wheel), installed as the nearest version it has (``used``, uploaded at
    ``uploaded``, ISO UTC). Recorded in ``.ready.json`` and shown with every run's result."""

    name: str
    pinned: str
    used: str
    uploaded: str | None = None

    def describe(self) -> str:
        if not self.pinned:  # late_uploads: the only files are newer than the release
            return (f"{self.name}=={self.used} (uploaded after the release's date; the index "
                    "has no earlier file)")
        return (f"{self.name}=={self.pinned} -> {self.name}=={self.used} "
                f"({self.pinned} is not on the index)")

    def uv_args(self) -> list[str]:
        """The substitute may be newer than the release's cut-off date: let uv take it."""
        return ["--exclude-newer-package", f"{self.name}={self.uploaded}"] if self.uploaded else []


def nearest_version(pinned: str, available: dict[str, str | None]) -> str | None:
    """The version to use for a missing pin: the lowest above it with the same major.minor
    (a later patch of the same series), else the highest below it; ``None`` if neither.
    ``available``: version -> upload time."""
    from packaging.version import InvalidVersion, Version

    try:
        want = Version(pinned)
    except InvalidVersion:
        return None
    parsed = []
    for v in available:
        try:
            pv = Version(v)
        except InvalidVersion:
            continue
        if not pv.is_prerelease:
            parsed.append((pv, v))
    above = sorted(p for p in parsed if p[0] > want and p[0].release[:2] == want.release[:2])
    below = sorted(p for p in parsed if p[0] < want)
    if above:
        return above[0][1]
    return below[-1][1] if below else None


def missing_pins(uv_error: str, reqs: list[str], done: list[Substitution],
                 index: IndexSettings) -> list[Substitution]:
    """Substitutions for the pins ``uv_error`` says the index cannot satisfy (only pins that are
    the release's own, exact, and not yet substituted). Raises nothing: an index that cannot be
    read gives no substitution (and the original error stands)."""
    from .index import project_files

    out = []
    pinned_names = {_canon(m.group(1)) for r in reqs if (m := _NAME.match(r)) and "==" in r}
    for name, version in _NO_VERSION.findall(uv_error):
        if _canon(name) not in pinned_names or any(_canon(s.name) == _canon(name) for s in done + out):
            continue
        try:
            files = project_files(name, index)
        except Exception:  # noqa: BLE001 - no substitution; uv's error is the one reported
            continue
        available: dict[str, str | None] = {}
        for f in files:
            fn = f.get("filename", "")
            if f.get("yanked") or not fn.endswith(".whl"):
                continue
            available.setdefault(fn.split("-")[1], f.get("upload-time"))
        used = nearest_version(version, available)
        if used and used != version:
            # without an upload time from the index: let uv take it whatever its date
            uploaded = _after(available.get(used))
            out.append(Substitution(name, version, used, uploaded))
    return out


#: uv's hint for a dependency whose only files are newer than the cut-off (e.g. pyairports,
#: deleted from the index and uploaded again in 2025, which outlines 0.0.4x needs):
#: "`pyairports` was filtered by `exclude-newer` ... The latest version satisfying the
#: requirement is v0.0.1, published at 2025-09-25T04:17:09.505Z"
_LATE = re.compile(r"`([A-Za-z0-9][A-Za-z0-9._-]*)` was filtered by `exclude-newer`.*?"
                   r"The latest version satisfying the requirement is v?([^\s,]+), published at "
                   r"(\S+?)\.?(?:\s|$)", re.S)


def late_uploads(uv_error: str, done: list[Substitution]) -> list[Substitution]:
    """Substitutions for dependencies uv says have no file before the release's cut-off, only
    later ones (``_LATE``): each is let through at its first later upload, recorded like a
    substituted pin (``pinned`` empty)."""
    out = []
    for name, version, published in _LATE.findall(uv_error):
        if any(_canon(s.name) == _canon(name) for s in done + out):
            continue
        out.append(Substitution(name, "", version, _after(published)))
    return out


def _after(when: str | None) -> str:
    """An hour after ``when`` (ISO; uv's cut-off is strict), as uv reads dates; now if None."""
    try:
        t = datetime.fromisoformat(str(when).replace("Z", "+00:00")) + timedelta(hours=1)
    except ValueError:
        t = datetime.now(timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _substituted(req: str, subs: list[Substitution]) -> str:
    m = _NAME.match(req)
    for sub in subs:
        if m and _canon(m.group(1)) == _canon(sub.name):
            return re.sub(r"==\s*" + re.escape(sub.pinned) + r"(?![\w.])", f"=={sub.used}", req)
    return req


def torch_install(index: IndexSettings, torch: TorchSource, requirement: str) -> tuple[list[str], str]:
    """``(uv pip install arguments, requirement)`` for torch from the configured torch source:
    the local CPU wheel itself (its dependencies, sympy, networkx..., from the index), or
    ``requirement`` (``torch==X``) with the torch index added."""
    if torch.wheel is not None:
        return index_args(index), str(torch.wheel)
    return [*index_args(index), "--extra-index-url", torch.index_url], requirement


@contextmanager
def fresh_env(root: Path, log: Path):
    """Start ``root`` over (removed if present, parent created, ``log`` emptied); on any failure
    inside the block the half-built folder is removed so the next run starts over."""
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    try:
        yield
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def base_python() -> str:
    """The interpreter release environments are made from: the lab's own base Python."""
    return os.environ.get("VLLM_REPRO_PYTHON") or getattr(sys, "_base_executable", None) or sys.executable
