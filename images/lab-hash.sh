#!/bin/sh
# The content hash of what the CPU image is built from (make images labels the image with it;
# make cpu-repro's ensure-image rebuilds only when it differs): the lab's sources, the image
# files, pyproject.toml and the slices of the releases it bakes, by content and path, never by
# mtime (a fresh clone gives every file a new mtime, and must not look changed). Staged files,
# bytecode and egg-info do not count. Prints 16 hex digits. Run from the checkout's root.
#
#   sh images/lab-hash.sh [WORD...]
#
# WORDs are make images' VLLM_VERSIONS: release numbers, scenario files, or "catalog" (every
# file under scenarios/); only slices/<release>.json of the releases they name (any release
# number written in a scenario file counts) are hashed, so slicing a release the image does not
# bake leaves it current. No WORD: every slice.
set -eu
slices=$(
  if [ "$#" -eq 0 ]; then
    find slices -type f
  else
    for w in "$@"; do
      case "$w" in
        catalog) find scenarios -type f -exec cat {} + ;;
        *) if [ -f "$w" ]; then cat "$w"; else echo "$w"; fi ;;
      esac
    done | grep -oE '[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+|\.[0-9]+)?' | LC_ALL=C sort -u |
      while read -r v; do if [ -f "slices/$v.json" ]; then echo "slices/$v.json"; fi; done
  fi
)
{ find src images pyproject.toml requirements.lock -type f \
    -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path 'images/stage/*' \
    -not -path '*.egg-info/*' -print
  [ -z "$slices" ] || printf '%s\n' $slices
} | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
