#!/usr/bin/env bash
# `docker compose up` end to end, as a newcomer meets it and as CI runs it: the catalog's verdicts
# printed from inside the CPU image (service cpu), then HTTP GETs of the reports pages (service
# reports, 127.0.0.1), then `down`. Run it as root and as a normal user (in the docker group).
#
#   scripts/compose-check.sh [REPORTS_DIR]      # needs the CPU image (make images)
#
# REPORTS_DIR must not exist yet (default: a new one under /tmp): Docker makes it, as root, as it
# makes ./reports on a fresh clone. Checks: the cpu service exits 0; the index, a run's page and
# its trace (as text/plain) answer; every report file belongs to the checkout's owner (the
# invoking user on a fresh clone) and is readable by the invoking user; `down` takes under 3 s.
# Uses `docker compose` (v2) when the plugin answers, else docker-compose (v1); COMPOSE="..."
# picks one. Exit 0 when all hold, 1 otherwise, 3 when no compose is installed. Leaves nothing
# running.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
  elif command -v docker-compose >/dev/null; then COMPOSE=docker-compose
  else echo "compose-check: neither docker compose nor docker-compose is installed" >&2; exit 3; fi
fi
read -r -a compose <<<"$COMPOSE"
reports=${1:-$(mktemp -u /tmp/vllm-repro-compose.XXXXXX)}
[ -e "$reports" ] && { echo "compose-check: $reports exists; give a path that does not (Docker makes it, as on a fresh clone)" >&2; exit 2; }
port=${REPORTS_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
project=vllmrepro-ci-$$
export REPORTS_DIR=$reports REPORTS_PORT=$port
# an image that bakes only some releases (the flagship image) runs only the entries they cover,
# as its own build's warm-up does: the rest would need releases it lacks (no network in the run)
image=${CPU_IMAGE:-vllm-repro-cpu:latest}
if [ -z "${CATALOG_ARGS+set}" ] \
   && [ "$(docker image inspect -f '{{index .Config.Labels "vllm-repro.releases"}}' "$image" 2>/dev/null)" != catalog ]; then
  CATALOG_ARGS=$(docker run --rm --network none --entrypoint python3 "$image" \
    images/cpu/releases.py --entries scenarios /opt/vllm-repro/cache/baked.json 2>/dev/null | tr '\n' ' ')
  export CATALOG_ARGS
fi
unset VLLM_REPRO_UID VLLM_REPRO_GID
log=$(mktemp /tmp/vllm-repro-compose-log.XXXXXX)
trap '"${compose[@]}" -p "$project" down --timeout 5 >/dev/null 2>&1' EXIT
echo "compose-check: ${compose[*]} ($("${compose[@]}" version --short 2>/dev/null || echo '?')), as $(id -un) (uid $(id -u)); $image${CATALOG_ARGS:+ ($CATALOG_ARGS)}; reports $reports"
start=$(date +%s)
"${compose[@]}" -p "$project" up --no-build >"$log" 2>&1 &
# v1 names a container project_cpu_1, v2 project-cpu-1
for _ in $(seq 1 900); do grep -qE "cpu[-_]1 exited with code" "$log" && break; sleep 1; done
grep -E "cpu[-_]1 +\|" "$log" | sed -E 's/\x1b\[[0-9;]*m//g'
code=$(sed -nE 's/.*cpu[-_]1 exited with code ([0-9]+).*/\1/p' "$log" | tail -n 1)
get() {  # URL path -> "status content-type", body into $page
  curl -s -o "$page" -w '%{http_code} %{content_type}' "http://127.0.0.1:$port/$1"
}
page=$(mktemp /tmp/vllm-repro-compose-page.XXXXXX)
status=000
for _ in $(seq 1 30); do
  status=$(get "" | cut -d' ' -f1) && [ "$status" = 200 ] && break
  sleep 1
done
index_ok=0; grep -q "vllm-repro reports" "$page" && index_ok=1
# the reports server started after the catalog had finished, and its healthcheck says healthy
cpu_id=$("${compose[@]}" -p "$project" ps -q cpu 2>/dev/null); reports_id=$("${compose[@]}" -p "$project" ps -q reports 2>/dev/null)
health=none
for _ in $(seq 1 40); do
  health=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$reports_id" 2>/dev/null || echo none)
  [ "$health" = healthy ] && break; sleep 1
done
finished=$(docker inspect -f '{{.State.FinishedAt}}' "$cpu_id" 2>/dev/null); started=$(docker inspect -f '{{.State.StartedAt}}' "$reports_id" 2>/dev/null)
order_ok=0  # as nanoseconds: Docker's RFC 3339 times drop trailing zeros, so they do not sort as text
[ -n "$finished" ] && [ -n "$started" ] \
  && [ "$(date -d "$started" +%s%N)" -ge "$(date -d "$finished" +%s%N)" ] && order_ok=1
echo "compose-check: reports started ${started:-?} (cpu finished ${finished:-?}), health $health"
rows=$(grep -c '<tr' "$page" 2>/dev/null || echo 0)
run=vllm-23347-priority-preempt-scheduled/0.10.1.1
run_page=$(get "$run/index.html"); trace=$(get "$run/trace.jsonl")
echo "compose-check: cpu exited ${code:-?}; GET / -> $status ($rows rows); $run/index.html -> $run_page; trace.jsonl -> $trace; $(( $(date +%s) - start ))s"
# the reports belong to the checkout's owner (who cloned it) and the invoking user reads them
want=$(stat -c %u scenarios)
strangers=$(find "$reports" \! -uid "$want" -print 2>/dev/null | head -n 3)
unreadable=$(find "$reports" -type f \! -readable -print 2>/dev/null | head -n 3)
echo "compose-check: reports owned by uid $(stat -c %u "$reports" 2>/dev/null) (checkout's owner: $want)${strangers:+; NOT theirs: $strangers}${unreadable:+; unreadable: $unreadable}"
# the reports server must stop on SIGTERM (init: true), not be killed at the timeout
down_start=$(date +%s%N)
"${compose[@]}" -p "$project" down --timeout 5 >>"$log" 2>&1
down_ms=$(( ($(date +%s%N) - down_start) / 1000000 ))
echo "compose-check: ${compose[*]} down took ${down_ms} ms (goal under 3000)"
trap - EXIT
rm -f "$page"
[ "${code:-1}" = 0 ] && [ "$status" = 200 ] && [ "$index_ok" = 1 ] \
  && [ "$health" = healthy ] && [ "$order_ok" = 1 ] && [ "${run_page%% *}" = 200 ] && [[ "$trace" == "200 text/plain"* ]] \
  && [ -z "$strangers" ] && [ -z "$unreadable" ] && [ "$down_ms" -lt 3000 ] \
  || { echo "compose-check: FAILED (compose log: $log)" >&2; exit 1; }
rm -f "$log"
echo "compose-check: ok"
