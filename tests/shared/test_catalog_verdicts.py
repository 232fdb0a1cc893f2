"""Every catalog entry, on the releases this vLLM can run, keeps its verdict.

In release mode (CPU image, developer machine) an entry runs on its own ``reproduces_on`` and
``clean_on`` releases; in installed mode (CUDA image) on the installed release. One worker per
release runs all entries (vLLM is imported once); each (entry, release) is one test case.
"""

from __future__ import annotations

import pytest

from .conftest import catalog_files, fixed_names

pytestmark = pytest.mark.shared
FIX_AWARE = True  # honours VLLM_REPRO_FIXED (see conftest.py)


def _cases() -> list[tuple]:
    from vllm_repro.errors import LabError
    from vllm_repro.lab import releases_for
    from vllm_repro.scenario import load_scenario

    cases = []
    for path in catalog_files():
        sc = load_scenario(path)
        try:
            versions = releases_for(sc, [], covering=True)
        except LabError as exc:  # no release named, or no vLLM installed: one failing case
            cases.append(pytest.param(path, str(exc), id=f"{sc.name}@none"))
            continue
        cases += [pytest.param(path, v, id=f"{sc.name}@{v}") for v in versions]
    return cases


@pytest.mark.parametrize("path,version", _cases())
def test_catalog_entry_keeps_its_verdict(path, version, catalog_runs, request):
    from vllm_repro.scenario import load_scenario

    name = load_scenario(path).name
    if (name, version) not in catalog_runs:
        pytest.fail(f"{name}: {version}")  # version holds why no release could be chosen
    item = catalog_runs[(name, version)]
    v, res = item.verdict, item.result
    # JUnit properties (written with junit_family xunit1, as gpu-judge runs it)
    request.node.user_properties += [("observed", v.observed), ("expected", v.expected)]
    assert res.outcome != "error", f"the lab failed: {v.observed}"
    if name in fixed_names() and item.scenario.vllm.expectation_for(version) == "reproduce":
        # a patch for this bug is applied to this vLLM: it must now run clean, audit included
        assert res.outcome == "clean" and not res.violations, (
            f"{name} on patched vLLM {version}: {v.observed}, expected clean after the fix")
        return
    # every release chosen for an entry is one its lists name, so it has an expectation: a run
    # with none (ok None, "-" in the table) is as wrong as a mismatch
    assert v.ok is not None, f"{name} on vLLM {version}: no expectation for this release"
    assert v.ok is True, f"{name} on vLLM {version}: expected {v.expected}, observed {v.observed}"
