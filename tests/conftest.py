"""Shared fixtures: the repository root, a CLI runner that calls the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"
FLAGSHIP = SCENARIOS / "vllm-23347-priority-preempt-scheduled.yaml"
# the folder that holds crashlogs/ (real vLLM crash logs with their answers): VLLM_REPRO_SHARED,
# else ../shared beside the checkout
SHARED = Path(os.environ.get("VLLM_REPRO_SHARED") or ROOT.parent / "shared").expanduser()
CRASHLOGS = SHARED / "crashlogs"
SHARED_HINT = "set VLLM_REPRO_SHARED=/path/to/shared (the folder that holds crashlogs/)"
NO_CRASHLOGS = f"no crash logs in {CRASHLOGS}; {SHARED_HINT}"


@pytest.fixture
def root() -> Path:
    return ROOT


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
            timeout: int = 1800) -> subprocess.CompletedProcess:
    """Run ``vllm-repro ARGS`` as a user would (a subprocess), returning the completed process."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-m", "vllm_repro.cli", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd or ROOT, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def warm_parent_pid(version: str) -> int | None:
    """The pid of this checkout's live warm parent of ``version``'s full environment
    (docs/warm-runs.md), or None."""
    from vllm_repro.settings import cache_dir

    lab = str((ROOT / "src" / "vllm_repro").resolve())
    for info in (cache_dir() / "warm").glob("*/parent.json"):
        try:
            data = json.loads(info.read_text())
            if data.get("lab") == lab and f"/envs/{version}/" in data.get("python", ""):
                os.kill(data["pid"], 0)
                return data["pid"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
