"""An installed vLLM instead of a release's sdist: ``VLLM_REPRO_VLLM=installed``.

The CUDA image is vLLM's own server image: the full vLLM of one release is installed in its
Python, and there is no sdist, tree or per-release environment to build. In installed mode the
lab's worker runs with that interpreter and imports *its* vLLM; every run is on the installed
release, whatever the scenario names.

``VLLM_REPRO_VLLM``:

- unset or ``release``: the default, each release from its sdist in its own environment;
- ``installed``: the vLLM this interpreter (the lab's own) imports;
- ``installed:/path/to/python``: the vLLM another interpreter imports (the CPU image uses this
  to stand in for the CUDA one: each baked release environment imports its tree).

Nothing here imports vLLM: the interpreter is asked where the package is and which version its
metadata names, in a subprocess, so probing is cheap and never initialises CUDA.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ..errors import EnvError, InputError

MODE_VAR = "VLLM_REPRO_VLLM"

_PROBE = r"""
import importlib.metadata as md, importlib.util as u, json, site, sys, sysconfig
spec = u.find_spec("vllm")
try:
    version = md.version("vllm")
except md.PackageNotFoundError:
    version = None
loc = list(spec.submodule_search_locations or []) if spec else []
sites = list(getattr(site, "getsitepackages", lambda: [])())
sites += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
print(json.dumps({"found": spec is not None, "version": version, "package_dir": loc[0] if loc else None,
                  "python": sys.executable, "site_packages": list(dict.fromkeys(sites))}))
"""


@dataclass(frozen=True)
class InstalledVllm:
    """The vLLM an interpreter imports.

    ``version`` as installed (``0.10.1.1+cu128``); ``release`` its public part (``0.10.1.1``);
    ``package_dir`` the ``vllm`` package folder; ``root`` the folder a patch's ``vllm/...`` paths
    are relative to (site-packages, or a release tree); ``site_packages`` the interpreter's own
    environment's package folders (``site.getsitepackages()``, ``sysconfig``'s ``purelib`` and
    ``platlib``).
    """

    python: Path
    version: str
    release: str
    package_dir: Path
    site_packages: tuple[Path, ...] = ()

    @property
    def root(self) -> Path:
        return self.package_dir.parent

    @property
    def in_environment(self) -> bool:
        """Whether this vLLM is a distribution installed in its interpreter's own environment
        (its package folder directly in one of :attr:`site_packages`, as pip installs it: the
        CUDA image), not a tree the interpreter imports by path (a ``.pth`` or ``PYTHONPATH``
        entry outside them: the CPU image's baked release trees, a source checkout)."""
        try:
            root = self.root.resolve()
            return any(root == Path(s).resolve() for s in self.site_packages)
        except OSError:
            return False


def installed_python() -> Path | None:
    """The interpreter named by ``VLLM_REPRO_VLLM`` (``installed`` -> this one), or ``None`` in
    the default release mode. Raises :class:`InputError` for any other value."""
    raw = os.environ.get(MODE_VAR, "").strip()
    if raw in ("", "release"):
        return None
    if raw == "installed":
        return Path(sys.executable)
    if raw.startswith("installed:") and raw[len("installed:"):]:
        return Path(raw[len("installed:"):])
    raise InputError(f"{MODE_VAR}={raw!r}: expected 'release', 'installed' or "
                     "'installed:/path/to/python'")


@functools.lru_cache(maxsize=8)
def probe(python: Path) -> InstalledVllm:
    """Ask ``python`` (a subprocess, about 0.1 s; vLLM is located, never imported) which vLLM
    it has. Raises :class:`EnvError` when the interpreter cannot run or has no vLLM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    try:
        proc = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True,
                              env=env, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise EnvError(f"installed mode: cannot run {python}: {exc}") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EnvError(f"installed mode: {python} failed to probe for vLLM: {tail}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    if not info["found"] or not info["package_dir"]:
        # the way back to releases only where the variable is what asked for this interpreter
        # (gpu-judge in the CPU image asks the lab's own without it)
        back = (f"; unset {MODE_VAR} to run releases from their sdists"
                if os.environ.get(MODE_VAR, "").strip() else "")
        raise EnvError(f"installed mode: {python} has no vLLM installed (import vllm would fail)"
                       f"{back}")
    if not info["version"]:
        raise EnvError(f"installed mode: the vLLM at {info['package_dir']} has no package metadata "
                       "(no vllm-*.dist-info), so its release is unknown")
    try:
        release = Version(info["version"]).public
    except InvalidVersion:
        raise EnvError(f"installed mode: vLLM version {info['version']!r} is not a version") from None
    return InstalledVllm(Path(python), info["version"], release, Path(info["package_dir"]),
                         tuple(Path(p) for p in info.get("site_packages") or ()))


def python_importing(tree: Path, inst: InstalledVllm, where: Path) -> Path:
    """An interpreter, made in the new folder ``where``, that imports vLLM from ``tree`` and
    everything else from ``inst``'s virtual environment: a venv of the same base Python (its
    ``pyvenv.cfg``) whose ``.pth`` puts ``tree`` first on ``sys.path`` (where a run's
    ``PYTHONPATH`` puts a tree), then ``inst``'s ``site-packages``, its own ``.pth`` files
    processed (the release tree it imports comes after, shadowed). gpu-judge runs a patched copy
    of a CPU image's baked tree with it. Returns its ``bin/python``. Raises :class:`EnvError`
    when ``inst``'s interpreter is not a venv's."""
    env = inst.python.parent.parent
    sites = sorted(env.glob("lib/python3*/site-packages"))
    if not (env / "pyvenv.cfg").is_file() or len(sites) != 1:
        raise EnvError(f"{inst.python} is not a virtual environment's interpreter (no pyvenv.cfg "
                       "beside its bin, or not one site-packages): no interpreter of it can import "
                       f"another copy of its vLLM ({tree})")
    site = where / sites[0].relative_to(env)
    site.mkdir(parents=True)
    (where / "pyvenv.cfg").write_text((env / "pyvenv.cfg").read_text())
    (where / "bin").mkdir()
    (where / "bin" / "python").symlink_to(inst.python.resolve())
    (site / "vllm-repro-release.pth").write_text(
        f"{tree}\nimport site; site.addsitedir({str(sites[0])!r})\n")
    return where / "bin" / "python"


def installed() -> InstalledVllm | None:
    """The installed vLLM when ``VLLM_REPRO_VLLM`` asks for one, else ``None``."""
    py = installed_python()
    return probe(py) if py is not None else None


def check_release(inst: InstalledVllm, version: str) -> None:
    """Raise :class:`InputError` unless ``version`` is the installed release (an installed vLLM
    can run no other)."""
    try:
        same = Version(version).public == inst.release
    except InvalidVersion:
        same = False
    if not same:
        raise InputError(f"installed mode: {inst.python} has vLLM {inst.version}, so vLLM {version} "
                         f"cannot run here (unset {MODE_VAR} to run releases from their sdists)")
