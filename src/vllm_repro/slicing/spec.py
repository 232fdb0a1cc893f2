"""Traces -> slice spec (``slices/<version>.json``) -> materialised slice tree and environment.

A spec names exactly what a slice holds:

- ``files``: the release's own files (``vllm/...`` and the ``tests/...`` used to prove the slice),
  each with its sha256 in the sdist; materialising copies them out of the cached sdist, unmodified,
  and checks every hash;
- ``requirements``: third-party distributions, pinned at the versions the trace loaded;
- ``stubs``: top-level packages replaced by stubs (see
  :mod:`vllm_repro.slicing.slice_runtime`), each with the trace's justification;
- ``traced``: how it was traced (scenarios with their sha256, the test selection, model
  stand-ins, the full environment, the lab's commit, the date).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import EnvError, InputError
from ..settings import IndexSettings, TorchSource, cache_dir
from ..sources import manifest
from ..sources.env import ReleaseEnv, base_python, fresh_env, index_args, run_uv, torch_install, uv_env
from ..sources.sdist import Release, safe_members, write_dist_info

SPEC_FORMAT = 1
RUNTIME = Path(__file__).with_name("slice_runtime.py")

#: Only packages at least this heavy are worth a stub (modules imported in the trace, or bytes
#: on disk); lighter import-only packages stay installed: a short stub list is easier to justify
#: and to trust.
STUB_MIN_MODULES = 15
STUB_MIN_BYTES = 5_000_000
#: Distributions that belong to the tracing harness, never to a slice.
HARNESS = {"pytest", "pluggy", "iniconfig", "pygments", "_pytest", "py"}


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Trace:
    """The union of the per-process records of :mod:`vllm_repro.slicing.tracer`."""

    modules: dict[str, str | None] = field(default_factory=dict)
    probed: set[str] = field(default_factory=set)
    opened: set[str] = field(default_factory=set)
    listed: set[str] = field(default_factory=set)
    calls: dict[str, dict[str, int]] = field(default_factory=dict)
    importers: dict[str, str | None] = field(default_factory=dict)
    metadata: dict[str, bool] = field(default_factory=dict)   # name looked up -> found
    processes: int = 0

    @classmethod
    def load(cls, *dirs: Path) -> "Trace":
        t = cls()
        for d in dirs:
            for f in sorted(Path(d).glob("trace.*.json")):
                rec = json.loads(f.read_text())
                t.processes += 1
                for k, v in rec["modules"].items():
                    if v or k not in t.modules:
                        t.modules[k] = v
                t.probed.update(rec["probed"])
                t.opened.update(rec["opened"])
                t.listed.update(rec["listed"])
                for callee, row in rec.get("calls", {}).items():
                    dst = t.calls.setdefault(callee, {})
                    for caller, n in row.items():
                        dst[caller] = dst.get(caller, 0) + n
                for k, v in rec.get("importers", {}).items():
                    t.importers.setdefault(k, v)
                for k, v in rec.get("metadata", {}).items():
                    t.metadata[k] = t.metadata.get(k, False) or v
        if not t.processes:
            raise EnvError(f"no trace records in {', '.join(map(str, dirs))}")
        return t


def site_packages(env_root: Path) -> Path:
    found = sorted(env_root.glob("lib/python*/site-packages"))
    if not found:
        raise EnvError(f"{env_root} has no lib/python*/site-packages")
    return found[0]


@dataclass
class Distributions:
    """Installed distributions of an environment: owner of each file, version, size."""

    owner: dict[str, str]          # path relative to site-packages -> canonical dist name
    version: dict[str, str]        # canonical name -> version
    name: dict[str, str]           # canonical name -> name as spelled in METADATA
    size: dict[str, int]           # canonical name -> bytes on disk
    tops: dict[str, set[str]]      # canonical name -> top-level import names

    @classmethod
    def scan(cls, site: Path) -> "Distributions":
        owner, version, name, size, tops = {}, {}, {}, {}, {}
        for info in sorted(site.glob("*.dist-info")):
            meta = info / "METADATA"
            try:
                head = meta.read_text(errors="replace").split("\n\n", 1)[0]
            except OSError:
                continue
            n = re.search(r"^Name: (.+)$", head, re.M)
            v = re.search(r"^Version: (.+)$", head, re.M)
            if not (n and v):
                continue
            c = canon(n.group(1).strip())
            name[c], version[c] = n.group(1).strip(), v.group(1).strip()
            total, t = 0, set()
            record = info / "RECORD"
            if record.is_file():
                for line in record.read_text(errors="replace").splitlines():
                    rel = line.rsplit(",", 2)[0]
                    if not rel or rel.startswith(("..", "/")):
                        continue
                    owner[rel] = c
                    p = site / rel
                    if p.is_file():
                        total += p.stat().st_size
                    first = rel.split("/", 1)[0]
                    if not first.endswith((".dist-info", ".data", ".pth")) and first != "__pycache__":
                        t.add(first[:-3] if first.endswith(".py") else first.split(".", 1)[0])
            size[c], tops[c] = total, t
        return cls(owner, version, name, size, tops)


def sdist_members(release: Release) -> dict[str, tarfile.TarInfo]:
    """Files of the sdist below its top folder: ``{relative path: member}``."""
    with tarfile.open(release.sdist, "r:gz") as tf:
        return {rel: m for m, rel in safe_members(tf, ("",)) if m.isfile()}


def _module_of(rel: str) -> str | None:
    """``vllm/a/b.py`` -> ``vllm.a.b``; ``vllm/a/__init__.py`` -> ``vllm.a``; else ``None``."""
    if not rel.endswith(".py"):
        return None
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@dataclass
class Analysis:
    """What a trace says a slice needs."""

    files: list[str]                      # tree-relative paths (vllm/..., tests/..., data files)
    dists: dict[str, dict]                # canonical name -> {version, modules, importers}
    candidates: dict[str, dict]           # top-level name -> stub justification
    listed_dirs: list[str]                # tree folders something listed (slicing may matter)
    vllm_modules: int


def analyse(trace: Trace, tree: Path, env_root: Path, package_files: set[str],
            include: tuple[str, ...] = ()) -> Analysis:
    """Map a trace onto the release tree and the environment.

    ``package_files``: every file of the release (tree-relative), so that probed but not imported
    ``vllm.*`` modules that exist are kept. ``include``: module names added by hand
    (``--include``), with their packages.
    """
    tree_r = str(tree.resolve()) + os.sep
    site = site_packages(env_root)
    site_r = str(site.resolve()) + os.sep
    dists = Distributions.scan(site)
    py_index: dict[str, str] = {}
    for rel in package_files:
        mod = _module_of(rel)
        if mod:
            py_index[mod] = rel
    files: set[str] = set()
    dist_use: dict[str, dict] = {}
    top_modules: dict[str, int] = {}

    def add_module(name: str) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            rel = py_index.get(".".join(parts[:i]))
            if rel:
                files.add(rel)

    for name, path in trace.modules.items():
        if not path:
            continue
        rp = os.path.realpath(path)
        if rp.startswith(tree_r):
            rel = rp[len(tree_r):]
            if rel in package_files:
                add_module(name)
                files.add(rel)
        elif rp.startswith(site_r):
            rel = rp[len(site_r):]
            top = rel.split("/", 1)[0]
            top = top[:-3] if top.endswith(".py") else top.split(".", 1)[0]
            if top in HARNESS:
                continue
            top_modules[top] = top_modules.get(top, 0) + 1
            d = dists.owner.get(rel)
            if d:
                u = dist_use.setdefault(d, {"modules": 0, "tops": set()})
                u["modules"] += 1
                u["tops"].add(top)
    for name in trace.probed | set(include):
        if name.split(".", 1)[0] in ("vllm", "tests") and name in py_index:
            add_module(name)
    for path in trace.opened:
        rp = os.path.realpath(path)
        if rp.startswith(tree_r) and rp[len(tree_r):] in package_files:
            files.add(rp[len(tree_r):])
        elif rp.startswith(site_r):
            d = dists.owner.get(rp[len(site_r):])
            if d and not rp[len(site_r):].split("/", 1)[0].endswith(".dist-info"):
                dist_use.setdefault(d, {"modules": 0, "tops": set()})
    # distributions looked up by name (importlib.metadata.version & co) and found
    for name, found in trace.metadata.items():
        c = canon(name)
        if found and c in dists.version and c not in dist_use:
            dist_use[c] = {"modules": 0, "tops": set(), "metadata_only": True}
    listed = sorted({os.path.realpath(p)[len(tree_r):] for p in trace.listed
                     if os.path.realpath(p).startswith(tree_r)})
    out_dists = {}
    for d, u in sorted(dist_use.items()):
        if d in HARNESS:
            continue
        out_dists[d] = {"name": dists.name[d], "version": dists.version[d],
                        "modules": u["modules"], "bytes": dists.size.get(d, 0),
                        "tops": sorted(u["tops"])}
        if u.get("metadata_only"):
            out_dists[d]["why"] = METADATA_ONLY
    # stub candidates: heavy top-level packages that nothing outside them ever called
    candidates = {}
    for top, n in sorted(top_modules.items()):
        if top in trace.calls:
            continue
        owner = next((d for d, u in dist_use.items() if top in u["tops"]), None)
        if owner is None or any(t in trace.calls for t in dists.tops.get(owner, ())):
            continue
        if n < STUB_MIN_MODULES and dists.size.get(owner, 0) < STUB_MIN_BYTES:
            continue
        importers = sorted({str(trace.importers.get(m)) for m in trace.modules
                            if (m == top or m.startswith(top + "."))
                            and trace.importers.get(m)
                            and not str(trace.importers.get(m)).startswith(top)})
        candidates[top] = {
            "distribution": dists.name[owner], "version": dists.version[owner],
            "modules_imported": n, "bytes": dists.size.get(owner, 0),
            "imported_by": importers[:12],
            "why": (f"{n} modules ({dists.size.get(owner, 0) / 1e6:.1f} MB installed) of {top} "
                    "imported by the modules above; no function or C function of it called "
                    "from outside it in the trace"),
        }
    vllm_n = sum(1 for f in files if f.startswith("vllm/") and f.endswith(".py"))
    return Analysis(sorted(files), out_dists, candidates, listed, vllm_n)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_hashes(release: Release, files: list[str]) -> dict[str, str]:
    """sha256 of each of ``files`` as stored in the sdist. Raises :class:`EnvError` if one is
    missing from it."""
    want = set(files)
    out: dict[str, str] = {}
    with tarfile.open(release.sdist, "r:gz") as tf:
        for m, rel in safe_members(tf, ("",)):
            if rel in want and m.isfile():
                out[rel] = sha256_bytes(tf.extractfile(m).read())
    missing = want - set(out)
    if missing:
        raise EnvError(f"{len(missing)} slice files are not in {release.sdist.name}: "
                       f"{sorted(missing)[:3]}")
    return dict(sorted(out.items()))


def package_inventory(release: Release) -> tuple[set[str], int, int]:
    """(every tree-relative file of the sdist, files in ``vllm/``, bytes in ``vllm/``)."""
    members = sdist_members(release)
    vllm = [m for rel, m in members.items() if rel.startswith("vllm/")]
    return set(members), len(vllm), sum(m.size for m in vllm)


# ---- materialising ----------------------------------------------------------------------------

def spec_key(spec: dict) -> str:
    """A short hash of what a materialised slice depends on (files, stubs, runtime code)."""
    h = hashlib.sha256()
    h.update(json.dumps({"files": spec["files"], "stubs": sorted(spec.get("stubs", {})),
                         "absent": spec.get("absent_count"),
                         # (the build-product folders below are made from these)
                         "listed": sorted(spec.get("listed_dirs") or ())}, sort_keys=True).encode())
    h.update(RUNTIME.read_bytes())
    return h.hexdigest()[:12]


def _no_python(rel_dirs, members: list[str]) -> list[str]:
    """Those of ``rel_dirs`` (tree-relative folders) that the sdist has with no ``.py`` or
    ``.so`` file directly in them: placeholders a CUDA build fills (``vllm/vllm_flash_attn``
    holds only ``.gitkeep`` in 0.10 to 0.16 sdists)."""
    present, with_code = set(), set()
    for rel in members:
        parent = str(PurePosixPath(rel).parent)
        present.update((parent, rel.rstrip("/")))  # (a folder's own entry, when the tar has one)
        if rel.endswith((".py", ".so")):
            with_code.add(parent)
    return sorted(d for d in rel_dirs if d in present and d not in with_code)


def absent_modules(release: Release, spec: dict) -> list[str]:
    """``vllm.*`` modules of the release that the slice leaves out."""
    members = sdist_members(release)
    have = set(spec["files"])
    return sorted(m for rel in members if rel.startswith("vllm/")
                  and (m := _module_of(rel)) and rel not in have)


def materialise(spec: dict, release: Release, target: Path | None = None) -> Path:
    """Extract the slice's files (and only them) from the cached sdist into a slice tree, check
    every sha256 against the spec, add the dist-info, stubs and run-time finder. Returns the tree
    (``cache/slices/<version>-<key>/``, reused when already there). Raises :class:`EnvError` on a
    hash mismatch (the sdist is not the one the slice was made from), or when the tree is not
    there and the sdist was dropped (:meth:`~vllm_repro.sources.sdist.Release.require_sdist`)."""
    version = spec["vllm"]
    target = target or cache_dir() / "slices" / f"{version}-{spec_key(spec)}"
    stamp = target / ".materialised"
    if stamp.is_file():
        if not manifest.has_manifest(target):  # a slice made before manifests
            try:
                manifest.write(target, spec["files"])
            except OSError:
                pass
        return target
    release.require_sdist()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=target.parent))
    try:
        want = spec["files"]
        done = set()
        names = []
        with tarfile.open(release.sdist, "r:gz") as tf:
            for m, rel in safe_members(tf, ("",)):
                names.append(rel)
                if rel not in want or not m.isfile():
                    continue
                data = tf.extractfile(m).read()
                if sha256_bytes(data) != want[rel]:
                    raise EnvError(f"{rel} in {release.sdist.name} does not match the slice's "
                                   "sha256; re-slice this release")
                p = tmp / PurePosixPath(rel)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
                done.add(rel)
        if set(want) - done:
            raise EnvError(f"{len(set(want) - done)} slice files missing from {release.sdist.name}")
        # a folder the traced runs listed that holds no Python in the sdist (a CUDA build's
        # placeholder) is there, empty, as in the full tree: the lab's stand-in finder
        # (engine/adapter/platform.py, BuildProductStandIns) answers an import of it alike
        for d in _no_python(spec.get("listed_dirs") or (), names):
            (tmp / PurePosixPath(d)).mkdir(parents=True, exist_ok=True)
        write_dist_info(tmp, version)
        stubs = {top: {"distribution": s["distribution"], "version": s["version"]}
                 for top, s in spec.get("stubs", {}).items()}
        (tmp / "_vllm_slice.json").write_text(json.dumps({
            "vllm": version, "stubs": stubs, "absent": absent_modules(release, spec)}))
        shutil.copy(RUNTIME, tmp / "_vllm_slice.py")
        (tmp / "sitecustomize.py").write_text(
            "# generated by vllm-repro: the slice's finder and stubs\nimport _vllm_slice  # noqa\n")
        for dist_name, dist_version in sorted({(s["distribution"], s["version"])
                                                for s in stubs.values()}):
            # the stub answers importlib.metadata.version() as the traced environment did
            # (transformers checks its dependencies' versions at import); it says it is a stub
            info = tmp / f"{canon(dist_name).replace('-', '_')}-{dist_version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {dist_version}\n"
                f"Summary: stub of {dist_name} {dist_version} in the slice of vLLM {version} "
                "(vllm-repro): import-only, fails loudly on use\n")
            (info / "INSTALLER").write_text("vllm-repro-stub\n")
            (info / "RECORD").write_text("")
        for top in stubs:
            d = tmp / top
            d.mkdir()
            (d / "__init__.py").write_text(
                f'"""Stub of {top!r} in the slice of vLLM {version} (see _vllm_slice.json)."""\n'
                "import _vllm_slice\n_vllm_slice.stub_module(__name__, __file__)\n")
        stamp_tmp = tmp / ".materialised"
        stamp_tmp.write_text(json.dumps({"files": len(want), "stubs": sorted(stubs)}))
        manifest.write(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def requirements_of(spec: dict) -> list[str]:
    """The slice environment's requirements: ``name==version`` for every traced distribution."""
    return [f"{d['name']}=={d['version']}" for d in spec["requirements"].values()]


