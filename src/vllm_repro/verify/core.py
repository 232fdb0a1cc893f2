"""``vllm-repro verify``: a fix proven on CPU, reproduced before and clean after.

The scenario runs on the release's pristine tree and on a patched copy; the other catalog
entries that name the release run on both too, and must keep their verdicts (a fix that changes
what another known bug does is suspicious). The verdict is ``verified`` only if the scenario
reproduces before, is clean after (audit on), and nothing else changed.

Everything goes into a verification bundle, ``reports/verify/<id>/``: the patch, the scenarios,
the shared test suite, the release, the CPU verdicts and a sha256 manifest. ``make gpu-verify``
ships that bundle to a GPU host for the final word.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import catalog_files
from ..errors import EnvError, InputError
from ..lab import RunItem, run_pairs
from ..sources.prepare import default_tree, prepare_release, resolve_tree
from ..scenario import load_scenario
from ..scenario.schema import Scenario
from ..verdict import describe_observed
from .patch import dry_run, patch_files, patched_tree



@dataclass
class Verification:
    """The outcome of a CPU verification. ``verified`` is the verdict; ``reasons`` why not;
    ``failed``: the error kind (``input``, ``lab``, ``env``: :class:`vllm_repro.records.RunError`)
    of a run before or after the patch that did not happen as a run of vLLM (the scenario's, or
    a lab or environment failure of another entry's), else ``None`` (the command exits 2 or 3
    on it, not 1: nothing was proven either way)."""

    bundle: Path
    version: str
    scenario: str
    before: dict
    after: dict
    others: list[dict] = field(default_factory=list)
    verified: bool = False
    reasons: list[str] = field(default_factory=list)
    failed: str | None = None

    def as_dict(self) -> dict:
        return {"verified": self.verified, "reasons": self.reasons, "release": self.version,
                "scenario": self.scenario, "before": self.before, "after": self.after,
                "others": self.others, "failed": self.failed}


def _summary(item: RunItem) -> dict:
    v = item.verdict
    return {"scenario": item.scenario.name, "outcome": item.result.outcome,
            "observed": describe_observed(item.result), "ok": v.ok if v else None,
            "expected": v.expected if v else None}


def bundle_id(scenario: Scenario, version: str, patch: Path) -> str:
    sha = hashlib.sha256(patch.read_bytes()).hexdigest()[:12]
    return f"{scenario.name}-{version}-{sha}"


def related_entries(version: str, exclude: str, catalog: Path) -> list[tuple[Path, Scenario]]:
    """Catalog entries that name ``version`` among their concrete releases (other than the
    scenario under verification)."""
    out = []
    for p in catalog_files(catalog):
        sc = load_scenario(p)
        if sc.name != exclude and version in sc.vllm.concrete():
            out.append((p, sc))
    return out


def verify(scenario_path: Path, patch: Path, version: str, reports: Path,
           catalog: Path = Path("scenarios"), shared_tests: Path = Path("tests/shared"),
           say=lambda s: None) -> Verification:
    """Run the verification and write its bundle. Raises
    :class:`~vllm_repro.errors.InputError` for a patch that does not apply cleanly or touches
    files outside ``vllm/``, :class:`~vllm_repro.errors.EnvError` for environment failures."""
    scenario = load_scenario(scenario_path)
    patch_files(patch)
    others = related_entries(version, scenario.name, catalog)
    # each run on the tree its level resolves to (VLLM_REPRO_TREE; the CPU image's auto: the
    # slice where it was proven at that level, else the full tree), pristine before and patched
    # after: one patched copy per tree
    kind_of: dict[str, str] = {}  # level -> tree
    for level in dict.fromkeys([scenario.level, *(sc.level for _, sc in others)]):
        try:
            kind_of[level] = resolve_tree(version, None, level)
        except InputError as exc:  # --tree slice at a level the slice does not serve
            if level == scenario.level:
                raise
            say(f"the other entries at level {level}: on the full tree ({exc})")
            kind_of[level] = "full"
    pristine = {kind: prepare_release(version, say, tree=kind)
                for kind in sorted(set(kind_of.values()))}
    if "slice" in pristine:
        try:
            dry_run(patch, pristine["slice"].tree, version)
        except InputError as on_slice:
            # a patch of a file the slice leaves out (V0's scheduler, an entrypoint...): the
            # full tree, where it applies; asked for the slice by name, say so
            try:
                full = pristine.get("full") or prepare_release(version, say, tree="full")
            except EnvError as no_full:  # the CPU image: its slice alone, the sdist dropped
                raise InputError(f"{on_slice}; and vLLM {version} has no full tree here to try it "
                                 f"on ({no_full})") from None
            dry_run(patch, full.tree, version)  # (not even there: the patch's own error)
            if default_tree() == "slice":
                raise InputError(f"{on_slice}; it changes files the slice of vLLM {version} "
                                 "leaves out: verify it on the full tree, VLLM_REPRO_TREE=full") from None
            say(f"the patch changes files the slice of vLLM {version} leaves out: every entry "
                "on the full tree")
            kind_of = dict.fromkeys(kind_of, "full")
            pristine = {"full": full}
    patched = {}
    for kind, env in pristine.items():
        tree = patched_tree(env.tree, patch, version)
        say(f"patched copy of vLLM {version}'s {kind} tree: {tree}")
        patched[kind] = dataclasses.replace(env, tree=tree)
    bid = bundle_id(scenario, version, patch)
    bundle = reports / "verify" / bid
    if bundle.exists():
        shutil.rmtree(bundle)
    bundle.mkdir(parents=True)

    def run(envs, label):
        items = [RunItem(scenario, version)] + [RunItem(sc, version) for _, sc in others]
        run_pairs(items, bundle / label, say=say,
                   prepare_tree=lambda v, kind: envs[kind], resolve=lambda v, level: kind_of[level])
        return items

    before = run(pristine, "before")
    after = run(patched, "after")
    ver = Verification(bundle, version, scenario.name, _summary(before[0]), _summary(after[0]))
    b, a = before[0], after[0]
    # a run that did not happen as a run of vLLM proves nothing: the scenario's (any kind), or
    # another entry's lab or environment failure (an input refusal of another entry, alike
    # before and after, is that entry saying nothing about this release)
    failed = [r.result.error for r in (b, a) if r.result.outcome == "error"] + \
        [r.result.error for r in (*before[1:], *after[1:])
         if r.result.outcome == "error" and r.result.error.kind != "input"]
    if failed:
        ver.failed = failed[0].kind
        ver.reasons.append("the lab failed to run the scenarios (see the reports); nothing is proven"
                           if ver.failed != "input" else
                           "the scenario was refused (see the reports); nothing is proven")
    if b.result.outcome == "clean":
        ver.reasons.append(f"{scenario.name} does not reproduce on unpatched vLLM {version}")
    elif b.verdict and b.verdict.ok is False:
        ver.reasons.append(f"before: {b.verdict.reason or 'observation differs from expect'}")
    if a.result.outcome != "clean" or a.result.violations:
        ver.reasons.append(f"after the patch: {describe_observed(a.result)}")
    for ib, ia in zip(before[1:], after[1:]):
        sb, sa = _summary(ib), _summary(ia)
        ver.others.append({"scenario": sb["scenario"], "before": sb["observed"], "after": sa["observed"],
                           "kept": sb["ok"] == sa["ok"] and sb["outcome"] == sa["outcome"]})
        if not ver.others[-1]["kept"]:
            ver.reasons.append(f"{sb['scenario']} changed: {sb['observed']} -> {sa['observed']}")
    ver.verified = not ver.reasons
    _write_bundle(ver, scenario_path, patch, [p for p, _ in others], shared_tests)
    return ver


def _write_bundle(ver: Verification, scenario_path: Path, patch: Path, others: list[Path],
                  shared: Path) -> None:
    b = ver.bundle
    shutil.copy2(patch, b / "patch.diff")
    (b / "scenarios").mkdir()
    shutil.copy2(scenario_path, b / "scenarios" / scenario_path.name)
    for p in others:
        shutil.copy2(p, b / "scenarios" / p.name)
    if shared.is_dir():
        shutil.copytree(shared, b / "tests" / "shared",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("__init__.py", "conftest.py"):  # the package the shared tests live in
            if (shared.parent / name).is_file():
                shutil.copy2(shared.parent / name, b / "tests" / name)
    (b / "release.txt").write_text(ver.version + "\n")
    (b / "verdict.json").write_text(json.dumps(ver.as_dict(), indent=1))
    manifest = {}
    for f in sorted(b.rglob("*")):
        if f.is_file() and f.name != "manifest.json" and "before" not in f.parts and "after" not in f.parts:
            manifest[str(f.relative_to(b))] = hashlib.sha256(f.read_bytes()).hexdigest()
    (b / "manifest.json").write_text(json.dumps({"release": ver.version, "scenario": ver.scenario,
                                                 "sha256": manifest}, indent=1))
