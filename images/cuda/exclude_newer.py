"""Print the cut-off the CUDA image installs vLLM ``VERSION``'s dependencies at, on a plain Python
base: the index as it stood an hour after the release's sdist was uploaded, the same cut-off the
CPU environments resolve with (:func:`vllm_repro.sources.env.exclude_newer`).

    python images/cuda/exclude_newer.py 0.10.1.1      # -> 2025-08-21T00:17:16Z

`make image-cuda BASE_IMAGE=...` passes it as the build argument EXCLUDE_NEWER. The upload time
comes from the cached sdist's record when there is one, else from the index's project page (PEP
700 upload times; no download), else from the downloaded sdist (its newest file's mtime).
Exit 2 for a version the index does not have, 3 when the index cannot be read.
"""

from __future__ import annotations

import sys

from vllm_repro.errors import LabError
from vllm_repro.sources.env import exclude_newer
from vllm_repro.sources.index import find_sdist
from vllm_repro.sources.sdist import cached_release, fetch_sdist, validate_version


def cutoff(version: str) -> str:
    """``--exclude-newer`` for vLLM ``version`` (ISO UTC, e.g. ``2025-08-21T00:17:16Z``). Raises
    :class:`~vllm_repro.errors.InputError` for a version the index lacks and
    :class:`~vllm_repro.errors.EnvError` for an index that cannot be read."""
    version = validate_version(version)
    cached = cached_release(version)
    uploaded = cached.upload_time if cached else find_sdist(version).upload_time
    if uploaded is None:
        uploaded = fetch_sdist(version).upload_time
    return exclude_newer(uploaded)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: exclude_newer.py VLLM_VERSION", file=sys.stderr)
        return 2
    try:
        print(cutoff(argv[0]))
    except LabError as exc:
        print(f"exclude_newer: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
