"""Where the lab keeps things and where it fetches them from.

Every setting can be given as an environment variable; the Makefile passes its variables of the
same name through. Nothing here touches the network.

- ``VLLM_REPRO_CACHE``: the cache root (sdists, extracted trees, environments, uv's cache).
  Default: the user cache directory (``~/.cache/vllm-repro`` on Linux).
- The package index: ``PIP_INDEX_URL`` or pip's configured ``index-url`` (``pip config``), else
  PyPI. Extra indexes, find-links and the CA bundle come from pip's configuration the same way.
- The torch source: ``TORCH_VERSION`` (default 2.13.0, CPU build), ``TORCH_WHEEL_DIR`` (a local
  wheelhouse; when unset, pip's configured find-links are searched for a matching CPU wheel) and
  ``TORCH_INDEX_URL`` (default PyTorch's CPU index, used when no local wheel is found).
- Per range of releases (``SPECIFIER=VALUE`` entries, :func:`release_rules`): ``TORCH_BY_RELEASE``
  (the torch version) and ``REQUIREMENTS_BY_RELEASE`` (extra requirements).
- ``VLLM_REPRO_NEWEST``: the newest release the lab is kept working on (default
  :data:`NEWEST_RELEASE`): ``make test`` runs ``vllm-repro doctor`` on it, ``make cpu-repro
  CATALOG=all`` runs every catalog entry on it too (the Makefile's ``NEWEST`` reads this file).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PYPI_SIMPLE = "https://pypi.org/simple"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DEFAULT_TORCH_VERSION = "2.13.0"
#: the newest vLLM release the lab is kept working on (``doctor`` in ``make test``); the
#: Makefile's ``NEWEST`` reads this line
NEWEST_RELEASE = "0.34.0"


def newest_release() -> str:
    """``VLLM_REPRO_NEWEST``, else :data:`NEWEST_RELEASE`."""
    return os.environ.get("VLLM_REPRO_NEWEST", "").strip() or NEWEST_RELEASE


def cache_dir() -> Path:
    """The lab's cache root (created on demand by the users of each sub-folder). Raises
    :class:`~vllm_repro.errors.InputError` (exit 2) when ``VLLM_REPRO_CACHE`` (or the default)
    is a regular file, lies under one, or is a symlink loop."""
    from .inputs import folder

    env = os.environ.get("VLLM_REPRO_CACHE")
    if env:
        return folder(env, "VLLM_REPRO_CACHE folder",
                      "point VLLM_REPRO_CACHE at a folder, or unset it for the default",
                      creatable=True)
    from platformdirs import user_cache_dir

    return folder(user_cache_dir("vllm-repro"), "default cache folder",
                  "set VLLM_REPRO_CACHE to a folder", creatable=True)


@functools.lru_cache(maxsize=1)
def pip_config() -> dict[str, str]:
    """pip's merged configuration as ``{"global.index-url": ..., ...}`` (``pip config list``).

    Environment variables (``PIP_INDEX_URL`` ...) are reported by pip as ``:env:.index-url``; they
    are folded in under the ``global.`` key since they win over files. Returns ``{}`` when pip is
    unavailable.
    """
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    conf: dict[str, str] = {}
    env_values: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        value = value.strip().strip("'\"")
        key = key.strip()
        if key.startswith(":env:."):
            env_values["global." + key[len(":env:.") :]] = value
        else:
            section, _, name = key.partition(".")
            # install.* and global.* both apply to `pip install`; install wins over global.
            if section in ("global", "install", "download"):
                if section == "global" and f"global.{name}" in conf:
                    continue
                conf[f"global.{name}"] = value
    conf.update(env_values)
    return conf


def _split(value: str | None) -> list[str]:
    return [v for v in (value or "").split() if v]


@dataclass(frozen=True)
class IndexSettings:
    """The package index as pip sees it: URLs, find-links and CA bundle."""

    index_url: str
    extra_index_urls: list[str] = field(default_factory=list)
    find_links: list[str] = field(default_factory=list)
    cert: str | None = None

    @classmethod
    def from_pip(cls) -> "IndexSettings":
        conf = pip_config()
        index = os.environ.get("PIP_INDEX_URL") or conf.get("global.index-url") or PYPI_SIMPLE
        extra = _split(os.environ.get("PIP_EXTRA_INDEX_URL") or conf.get("global.extra-index-url"))
        links = _split(os.environ.get("PIP_FIND_LINKS") or conf.get("global.find-links"))
        cert = os.environ.get("PIP_CERT") or conf.get("global.cert") or None
        return cls(index_url=index.rstrip("/"), extra_index_urls=extra, find_links=links, cert=cert)


#: ``TORCH_BY_RELEASE``'s default: none, every release gets ``TORCH_VERSION``. The releases tried
#: (the catalog's, 0.6.6.post1 to 0.33.0, and 0.7.3, 0.8.1, 0.17.1) import their scheduler and
#: engine-core path with torch 2.13 under the lab's (emulated CUDA) platform. 0.17.x pins torch
#: 2.10 and fails to import with 2.13 only under vLLM's CPU platform
#: (``torch._C._cpu._is_avx512_supported``), which ``platform: {name: cpu}`` scenarios on 0.17.x
#: need: ``TORCH_BY_RELEASE='>=0.17.0,<0.18=2.10.0'``. The V0 engine (``level: v0-engine``) of
#: 0.6.3.post1 (which pins torch 2.4.0) and 0.8.5 (2.6.0) imports and runs with torch 2.13 CPU too
#: (their compiled extensions stood in for as on V1 releases), so no entry is needed for them;
#: nor for 0.4.3 (pins 2.3.0), 0.5.5 and 0.6.0 (2.4.0), which import and run their V0 engine with
#: 2.13 too (with ``REQUIREMENTS_BY_RELEASE``'s default); 0.4.0 (2.1.2) imports with it as well.
DEFAULT_TORCH_BY_RELEASE = ""


#: one entry of a per-release-range setting: ``SPECIFIER=VALUE``, the specifier a PEP 440 set
#: (``>=0.17.0,<0.18``; its versions hold no ``=``, so the first ``=`` after them splits)
_RANGE_ENTRY = re.compile(r"^\s*((?:(?:===|~=|==|!=|<=|>=|<|>)\s*[^\s,=<>!~;]+\s*,?\s*)+)=\s*(\S.*?)\s*$")


@dataclass(frozen=True)
class ReleaseRule:
    """One ``SPECIFIER=VALUE`` entry of a per-release-range setting (``TORCH_BY_RELEASE``,
    ``REQUIREMENTS_BY_RELEASE``): ``spec`` the PEP 440 specifier set of releases, ``value``
    what those releases get, ``entry`` the text as written (for messages)."""

    spec: str
    value: str
    entry: str

    def holds(self, release: str) -> bool:
        """Whether ``release`` (a PEP 440 version; ``0.5.3.post1`` is in ``<0.5.4``) is in the
        range."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(release) in SpecifierSet(self.spec)


