"""SIGINT and SIGTERM to ``vllm-repro run``: every process of the run stops, "aborted", exit
130 / 143 (issue 18, item 3), at four moments: environment build, import, mid-run, report
writing.

No release is needed: the lab's real entry point (:func:`vllm_repro.cli.main`) runs in a
subprocess in which only the release's preparation is replaced by a ready environment whose
``bin/python`` is a stand-in worker (a shell script that answers the worker protocol and keeps
helper processes of its own, one of them in a session of its own, as vLLM's can). What is
tested is the process handling, not vLLM: the host's ``Worker``, its process group, the lab's
signal handlers and its descendant sweep are the real ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ..conftest import ROOT

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")

# The stand-in worker: records its pid and its helpers' pids, then, by MOMENT: never says hello
# (vLLM still importing), or says hello and spins on the job (mid-run), or answers the job at
# once (the report is written next).
STUB = textwrap.dedent("""\
    #!/bin/bash
    fd="${6}"
    sleep 300 &
    echo $! >> "$PIDS"
    setsid sleep 300 &
    echo $! >> "$PIDS"
    echo $$ >> "$PIDS"
    if [ "$MOMENT" = import ]; then touch "$READY"; while :; do sleep 0.1; done; fi
    echo '{"id": "hello", "ok": true, "vllm": "0.10.2", "import_s": 0.1, "capabilities": {"version": "0.10.2"}}' >&"$fd"
    read -r job
    if [ "$MOMENT" = mid-run ]; then touch "$READY"; while :; do :; done; fi
    echo '{"id": "t", "result": {"outcome": "clean", "steps": 1, "finished": {"A": {}}}}' >&"$fd"
    read -r more
    """)

# The driver: the real CLI, with prepare_release (fetch, extract, build) replaced by the
# stand-in environment; "build" holds there in a child process as uv would, "report" holds in
# the timeline's writer.
DRIVER = textwrap.dedent("""\
    import os, subprocess, sys, time
    from pathlib import Path
    import vllm_repro.lab as lab
    from vllm_repro.sources.env import ReleaseEnv

    moment, root, tree = os.environ["MOMENT"], Path(sys.argv[1]), Path(sys.argv[2])

    def prepare(version, say, tree_kind=None, **_):
        if moment == "build":
            p = subprocess.Popen(["sleep", "300"])
            open(os.environ["PIDS"], "a").write(f"{p.pid}\\n")
            Path(os.environ["READY"]).touch()
            p.wait()
        return ReleaseEnv(version=version, tree=tree, root=root)

    lab.prepare_release = prepare
    if moment == "report":
        import vllm_repro.report.index as index

        def slow_index(reports):
            Path(os.environ["READY"]).touch()
            time.sleep(300)

        index.write_index = slow_index  # the run command imports it when it runs
    from vllm_repro.cli import main
    sys.argv = ["vllm-repro", *sys.argv[3:]]
    main()
    """)

SCENARIO = "name: t\nconfig: {num_gpu_blocks: 8}\nrequests:\n  - {id: A, prompt_len: 10}\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment", ["build", "import", "mid-run", "report"])
def test_signal_stops_every_process_of_the_run(tmp_path, moment, sig, code):
    root = tmp_path / "env"
    (root / "bin").mkdir(parents=True)
    stub = root / "bin" / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "driver.py").write_text(DRIVER)
    pids, ready = tmp_path / "pids", tmp_path / "ready"
    env = {**os.environ, "MOMENT": moment, "PIDS": str(pids), "READY": str(ready),
           "VLLM_REPRO_CACHE": str(tmp_path / "cache"),
           # the stand-in speaks the worker's protocol, not a warm parent's: cold starts
           "VLLM_REPRO_WARM": "off",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(root), str(tree), "run",
         str(tmp_path / "s.yaml"), "--vllm", "0.10.2", "--reports", str(tmp_path / "r")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, f"the run ended before the {moment} moment: {proc.communicate()}"
            assert time.monotonic() < deadline, f"never reached the {moment} moment"
            time.sleep(0.05)
        time.sleep(0.2)
        recorded = [int(x) for x in pids.read_text().split()] if pids.exists() else []
        if moment != "report":  # at report writing the worker has already been closed
            assert recorded and all(_alive(p) for p in recorded), "the helpers should run now"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1.0)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == "aborted", err
    assert "Traceback" not in err
    left = [p for p in recorded if _alive(p)]
    assert not left, f"alive one second after {sig.name} at {moment}: {left}"