#: A requirement the trace saw looked up by name only (``importlib.metadata``), never imported
#: and no file of it opened (:func:`analyse`): the slice environment keeps its metadata alone
METADATA_ONLY = "metadata looked up by name (importlib.metadata), never imported"


def metadata_only(spec: dict) -> list[str]:
    """Names of the slice's requirements that only had their metadata read (:data:`METADATA_ONLY`:
    huggingface_hub asks for hf-xet's version and never imports it, 128 MB over the catalog)."""
    return sorted(d["name"] for d in spec["requirements"].values()
                  if d.get("why") == METADATA_ONLY and not d.get("modules"))


def keep_metadata_only(site: Path, names: list[str]) -> int:
    """Remove, from the environment's ``site`` packages, every file the ``RECORD`` of each of
    ``names`` lists below ``site`` except its ``.dist-info`` and any file another
    distribution's ``RECORD`` lists too (``importlib.metadata`` still finds the distribution
    and its version; nothing can import it, as nothing did in the trace), and the folders left
    empty. Returns the bytes removed. Raises ``OSError``."""
    freed = 0
    wanted = {canon(n) for n in names}
    infos = {info: canon(info.name[:-len(".dist-info")].rsplit("-", 1)[0])
             for info in site.glob("*.dist-info")}
    # a file another distribution's RECORD lists too (a shared namespace package's
    # ``__init__.py``) stays
    others = {line.split(",", 1)[0] for info, name in infos.items() if name not in wanted
              and (info / "RECORD").is_file() for line in (info / "RECORD").read_text().splitlines()}
    for info, name in infos.items():
        if name not in wanted:
            continue
        record = info / "RECORD"
        if not record.is_file():
            continue
        dirs = set()
        for line in record.read_text().splitlines():
            rel = line.split(",", 1)[0]
            f = (site / rel).resolve()
            if not rel or rel.startswith(info.name + "/") or site.resolve() not in f.parents \
                    or rel in others:
                continue
            if f.is_file():
                freed += f.stat().st_size
                f.unlink()
                dirs.update(d for d in f.parents if site.resolve() in d.parents)
        for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    return freed


