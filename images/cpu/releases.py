"""Print the releases to bake into the CPU image, one per line (used by images/cpu/Dockerfile).

    python releases.py SCENARIOS_DIR catalog            # every release the catalog names
    python releases.py SCENARIOS_DIR 0.10.1.1 0.10.2    # these (validated)

"catalog" means the concrete releases of the catalog's entries (``vllm.reproduces_on`` and
``vllm.clean_on``, ranges left out), read with the lab's own scenario loader. A release that a
``level: engine-core`` entry names is printed as ``VERSION:engine-core`` as well: bake.py then
bakes its full tree too where the release's scheduler-level runs use a slice. Exit 2 with one
line for a bad release or an empty list.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from vllm_repro.catalog import catalog_files
    from vllm_repro.errors import LabError
    from vllm_repro.scenario import load_scenario
    from vllm_repro.sources.sdist import validate_version

    if len(argv) < 2:
        print("usage: releases.py SCENARIOS_DIR (catalog | VERSION...)", file=sys.stderr)
        return 2
    directory, wanted = Path(argv[0]), argv[1:]
    out: list[str] = []
    try:
        for w in wanted:
            if w == "catalog":
                for p in catalog_files(directory):
                    sc = load_scenario(p)
                    for v in sc.vllm.concrete():
                        tok = v if sc.level == "scheduler" else f"{v}:{sc.level}"
                        if tok not in out:
                            out.append(tok)
            elif w not in out:
                out.append(validate_version(w))
    except LabError as exc:
        print(f"releases: {exc}", file=sys.stderr)
        return 2
    if not out:
        print(f"releases: no release to bake (VLLM_VERSIONS={' '.join(wanted)!r})", file=sys.stderr)
        return 2
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
