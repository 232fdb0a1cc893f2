#!/usr/bin/env bash
# `docker-compose up` end to end, as CI runs it: the catalog's verdicts printed from inside the
# CPU image (service cpu), then an HTTP GET of the reports page (service reports, 127.0.0.1).
#
#   scripts/compose-check.sh [REPORTS_DIR]      # needs the CPU image (make images)
#
# Exit 0 when the cpu service exits 0 and the page answers with the index; 1 otherwise; 3 when
# docker-compose is missing. Leaves nothing running (docker-compose down).
set -uo pipefail
cd "$(dirname "$0")/.."
command -v docker-compose >/dev/null || { echo "compose-check: docker-compose is not installed" >&2; exit 3; }
reports=${1:-$(mktemp -d /tmp/vllm-repro-compose.XXXXXX)}
mkdir -p "$reports" && chmod a+rwx "$reports"   # the containers run as the image's user (uid 1000)
port=${REPORTS_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
project=vllmrepro-ci-$$
export REPORTS_DIR=$reports REPORTS_PORT=$port
log=$reports/compose.log
trap 'docker-compose -p "$project" down --timeout 5 >/dev/null 2>&1' EXIT
start=$(date +%s)
docker-compose -p "$project" up --no-build >"$log" 2>&1 &
for _ in $(seq 1 600); do grep -q "cpu_1 exited with code" "$log" && break; sleep 1; done
grep -E "cpu_1 +\|" "$log" | sed -E 's/\x1b\[[0-9;]*m//g'
code=$(sed -nE 's/.*cpu_1 exited with code ([0-9]+).*/\1/p' "$log" | tail -n 1)
status=000
for _ in $(seq 1 30); do
  status=$(curl -s -o "$reports/page.html" -w '%{http_code}' "http://127.0.0.1:$port/") && [ "$status" = 200 ] && break
  sleep 1
done
echo "compose-check: cpu exited ${code:-?}; GET http://127.0.0.1:$port/ -> $status ($(grep -c '<tr>' "$reports/page.html" 2>/dev/null || echo 0) rows); $(( $(date +%s) - start ))s"
# the reports server must stop on SIGTERM (init: true), not be killed at the timeout
down_start=$(date +%s%N)
docker-compose -p "$project" down --timeout 5 >>"$log" 2>&1
down_ms=$(( ($(date +%s%N) - down_start) / 1000000 ))
echo "compose-check: docker-compose down took ${down_ms} ms (goal under 3000)"
trap - EXIT
[ "${code:-1}" = 0 ] && [ "$status" = 200 ] && grep -q "vllm-repro reports" "$reports/page.html" \
  && [ "$down_ms" -lt 5000 ]