def slice_env(spec: dict, tree: Path, say=lambda s: None, rebuild: bool = False) -> ReleaseEnv:
    """Build (once) the slice's environment: torch from the configured torch source and every
    other traced distribution pinned, installed with ``--no-deps`` (nothing the trace did not
    load); a distribution whose metadata alone was read keeps only its metadata
    (:func:`keep_metadata_only`). Lives in ``envs/<version>-slice-<hash>/``. Raises
    :class:`EnvError` on uv failure."""
    reqs = requirements_of(spec)
    meta_only = metadata_only(spec)
    key = hashlib.sha256("\n".join([*sorted(reqs), *(f"metadata-only {n}" for n in meta_only)])
                         .encode()).hexdigest()[:12]
    root = cache_dir() / "envs" / f"{spec['vllm']}-slice-{key}"
    ready = root / ".ready.json"
    if ready.is_file() and not rebuild and (root / "bin" / "python").exists():
        return ReleaseEnv(spec["vllm"], tree, root)
    index = IndexSettings.from_pip()
    torch = TorchSource.resolve(index)
    env = uv_env(index)
    log = root.parent / f"{root.name}.build.log"
    say(f"vLLM {spec['vllm']}: building the slice environment ({len(reqs)} distributions)")
    with fresh_env(root, log):
        run_uv(["venv", "-q", "--python", base_python(), str(root)], env,
               f"creating the slice environment of vLLM {spec['vllm']}", log)
        py = str(root / "bin" / "python")
        torch_pin = next((r for r in reqs if canon(r.split("==")[0]) == "torch"), None)
        others = [r for r in reqs if r is not torch_pin]
        if torch_pin:
            t_args, t_req = torch_install(index, torch, torch_pin)
            run_uv(["pip", "install", "-q", "--no-deps", "--python", py, *t_args, t_req], env,
                   f"installing {torch_pin}", log)
        req_file = root / "slice-requirements.txt"
        req_file.write_text("\n".join(others) + "\n")
        run_uv(["pip", "install", "-q", "--no-deps", "--python", py, *index_args(index),
                "-r", str(req_file)], env,
               f"installing the slice requirements of vLLM {spec['vllm']}", log)
        freeze = run_uv(["pip", "freeze", "--python", py], env, "listing the slice environment", log)
        if meta_only:
            site = next((root / "lib").glob("python3*/site-packages"))
            freed = keep_metadata_only(site, meta_only)
            say(f"vLLM {spec['vllm']}: {', '.join(meta_only)}: metadata only, as traced "
                f"({freed / 1e6:.0f} MB left out)")
        ready.write_text(json.dumps({"format": 1, "version": spec["vllm"], "slice": True,
                                     "freeze": freeze.split(), "metadata_only": meta_only}, indent=1))
    return ReleaseEnv(spec["vllm"], tree, root)


