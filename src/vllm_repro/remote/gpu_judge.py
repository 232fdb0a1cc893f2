"""Inside the CUDA image: judge a verification bundle on the installed full vLLM.

``vllm-repro gpu-judge BUNDLE --out OUT`` (run by ``scripts/remote-run.sh`` in the container that
``vllm-repro gpu-verify`` starts on the GPU host):

1. check the bundle against its manifest (sha256 of every file);
2. find the installed vLLM and check that it is the bundle's release;
3. run the shared suite (the bundle's copy of ``tests/shared``, on the bundle's scenarios) on the
   pristine vLLM, JUnit XML to ``OUT/junit-before.xml``: the bug must reproduce;
4. apply the patch (``git apply``; refused unless it applies cleanly) to the installed vLLM, in
   place; in the CPU image, standing in for the CUDA one, to a copy of the baked release tree
   (the baked tree stays as baked: read-only for the image's user, pristine for every other
   run; :func:`apply_patch`);
5. run the suite again with ``VLLM_REPRO_FIXED=<scenario>``, JUnit XML to ``OUT/junit.xml``: the
   scenario must now run clean and every other entry keep its verdict;
6. write ``OUT/summary.json`` and exit 0 (verified), 1 (not verified), 2 (bad bundle, patch does
   not apply), 3 (no installed vLLM, wrong release).

Progress lines start with ``[gpu-judge]`` so the client can show the phase.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from ..errors import EXIT_ENV, EXIT_INPUT, EXIT_MISMATCH, EXIT_OK, EnvError, InputError, LabError
from ..settings import cache_dir
from ..sources.installed import MODE_VAR, InstalledVllm, installed_python, probe, python_importing

PHASE = "[gpu-judge]"


def phase(msg: str) -> None:
    """Print a progress line the client shows as the current phase (stdout, flushed)."""
    print(f"{PHASE} {msg}", flush=True)


#: the most files a bundle's manifest may list (a bundle holds a scenario, a patch, the
#: shared suite and its scenarios: a few hundred)
MAX_BUNDLE_FILES = 20_000


def _bundle_file(bundle: Path, rel: object) -> Path:
    """``bundle / rel`` for a name of the manifest, or :class:`InputError` for a name that
    leaves the bundle (absolute, ``..``, a NUL) or a path through a symlink or to anything but
    a regular file: the judge reads and hashes nothing outside the bundle."""
    import os
    import stat

    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/") \
            or ".." in Path(rel).parts:
        raise InputError(f"bundle manifest.json: file name {str(rel)[:80]!r} is not a path inside "
                         "the bundle; remake the bundle with vllm-repro verify --bundle")
    path = bundle
    for part in Path(rel).parts:
        path = path / part
        try:
            st = os.lstat(path)
        except OSError:
            raise InputError(f"bundle file {rel} is missing") from None
        if stat.S_ISLNK(st.st_mode):
            raise InputError(f"bundle file {rel}: {path} is a symlink; a bundle holds only "
                             "regular files and folders (remake it)")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"bundle file {rel} is not a regular file; remake the bundle")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_manifest(bundle: Path) -> dict:
    """The bundle's manifest, after checking every file's sha256. Raises :class:`InputError`
    for a missing manifest, a missing file, a mismatch, a name that leaves the bundle (``../``,
    an absolute path) and a symlink anywhere in the bundle (the judge reads nothing outside
    it)."""
    import os

    for top, dirs, files in os.walk(bundle):
        for name in dirs + files:
            p = Path(top) / name
            if p.is_symlink():
                raise InputError(f"{p}: a symlink in the bundle; a bundle holds only regular "
                                 "files and folders (remake it)")
    try:
        manifest = json.loads((bundle / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{bundle}: no readable manifest.json ({exc.__class__.__name__}); "
                         "not a verification bundle") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sha256", {}), dict):
        raise InputError(f"{bundle}: manifest.json is not a JSON object with a sha256 mapping; "
                         "not a verification bundle")
    entries = manifest.get("sha256", {})
    if len(entries) > MAX_BUNDLE_FILES:
        raise InputError(f"{bundle}: manifest.json lists {len(entries):,} files (at most "
                         f"{MAX_BUNDLE_FILES:,}); not a verification bundle")
    for rel, sha in entries.items():
        f = _bundle_file(bundle, rel)
        if _sha256(f) != sha:
            raise InputError(f"bundle file {rel} does not match its sha256 in manifest.json")
    return manifest


def bundle_identity(bundle: Path, manifest: dict) -> tuple[str, str]:
    """The release (``release.txt``) and scenario name (the manifest's ``scenario``, else
    ``verdict.json``'s) a bundle verifies. Raises :class:`InputError` (exit 2) where either is
    missing or unreadable: a hand-made or truncated bundle, not a lab failure."""
    try:
        release = (bundle / "release.txt").read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{bundle}: no readable release.txt ({exc.__class__.__name__}); not a "
                         "verification bundle (make one with vllm-repro verify)") from None
    name = manifest.get("scenario")
    if not name:
        try:
            name = json.loads((bundle / "verdict.json").read_text()).get("scenario")
        except (OSError, ValueError, AttributeError) as exc:
            raise InputError(f"{bundle}: no readable verdict.json ({exc.__class__.__name__}); "
                             "not a verification bundle (make one with vllm-repro verify)") from None
    if not release or not isinstance(name, str) or not name:
        raise InputError(f"{bundle}: release.txt or the scenario's name (manifest.json / "
                         "verdict.json) is empty; not a verification bundle (make one with "
                         "vllm-repro verify)")
    return release, name


def find_installed(release: str) -> InstalledVllm:
    """The installed vLLM to judge on: ``VLLM_REPRO_VLLM`` if set; else this interpreter's vLLM
    (the CUDA image); else, in the CPU image standing in for the CUDA one, the baked
    environment of ``release`` (its interpreter imports the release's tree): its full tree where
    the image has one (``baked.json`` key ``VERSION:full``), as the CUDA image has all of vLLM,
    else its slice. A slice holds only what the scheduler-level runs traced, so a bundle carrying
    an engine-core or V0 entry of that release fails on it. Raises :class:`EnvError` when there
    is none or it is another release."""
    candidates: list[Path] = []
    errors = []
    named = installed_python()
    if named is not None:
        candidates.append(named)
    else:
        candidates.append(Path(sys.executable))
        try:  # the CPU image: images/cpu/bake.py lists each baked release's environment
            baked = json.loads((cache_dir() / "baked.json").read_text())
            candidates.append(Path(baked.get(f"{release}:full", baked[release])["python"]))
        except (OSError, ValueError, KeyError) as exc:
            errors.append(f"no baked environment of {release} in {cache_dir() / 'baked.json'} "
                          f"({type(exc).__name__})")
            candidates.append(cache_dir() / "envs" / release / "bin" / "python")
    for py in candidates:
        if not py.exists():
            continue
        try:
            inst = probe(py)
        except EnvError as exc:
            errors.append(str(exc))
            continue
        if inst.release != release:
            raise EnvError(f"the image has vLLM {inst.version} ({inst.package_dir}), the bundle is "
                           f"for {release}: use the CUDA image of {release} (or GPU_IMAGE=...)")
        return inst
    raise EnvError("no installed vLLM in this image: " + ("; ".join(errors) or "none found"))


def apply_in_place(patch: Path, inst: InstalledVllm) -> None:
    """``git apply`` the patch to the installed vLLM, after a ``--check`` dry run. Raises
    :class:`InputError` (git's first complaint) when it does not apply cleanly."""
    from ..verify.patch import _strip_level, patch_files

    patch_files(patch)
    git = shutil.which("git")
    if git is None:
        raise EnvError("git is not installed in the image; it is needed to apply the patch")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(inst.root.parent))
    base = [git, "apply", f"-p{_strip_level(patch)}"]
    for args in (["--check"], []):
        proc = subprocess.run([*base, *args, str(patch.resolve())], cwd=inst.root, env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["does not apply"])[0]
            raise InputError(f"the patch does not apply cleanly to the installed vLLM {inst.version} "
                             f"at {inst.root}: {first}")


def apply_patch(patch: Path, inst: InstalledVllm, scratch: Path) -> InstalledVllm:
    """Apply the patch for the suite's second run; returns the vLLM to run it on. Decided by
    what the vLLM is, not where the cache is (``VLLM_REPRO_CACHE`` may point anywhere): a vLLM
    installed as a distribution in its interpreter's own environment (its package folder in that
    environment's site-packages: the CUDA image's, installed by pip;
    :attr:`~vllm_repro.sources.installed.InstalledVllm.in_environment`) is patched in place
    (:func:`apply_in_place`). Any other tree the interpreter imports by path (a ``.pth`` or
    ``PYTHONPATH`` entry outside site-packages: the CPU image's baked release trees standing in
    for it) is never written: the patch goes to a copy, made as ``vllm-repro verify`` makes its
    patched copies (:func:`~vllm_repro.verify.patch.patched_tree`, under ``<cache>/patched/``),
    and an interpreter of the same environment made in ``scratch`` imports the copy
    (:func:`~vllm_repro.sources.installed.python_importing`). Raises :class:`InputError` when
    the patch does not apply cleanly, :class:`EnvError` when the copy or its interpreter cannot
    be made."""
    from ..verify.patch import patched_tree

    if inst.in_environment:
        apply_in_place(patch, inst)
        return inst
    try:
        tree = patched_tree(inst.root, patch, inst.release)
        copy = probe(python_importing(tree, inst, scratch / "env"))
    except OSError as exc:
        raise EnvError(f"cannot make a patched copy of the baked vLLM {inst.version} ({inst.root}): "
                       f"{exc}") from None
    if copy.package_dir != tree / "vllm":
        raise EnvError(f"the interpreter made to import the patched copy {tree} imports the vLLM at "
                       f"{copy.package_dir} instead")
    return copy


def junit_counts(path: Path) -> dict:
    """``{"tests", "failures", "errors", "skipped"}`` summed over a JUnit XML file's suites."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {**counts, "errors": 1, "missing": True}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    return counts


def run_suite(suite: Path, scenarios: Path, out: Path, label: str, fixed: str | None,
              inst: InstalledVllm) -> dict:
    """Run the shared suite with pytest (this interpreter), JUnit to ``out/junit[-label].xml``.
    Returns the JUnit counts, pytest's exit code and the scenario results of this run."""
    junit = out / ("junit.xml" if label == "after" else f"junit-{label}.xml")
    reports = out / label
    env = dict(os.environ, VLLM_REPRO_CATALOG=str(scenarios), VLLM_REPRO_SUITE_REPORTS=str(reports))
    env[MODE_VAR] = f"installed:{inst.python}"
    env.pop("VLLM_REPRO_FIXED", None)
    if fixed:
        env["VLLM_REPRO_FIXED"] = fixed
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "shared or gpu", "-rs",
           "-o", "junit_family=xunit1",
           f"--junitxml={junit}", "-o", f"junit_suite_name=vllm-repro-shared-{label}", str(suite)]
    phase(f"suite {label}: {' '.join(cmd[2:])}")
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=suite.parent, check=False)
    counts = junit_counts(junit)
    phase(f"suite {label}: pytest exit {proc.returncode}, {counts['tests']} tests, "
          f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
          f"in {time.perf_counter() - t:.0f}s")
    return {"pytest_exit": proc.returncode, "junit": junit.name, **counts}


