"""``python -m vllm_repro.audit [docs/audit.md]``: rewrite the page's generated tables of codes
and checks from the registry (:mod:`vllm_repro.audit.registry`)."""

import sys
from pathlib import Path

from .registry import render_page

path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/audit.md")
path.write_text(render_page(path.read_text()))
print(f"wrote {path}")
