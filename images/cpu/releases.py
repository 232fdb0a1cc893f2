"""Print the releases to bake into the CPU image, one per line (used by images/cpu/Dockerfile).

    python releases.py SCENARIOS_DIR catalog            # every release the catalog names
    python releases.py SCENARIOS_DIR 0.10.1.1 0.10.2    # these (validated)
    python releases.py SCENARIOS_DIR scenarios/vllm-23347-priority-preempt-scheduled.yaml
                                                        # the releases a catalog entry names
    python releases.py --entries SCENARIOS_DIR BAKED_JSON
                                                        # `--only NAME` for each catalog entry
                                                        # the baked releases cover

"catalog" means the concrete releases of the catalog's entries (``vllm.reproduces_on`` and
``vllm.clean_on``, ranges left out), read with the lab's own scenario loader. A release that a
``level: engine-core`` entry names is printed as ``VERSION:engine-core`` as well: bake.py then
bakes its full tree too where the release's scheduler-level runs use a slice. Exit 2 with one
line for a bad release or an empty list.

``--entries`` (the image's warm-up run, which compiles the bytecode of what a run imports): the
catalog entries whose every concrete release is baked (``baked.json`` of ``bake.py``) with a
tree that serves the entry's level (a slice only the levels it was proven at), as ``--only NAME``
arguments of ``catalog run``; exit 2 with one line when none is covered.
"""

from __future__ import annotations

import sys
from pathlib import Path


def covered_entries(directory: Path, baked: dict) -> list[str]:
    """Names of the catalog entries in ``directory`` that ``baked`` (``baked.json``: key
    ``VERSION`` or ``VERSION:KIND`` -> ``{"kind": "slice" | "full", "levels": [...], ...}``)
    covers: each concrete release baked with a tree that serves the entry's level (a full tree
    serves every level, ``"all"``; a slice the levels it was proven at, the scheduler's where
    ``levels`` is absent)."""
    from vllm_repro.catalog import catalog_files
    from vllm_repro.scenario import load_scenario

    levels: dict[str, set[str]] = {}  # version -> the levels its baked trees serve
    for key, info in baked.items():
        served = info.get("levels") or (["scheduler"] if info.get("kind") == "slice" else ["all"])
        levels.setdefault(key.partition(":")[0], set()).update(served)
    out = []
    for p in catalog_files(directory):
        sc = load_scenario(p)
        if all(v in levels and ({sc.level, "all"} & levels[v]) for v in sc.vllm.concrete()):
            out.append(sc.name)
    return out


def entries_main(argv: list[str]) -> int:
    import json

    from vllm_repro.errors import LabError

    if len(argv) != 2:
        print("usage: releases.py --entries SCENARIOS_DIR BAKED_JSON", file=sys.stderr)
        return 2
    try:
        names = covered_entries(Path(argv[0]), json.loads(Path(argv[1]).read_text()))
    except (OSError, ValueError) as exc:
        print(f"releases: {argv[1]}: {exc}", file=sys.stderr)
        return 2
    except LabError as exc:
        print(f"releases: {exc}", file=sys.stderr)
        return 2
    if not names:
        print(f"releases: no catalog entry of {argv[0]} runs on the baked releases", file=sys.stderr)
        return 2
    print(" ".join(f"--only {n}" for n in names))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--entries"]:
        return entries_main(argv[1:])
    from vllm_repro.catalog import catalog_files
    from vllm_repro.errors import LabError
    from vllm_repro.scenario import load_scenario
    from vllm_repro.sources.sdist import validate_version

    if len(argv) < 2:
        print("usage: releases.py SCENARIOS_DIR (catalog | VERSION...)", file=sys.stderr)
        return 2
    directory, wanted = Path(argv[0]), argv[1:]
    out: list[str] = []
    def add(sc) -> None:
        for v in sc.vllm.concrete():
            tok = v if sc.level == "scheduler" else f"{v}:{sc.level}"
            if tok not in out:
                out.append(tok)

    try:
        for w in wanted:
            if w == "catalog":
                for p in catalog_files(directory):
                    add(load_scenario(p))
            elif w.endswith((".yaml", ".yml")):  # one scenario's releases (the flagship image)
                p = directory / Path(w).name
                if not p.is_file():
                    print(f"releases: VLLM_VERSIONS={w}: no such scenario in {directory} (name a "
                          "catalog entry's file, a version, or catalog)", file=sys.stderr)
                    return 2
                add(load_scenario(p))
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