def scenario_result(out: Path, label: str, name: str, release: str) -> dict:
    """The outcome of ``name`` on ``release`` in the suite run ``label`` (from its
    ``result.json``), or ``outcome: missing`` when the suite did not run it."""
    from ..verdict import describe_observed

    from ..records import RecordError, ReportDir

    try:
        res = ReportDir(out / label, name, release).read_result()
    except (OSError, RecordError):
        return {"outcome": "missing", "observed": "no result (the suite did not run it)"}
    return {"outcome": res.outcome, "observed": describe_observed(res),
            "violations": len(res.violations or [])}


def judge(bundle: Path, out: Path) -> int:
    """Judge ``bundle`` on the installed vLLM, writing everything to ``out``; returns the exit
    code (see the module docstring). Never raises for lab errors: they go to the summary."""
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"bundle": str(bundle), "verified": False, "reasons": [], "started": time.time()}
    code = EXIT_ENV
    try:
        manifest = check_manifest(bundle)
        release, name = bundle_identity(bundle, manifest)
        summary.update(release=release, scenario=name)
        phase(f"bundle: {name} on vLLM {release} (manifest checked)")
        inst = find_installed(release)
        summary.update(installed={"version": inst.version, "python": str(inst.python),
                                  "package_dir": str(inst.package_dir)})
        phase(f"installed vLLM {inst.version} at {inst.package_dir}")
        suite = bundle / "tests" / "shared"
        if not suite.is_dir():  # a bundle made outside a checkout: the image's own copy
            suite = Path(__file__).resolve().parents[3] / "tests" / "shared"
        if not suite.is_dir():
            raise InputError("the bundle has no tests/shared and the image has none either")
        summary["suite"] = str(suite)
        scenarios = bundle / "scenarios"
        summary["before"] = run_suite(suite, scenarios, out, "before", None, inst)
        summary["before"].update(scenario_result(out, "before", name, inst.release))
        phase("applying the patch to the installed vLLM")
        with tempfile.TemporaryDirectory(prefix="vllm-repro-judge-") as scratch:
            patched = apply_patch(bundle / "patch.diff", inst, Path(scratch))
            summary["patched"] = True
            if patched != inst:
                summary["patched_copy"] = str(patched.package_dir.parent)
                phase(f"patched a copy of it (the baked tree stays as baked): {patched.package_dir}")
            summary["after"] = run_suite(suite, scenarios, out, "after", name, patched)
        summary["after"].update(scenario_result(out, "after", name, inst.release))
        b, a = summary["before"], summary["after"]
        if b["outcome"] in ("clean", "missing", "error"):
            summary["reasons"].append(f"before the patch: {b['observed']} (the bug did not reproduce)")
        if b["failures"] or b["errors"]:
            summary["reasons"].append(f"before the patch: {b['failures']} failed, {b['errors']} errors "
                                      "in the shared suite (see junit-before.xml)")
        if a["outcome"] != "clean" or a.get("violations"):
            summary["reasons"].append(f"after the patch: {a['observed']}")
        if a["tests"] - a.get("skipped", 0) <= 0:  # every test skipped: nothing was checked
            summary["reasons"].append(f"after the patch: all {a['tests']} tests of the shared "
                                      "suite were skipped; nothing was checked (see junit.xml)")
        elif a["failures"] or a["errors"]:
            summary["reasons"].append(f"after the patch: {a['failures']} failed, {a['errors']} errors "
                                      f"of {a['tests']} in the shared suite (see junit.xml)")
        summary["verified"] = not summary["reasons"]
        code = EXIT_OK if summary["verified"] else EXIT_MISMATCH
    except LabError as exc:
        summary["reasons"].append(str(exc))
        summary["error"] = {"kind": "input" if exc.exit_code == EXIT_INPUT else "env", "message": str(exc)}
        code = exc.exit_code
    summary["exit_code"] = code
    summary["finished"] = time.time()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    verdict = "verified" if summary["verified"] else "NOT verified"
    phase(f"{verdict}: " + ("reproduced before, clean after" if summary["verified"]
                            else "; ".join(summary["reasons"])))
    return code
