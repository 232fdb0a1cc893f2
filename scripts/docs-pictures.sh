#!/usr/bin/env bash
# Refresh the pictures the documentation shows (docs/img/) from real runs of the lab, as a user
# gets them: the flagship (#23347) on 0.10.1.1 and 0.10.2 (its timeline, the reports index and the
# crash's run page, as headless Chromium shows them 1400 px wide), the release matrix of the same
# scenario on those two releases (matrix.png) and a small fuzzing campaign over them (heatmap.png).
# `make docs-pictures` runs it; `make docs` then builds the pages that show them.
#
#   scripts/docs-pictures.sh [WORK]   # WORK: where the runs' reports go (default: a new temporary folder)
#
# Needs the venv (make venv) and Debian's chromium (apt-get install chromium) for the two
# screenshots; the releases are prepared on first use (minutes), later runs take a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
REPRO=${REPRO:-.venv/bin/vllm-repro}
SCENARIO=scenarios/vllm-23347-priority-preempt-scheduled.yaml
NAME=vllm-23347-priority-preempt-scheduled
WORK=${1:-$(mktemp -d -t vllm-repro-pictures-XXXXXX)}
REPORTS=$WORK/reports
IMG=docs/img
mkdir -p "$REPORTS" "$IMG"
[ -x "$REPRO" ] || { echo "docs-pictures: no $REPRO (make venv)" >&2; exit 3; }
CHROMIUM=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$CHROMIUM" ] || { echo "docs-pictures: no chromium on PATH (Debian: apt-get install chromium)" >&2; exit 3; }

say() { echo "docs-pictures: $*" >&2; }

say "the release matrix on 0.10.1.1 and 0.10.2 -> $REPORTS"
"$REPRO" matrix "$SCENARIO" --releases '==0.10.1.1' --releases '==0.10.2' --reports "$REPORTS" || [ $? = 1 ]
say "a small campaign over the same releases (the heat map)"
"$REPRO" campaign --releases '>=0.10.1.1,<=0.10.2' --seeds 2 --policy priority --features concurrent \
  --examples 12 --no-shrink --out "$WORK/campaign" --reports "$REPORTS" || [ $? = 1 ]
# last: the matrix's plain runs are the flagship's own report folders, drawn without timelines
say "the flagship on its releases (timelines and pages)"
"$REPRO" run "$SCENARIO" --reports "$REPORTS"

cp "$REPORTS/$NAME/0.10.1.1/timeline.png" "$IMG/timeline.png"
cp "$REPORTS/_matrix/$NAME/matrix.png" "$IMG/matrix.png"
cp "$WORK/campaign/heatmap.png" "$IMG/heatmap.png"

shot() {  # shot PAGE OUT HEIGHT: the page as Chromium shows it in a 1400 px wide window
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --no-first-run --hide-scrollbars \
    --user-data-dir="$WORK/chromium" --window-size="1400,$3" --screenshot="$2" "file://$1" 2>/dev/null
}
shot "$REPORTS/index.html" "$IMG/report-index.png" 1000
shot "$REPORTS/$NAME/0.10.1.1/index.html" "$IMG/report-run.png" 1800
say "refreshed: $(cd "$IMG" && ls timeline.png matrix.png heatmap.png report-index.png report-run.png | tr '\n' ' ')(from $WORK)"
