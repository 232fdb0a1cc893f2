#!/bin/bash
# A stand-in for python:3.11-slim-bookworm where no registry answers: Debian bookworm's minbase
# with Debian's Python 3.11 (python3, python3-venv, ca-certificates), slimmed as Debian's -slim
# images are (docs, man pages and translations left out, now and for later installs: dpkg's
# path-exclude; apt's package cache cleaned after each install), imported into Docker as
# local/python:3.11-slim-standin (BASE_TAG). It measures what the CPU images add to a slim
# base: `BASE_IMAGE=local/python:3.11-slim-standin python bench/image.py --only flagship`.
#
#   scripts/slim-base.sh          # prints: export BASE_IMAGE=local/python:3.11-slim-standin
#
# Needs root, debootstrap and a Docker engine (../shared/tools/docker-host.sh gives both here),
# and Debian's mirror (MIRROR). About 150 MB, a minute. The official image builds Python from
# source into /usr/local instead; its size is about the same (Docker Hub lists its layers).
set -euo pipefail
BASE_TAG=${BASE_TAG:-local/python:3.11-slim-standin}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
log() { echo "slim-base: $*" >&2; }

if ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { log "needs debootstrap (apt-get install debootstrap)"; exit 3; }
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  log "building $BASE_TAG with debootstrap (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$MIRROR" >/tmp/slim-base.log 2>&1 \
    || { log "debootstrap failed; see /tmp/slim-base.log"; exit 3; }
  # what Debian's -slim images leave out (debuerreotype's slimify), for later installs too
  cat > "$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
  # and what they already hold no copy of
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$root"/usr/share/{groff,info,linda,locale,man}/* "$root"/usr/share/lintian/overrides/*
  # apt's cache cleaned after every install, as the official images' docker-clean does
  cat > "$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$BASE_TAG" >/dev/null
fi
log "$BASE_TAG: $(docker image inspect -f '{{.Size}}' "$BASE_TAG" | awk '{printf "%.0f MB", $1/1e6}')"
echo "export BASE_IMAGE=$BASE_TAG"
