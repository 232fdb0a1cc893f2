#!/bin/sh
# The CPU image's entrypoint: runs its arguments (`vllm-repro ...`) as the owner of the reports
# folder, so that `docker compose up` works as root and as a normal user on a fresh clone
# without VLLM_REPRO_UID set by hand, and the reports on the host belong to whoever owns them.
#
# Started as any uid but 0 (`docker run --user`, make cpu-repro-docker): runs the command as it is.
# Started as root (compose, a plain `docker run`), it picks the user:
#   1. VLLM_REPRO_UID[:VLLM_REPRO_GID] when set;
#   2. else the owner of REPORTS (default /reports) when that is not root (a folder the user made);
#   3. else the owner of OWNER_OF (default: the mounted checkout's scenarios folder, i.e. the
#      clone's owner: Docker makes a missing ./reports as root, on behalf of whoever ran compose);
#   4. else the image's user, lab (1000), when REPORTS is the image's own folder.
# A REPORTS folder owned by root is given to that user (the folder itself, not its contents), and
# so is each empty root-owned folder of VLLM_REPRO_ALSO_OWN (space-separated: the gpu service's
# /models, which Docker makes as root when ./models is missing); then the command runs as that user (setpriv; HOME from its passwd entry, else /tmp). Root stays
# root only when the user picked is root (a clone owned by root).
set -eu
reports=${VLLM_REPRO_REPORTS:-/reports}
owner_of=${VLLM_REPRO_OWNER_OF:-/opt/vllm-repro/lab/scenarios}

if [ "$(id -u)" != 0 ]; then
  exec "$@"
fi

if [ -n "${VLLM_REPRO_UID:-}" ]; then
  uid=$VLLM_REPRO_UID
  gid=${VLLM_REPRO_GID:-$uid}
elif [ -d "$reports" ] && [ "$(stat -c %u "$reports")" != 0 ]; then
  uid=$(stat -c %u "$reports")
  gid=$(stat -c %g "$reports")
elif [ -d "$owner_of" ] && [ "$(stat -c %u "$owner_of")" != 0 ] \
     && mountpoint -q "$owner_of" 2>/dev/null; then
  uid=$(stat -c %u "$owner_of")
  gid=$(stat -c %g "$owner_of")
elif [ -d "$owner_of" ] && mountpoint -q "$owner_of" 2>/dev/null; then
  uid=0 gid=0   # a clone owned by root: its reports are root's
else
  uid=1000 gid=1000
fi

if [ "$uid" = 0 ]; then
  exec "$@"
fi
if [ -d "$reports" ] && [ "$(stat -c %u "$reports")" = 0 ]; then
  chown "$uid:$gid" "$reports"
fi
for d in ${VLLM_REPRO_ALSO_OWN:-}; do
  if [ -d "$d" ] && [ "$(stat -c %u "$d")" = 0 ] && [ -z "$(ls -A "$d")" ]; then
    chown "$uid:$gid" "$d" || true
  fi
done
home=$(getent passwd "$uid" | cut -d: -f6)
[ -n "$home" ] && [ -d "$home" ] || home=/tmp
HOME=$home exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
