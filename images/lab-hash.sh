#!/bin/sh
# The content hash of what the CPU image is built from (make images labels the image with it;
# make cpu-repro's ensure-image rebuilds only when it differs): the lab's sources, the image
# files, the slices and pyproject.toml, by content and path, never by mtime (a fresh clone gives
# every file a new mtime, and must not look changed). Staged files, bytecode and egg-info do
# not count. Prints 16 hex digits. Run from the checkout's root.
set -eu
find src images slices pyproject.toml -type f \
  -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path 'images/stage/*' \
  -not -path '*.egg-info/*' -print | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
