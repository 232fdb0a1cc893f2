"""The code that runs inside release environments imports with the standard library only (the
release's vLLM aside): no lab dependency may creep into the engine's adapter and state or the
audit."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["vllm_repro.engine.state", "vllm_repro.engine.adapter", "vllm_repro.engine.adapter.build",
           "vllm_repro.engine.adapter.requests", "vllm_repro.engine.adapter.outputs",
           "vllm_repro.engine.fake_runner", "vllm_repro.engine.capabilities",
           "vllm_repro.audit", "vllm_repro.audit.books", "vllm_repro.audit.checks",
           "vllm_repro.audit.hooks", "vllm_repro.audit.plant", "vllm_repro.records",
           "vllm_repro.engine.loop", "vllm_repro.engine.core_loop", "vllm_repro.engine.worker",
           "vllm_repro.engine.kv_worker", "vllm_repro.engine.warm", "vllm_repro.engine.run",
           "vllm_repro.engine.adapter.capability_probes", "vllm_repro.audit.registry",
           "vllm_repro.audit.v0"]

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'pydantic', 'typer', 'rich', 'yaml', 'click'}:
            raise ImportError('release-side code imported ' + name)
sys.meta_path.insert(0, Block())
import importlib
for m in sys.argv[1:]:
    importlib.import_module(m)
"""


def test_release_side_modules_import_without_lab_dependencies():
    r = subprocess.run([sys.executable, "-c", BLOCKER, *MODULES], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