# ---- spec files -------------------------------------------------------------------------------

def slices_dir() -> Path:
    """Where ``<version>.json`` specs live: ``VLLM_REPRO_SLICES``, else the checkout's
    ``slices/`` (next to ``src/``), else ``./slices``."""
    env = os.environ.get("VLLM_REPRO_SLICES")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3] / "slices"
    return repo if repo.is_dir() else Path("slices")


def spec_path(version: str) -> Path:
    return slices_dir() / f"{version}.json"


def load_spec(version: str, path: Path | None = None) -> dict:
    """The committed slice spec of ``version``. Raises :class:`InputError` if there is none."""
    p = path or spec_path(version)
    try:
        spec = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"no slice of vLLM {version} ({p}); run `vllm-repro slice {version}`") from None
    except ValueError as exc:
        raise InputError(f"{p} is not valid JSON: {exc}") from exc
    if spec.get("format") != SPEC_FORMAT or spec.get("vllm") != version:
        raise InputError(f"{p} is not a format-{SPEC_FORMAT} slice of vLLM {version}")
    return spec


def lab_sources_sha256() -> str:
    """sha256 over the lab package's own Python files (path and bytes, sorted): which lab ran
    a traced run. ``vllm-repro slice`` reuses a traced full run only for the same lab: one
    from another checkout or an older lab is not the reference a slice run of this lab is
    compared with."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        if "__pycache__" in f.parts:
            continue
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def lab_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None