def release_rules(variable: str, raw: str, value_kind: str, example: str, check) -> list[ReleaseRule]:
    """The entries of a per-release-range setting: ``SPECIFIER=VALUE`` entries separated by
    ``;`` (blank entries skipped). ``check(value)`` raises ``ValueError`` for a value that is not
    a ``value_kind``. Raises :class:`~vllm_repro.errors.InputError` naming ``variable`` and the
    bad entry, e.g. ``TORCH_BY_RELEASE entry '>=0.17.0' is not SPECIFIER=VERSION (e.g. ...)``."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    from .errors import InputError

    rules = []
    for entry in filter(None, (e.strip() for e in raw.split(";"))):
        m = _RANGE_ENTRY.match(entry)
        try:
            if not m:
                raise ValueError(entry)
            spec, value = m.group(1).strip().rstrip(",").strip(), m.group(2)
            SpecifierSet(spec)
            check(value)
        except (InvalidSpecifier, ValueError):
            shown = entry if len(entry) <= 80 else entry[:80] + "..."
            raise InputError(f"{variable} entry {shown!r} is not SPECIFIER={value_kind} "
                             f"(e.g. {example!r}); fix or unset {variable}") from None
        rules.append(ReleaseRule(spec, value, entry))
    return rules


def torch_for_release(release: str) -> str | None:
    """The torch version ``TORCH_BY_RELEASE`` gives ``release``, or None.

    Format: ``SPECIFIER=VERSION`` entries separated by ``;``, the first whose PEP 440 specifier
    set holds the release wins: ``>=0.17.0,<0.18=2.10.0;<0.7=2.5.1``. Raises
    :class:`~vllm_repro.errors.InputError` naming the bad entry."""
    from packaging.version import Version

    raw = os.environ.get("TORCH_BY_RELEASE", DEFAULT_TORCH_BY_RELEASE)
    rules = release_rules("TORCH_BY_RELEASE", raw, "VERSION", ">=0.17.0,<0.18=2.10.0", Version)
    return next((r.value for r in rules if r.holds(release)), None)


#: ``REQUIREMENTS_BY_RELEASE``'s default, what the oldest V0 releases need to import on today's
#: index (each entry checked on the releases named):
#:
#: - ``<0.5.4=triton``: 0.4.0 to 0.5.3.post1 import ``triton`` at module level
#:   (``vllm/model_executor/sampling_metadata.py`` -> ``layers/ops/sample.py``; 0.5.4 moved it
#:   behind ``vllm/triton_utils``), and the builder leaves triton out (GPU tooling). Resolved as
#:   of the release's date like the rest (triton 2.3.x for 0.4.3).
#: - ``>=0.5.0,<0.6.0=outlines==0.0.41``: 0.5.x requires ``outlines >= 0.0.43`` and imports it
#:   with ``import vllm`` (``vllm/entrypoints/llm.py`` -> ``guided_decoding``; 0.6.0 made it lazy).
#:   outlines 0.0.43 to 0.0.46 import ``pyairports`` at import, and the index no longer has that
#:   project's files: its only ``pyairports`` (0.0.1, uploaded in 2025) is an unrelated package
#:   with no ``pyairports`` module. 0.0.41, the last before, has everything 0.5.x imports
#:   (``outlines.fsm.guide``, ``grammars``, ``caching``, ``fsm.json_schema``); guided decoding
#:   itself is never reached at ``level: v0-engine``.
DEFAULT_REQUIREMENTS_BY_RELEASE = "<0.5.4=triton; >=0.5.0,<0.6.0=outlines==0.0.41"


def requirements_for_release(release: str) -> list[ReleaseRule]:
    """The ``REQUIREMENTS_BY_RELEASE`` entries whose range holds ``release``, in order: each
    ``value`` a PEP 508 requirement (no marker: its ``;`` would end the entry) that the
    release's environment gets besides its own requirements, and that wins over the release's
    (or a dependency's) requirement of the same distribution (see ``sources/env.py``).

    Format: ``SPECIFIER=REQUIREMENT`` entries separated by ``;``, every matching entry applies:
    ``<0.5.4=triton; >=0.5.0,<0.6.0=outlines==0.0.41`` (the default,
    :data:`DEFAULT_REQUIREMENTS_BY_RELEASE`; set the variable empty for none). Raises
    :class:`~vllm_repro.errors.InputError` naming the bad entry."""
    from packaging.requirements import InvalidRequirement, Requirement

    def check(value: str) -> None:
        try:
            req = Requirement(value)
        except InvalidRequirement as exc:
            raise ValueError(value) from exc
        if req.url or req.marker:
            raise ValueError(value)

    raw = os.environ.get("REQUIREMENTS_BY_RELEASE", DEFAULT_REQUIREMENTS_BY_RELEASE)
    rules = release_rules("REQUIREMENTS_BY_RELEASE", raw, "REQUIREMENT",
                          ">=0.5.0,<0.6.0=outlines==0.0.41", check)
    return [r for r in rules if r.holds(release)]


@dataclass(frozen=True)
class TorchSource:
    """Where the CPU build of torch comes from.

    ``wheel``: a local wheel file (from ``TORCH_WHEEL_DIR`` or pip's find-links), else ``None``
    and torch is taken from ``index_url`` (PyTorch's CPU index by default).
    """

    version: str
    wheel: Path | None
    index_url: str

    @property
    def requirement(self) -> str:
        """The pinned requirement, e.g. ``torch==2.13.0+cpu`` (the CPU build's local version)."""
        if self.wheel is not None:
            # torch-2.13.0+cpu-cp311-...whl -> 2.13.0+cpu
            return "torch==" + self.wheel.name.split("-")[1]
        return f"torch=={self.version}+cpu"

    def describe(self) -> str:
        return str(self.wheel) if self.wheel else f"{self.index_url} (torch {self.version}+cpu)"

    @classmethod
    def resolve(cls, index: IndexSettings | None = None, release: str | None = None) -> "TorchSource":
        """The torch source for ``release`` (``TORCH_BY_RELEASE`` first, then ``TORCH_VERSION``).
        Raises :class:`~vllm_repro.errors.InputError` for a malformed ``TORCH_BY_RELEASE``."""
        version = (torch_for_release(release) if release else None) \
            or os.environ.get("TORCH_VERSION") or DEFAULT_TORCH_VERSION
        tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
        dirs: list[str] = []
        if os.environ.get("TORCH_WHEEL_DIR"):
            dirs.append(os.environ["TORCH_WHEEL_DIR"])
        else:
            dirs.extend(link for link in (index or IndexSettings.from_pip()).find_links)
        for d in dirs:
            path = Path(d.removeprefix("file://"))
            if not path.is_dir():
                continue
            for wheel in sorted(path.glob(f"torch-{version}*-{tag}-{tag}-*.whl")):
                local = wheel.name.split("-")[1]
                if "+cpu" in local or sys.platform == "darwin":
                    return cls(version=version, wheel=wheel, index_url="")
        return cls(
            version=version,
            wheel=None,
            index_url=os.environ.get("TORCH_INDEX_URL") or TORCH_CPU_INDEX,
        )
