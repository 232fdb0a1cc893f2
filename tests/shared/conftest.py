"""The shared suite: the same tests in the CPU image (sliced or per-release vLLM) and in the CUDA
image (the installed full vLLM, ``VLLM_REPRO_VLLM=installed``), and on a developer's machine.

Self-contained on purpose: ``vllm-repro verify`` copies this folder into its bundle and
``vllm-repro gpu-verify`` runs that copy inside the CUDA image, where the rest of ``tests/`` is
absent. Settings (environment variables):

- ``VLLM_REPRO_CATALOG``: scenario folders to run (``os.pathsep``-separated); default the
  checkout's ``scenarios/`` (the catalog).
- ``VLLM_REPRO_FIXED``: names of scenarios (comma-separated) whose bug a patch applied to this
  vLLM should fix: on their reproducing releases they must now run clean. Test modules that know
  this declare ``FIX_AWARE = True``; the others are skipped then (they expect pristine vLLM).
- ``VLLM_REPRO_SUITE_REPORTS``: where the runs' reports go (default: a temporary folder).
- ``VLLM_REPRO_MODEL``: a model folder for the ``gpu`` replay tests (default: the first of
  ``/models/*`` holding a ``config.json``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    # registered here too, so that the bundle's copy of this folder runs without pyproject.toml
    config.addinivalue_line("markers", "shared: runs in both images (CPU slice and CUDA full vLLM)")
    config.addinivalue_line("markers", "gpu: needs a GPU and full vLLM")
    config.addinivalue_line("markers", "slow: builds a vLLM environment or runs real releases")


def pytest_collection_modifyitems(config, items):
    """With a fix applied (``VLLM_REPRO_FIXED``), a test module that does not declare
    ``FIX_AWARE = True`` expects the pristine release and would fail for the right reason: it is
    skipped, saying so (gpu-verify runs the whole suite on the pristine vLLM first)."""
    fixed = fixed_names()
    if not fixed:
        return
    skip = pytest.mark.skip(reason=f"expects pristine vLLM; a fix for {', '.join(sorted(fixed))} is "
                                   "applied (this suite ran on the pristine vLLM before it)")
    for item in items:
        if not getattr(item.module, "FIX_AWARE", False):
            item.add_marker(skip)


def catalog_dirs() -> list[Path]:
    """The scenario folders the suite runs (see the module docstring)."""
    raw = os.environ.get("VLLM_REPRO_CATALOG")
    if raw:
        return [Path(p) for p in raw.split(os.pathsep) if p]
    for base in (HERE.parent.parent, Path.cwd()):  # tests/shared -> the checkout, or the bundle
        if (base / "scenarios").is_dir():
            return [base / "scenarios"]
    return []


def catalog_files() -> list[Path]:
    return sorted(p for d in catalog_dirs() for p in d.glob("*.yaml") if p.is_file())


def fixed_names() -> set[str]:
    return {n.strip() for n in os.environ.get("VLLM_REPRO_FIXED", "").split(",") if n.strip()}


def model_dir() -> Path | None:
    """The model mounted for the ``gpu`` tests, or ``None``."""
    if os.environ.get("VLLM_REPRO_MODEL"):
        p = Path(os.environ["VLLM_REPRO_MODEL"])
        return p if (p / "config.json").is_file() else None
    models = Path("/models")
    if models.is_dir():
        for p in sorted(models.iterdir()):
            if (p / "config.json").is_file():
                return p
    return None


@pytest.fixture(scope="session")
def suite_reports(tmp_path_factory) -> Path:
    raw = os.environ.get("VLLM_REPRO_SUITE_REPORTS")
    path = Path(raw) if raw else tmp_path_factory.mktemp("suite-reports")
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


@pytest.fixture(scope="session")
def catalog_runs(suite_reports):
    """Every (entry, release) of the catalog, run once: ``{(name, version): RunItem}`` (shared by
    the modules that judge the catalog, so that it runs once per session)."""
    from vllm_repro.lab import RunItem, releases_for, run_pairs
    from vllm_repro.report.index import write_index
    from vllm_repro.scenario import load_scenario

    from vllm_repro.errors import LabError

    items = []
    for path in catalog_files():
        sc = load_scenario(path)
        try:
            items += [RunItem(sc, v) for v in releases_for(sc, [], covering=True)]
        except LabError:
            continue  # reported by its own case
    run_pairs(items, suite_reports)
    write_index(suite_reports)
    return {(i.scenario.name, i.version): i for i in items}
