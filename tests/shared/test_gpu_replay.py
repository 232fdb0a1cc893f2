"""The catalog's workloads replayed on the real engine, with a GPU and a real small model.

Runs only where it can mean something: an installed full vLLM (``VLLM_REPRO_VLLM=installed``,
the CUDA image), a GPU (``nvidia-smi -L`` lists one) and a model folder mounted
(``VLLM_REPRO_MODEL`` or ``/models/<name>/config.json``). Elsewhere each case is skipped and says
which of the three is missing. On a release the scenario reproduces on, the engine must crash with
the scenario's exception; on a clean release (or with the fix applied, ``VLLM_REPRO_FIXED``) it
must serve every request.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import catalog_files, fixed_names, model_dir

pytestmark = pytest.mark.gpu
FIX_AWARE = True  # honours VLLM_REPRO_FIXED (see conftest.py)
REPLAY = Path(__file__).resolve().parent / "replay_engine.py"


def _missing() -> str | None:
    from vllm_repro.sources.installed import installed_python

    if installed_python() is None:
        return "needs the installed full vLLM (VLLM_REPRO_VLLM=installed, the CUDA image)"
    smi = shutil.which("nvidia-smi")
    if smi is None or subprocess.run([smi, "-L"], capture_output=True, check=False).returncode != 0:
        return "no GPU here (nvidia-smi -L lists none)"
    if model_dir() is None:
        return "no model mounted (set VLLM_REPRO_MODEL or mount one at /models/<name>)"
    return None


@pytest.mark.parametrize("path", catalog_files(), ids=lambda p: p.stem)
def test_workload_replays_on_the_real_engine(path, request):
    why = _missing()
    if why:
        pytest.skip(why)
    from vllm_repro.scenario import load_scenario
    from vllm_repro.sources.installed import installed

    inst = installed()
    sc = load_scenario(path)
    proc = subprocess.run([str(inst.python), str(REPLAY), str(model_dir())], input=json.dumps(
        sc.child_payload()), capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    request.node.user_properties.append(("replay", json.dumps(got)))
    kind = sc.vllm.expectation_for(inst.release)
    if kind == "reproduce" and sc.name not in fixed_names() and sc.expect and sc.expect.outcome == "crash":
        assert got["outcome"] == "crash", f"expected {sc.expect.exception} on {inst.release}, got {got}"
        if sc.expect.exception:
            assert got["exception"] == sc.expect.exception, got
    elif kind == "clean" or sc.name in fixed_names():
        assert got["outcome"] == "clean", f"expected the engine to serve every request: {got}"
    else:
        pytest.skip(f"no crash expectation for {sc.name} on {inst.release}; replay gave {got}")
