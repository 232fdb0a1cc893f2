#!/bin/sh
# Runs on the GPU host, started over SSH by `vllm-repro gpu-verify` (src/vllm_repro/remote/ship.py):
#
#   sh remote-run.sh WORK IMAGE GPUS NAME [MODEL_DIR]
#
# WORK holds the uploaded bundle (WORK/bundle); IMAGE is the CUDA image (or a stand-in); GPUS is
# "all" (docker run --gpus all) or "none"; NAME names the container; MODEL_DIR, a model folder on
# this host, is mounted read-only at /models/<its name> (the gpu replay tests). The container runs
# `vllm-repro gpu-judge /bundle --out /out` as root (it patches the installed vLLM in place);
# nothing is bind-mounted, files go in and out with `docker cp`, so everything left in WORK
# belongs to the SSH user and the client can remove it.
#
# Its output is the container's, streamed (and kept in WORK/run.log). Exit: the judge's code,
# or 3 when docker fails here. If the SSH session ends first (stdin closes), the container's
# results so far are copied to WORK/out, the container is removed, WORK/gone.done is written, and
# WORK is removed after 15 minutes unless the client comes back for it first. A client that comes
# back sends TERM to WORK/script.pid (the same clean-up, if this side had not noticed yet).
set -u
work=$1 image=$2 gpus=$3 name=$4 model=${5:-}
log="$work/run.log"
: >>"$log"
echo $$ >"$work/script.pid"
say() { echo "[remote] $*"; echo "[remote] $*" >>"$log"; }

collect() { docker cp "$name:/out" "$work/out" >>"$log" 2>&1 || true; }
remove() { docker rm -f "$name" >/dev/null 2>&1 || true; }

gone() {
  trap '' HUP PIPE TERM INT
  echo "[remote] the client went away: results so far kept in $work/out, container removed" >>"$log"
  collect
  remove
  # removes WORK after 15 minutes, or exits as soon as the client has removed it
  nohup sh -c 'n=0; while [ -d "$1" ] && [ $n -lt 900 ]; do sleep 1; n=$((n+1)); done; rm -rf "$1"' \
    reaper "$work" >/dev/null 2>&1 </dev/null &
  echo $! >"$work/reaper.pid"
  : >"$work/gone.done"
  exit 129
}
trap gone HUP PIPE TERM INT

# stdin stays open while the client is connected; EOF means the session is gone. (A background
# command's stdin is /dev/null unless it comes through another descriptor: hence fd 3.)
exec 3<&0
cat <&3 >/dev/null 3<&- &
exec 3<&-
stdin_pid=$!
( while kill -0 "$stdin_pid" 2>/dev/null; do sleep 1; done; kill -TERM $$ 2>/dev/null ) </dev/null &
watch_pid=$!
finish() { kill "$watch_pid" 2>/dev/null; kill "$stdin_pid" 2>/dev/null; exit "$1"; }

gpu_flag=""
[ "$gpus" = none ] || gpu_flag="--gpus all"
if [ -n "$model" ]; then
  [ -f "$model/config.json" ] || { say "model folder $model has no config.json"; finish 3; }
  set -- -v "$model:/models/$(basename "$model"):ro"
else
  set --
fi
remove
# shellcheck disable=SC2086
if ! docker create --name "$name" $gpu_flag "$@" --user 0 --entrypoint vllm-repro "$image" \
    gpu-judge /bundle --out /out >>"$log" 2>&1; then
  say "docker create failed for image $image: $(tail -n 1 "$log")"
  finish 3
fi
if ! docker cp "$work/bundle" "$name:/bundle" >>"$log" 2>&1; then
  say "docker cp of the bundle into the container failed: $(tail -n 1 "$log")"
  remove
  finish 3
fi
say "container $name started from $image (gpus: $gpus)"
# long steps run in the background and are waited for, so the traps fire while they run
docker start -a "$name" 2>&1 | tee -a "$log" &
wait $!
docker wait "$name" >"$work/exit-code" 2>>"$log" &
wait $!
rc=$(cat "$work/exit-code" 2>/dev/null)
case "$rc" in ''|*[!0-9]*) rc=3;; esac
collect
remove
say "container exited with $rc"
finish "$rc"
