#!/usr/bin/env bash
# Plan a preset model on a preset cluster, explain the plan, and emit a torchrun training script.
#
#   examples/plan_preset.sh [MODEL] [CLUSTER] [GLOBAL_BATCH] [OUTDIR]
#   examples/plan_preset.sh gpt3-175b dgx-a100-80g:nodes=128 1536 /tmp/plan175b
set -euo pipefail
MODEL=${1:-gpt-small}
CLUSTER=${2:-cpu-local}
GLOBAL_BATCH=${3:-8}
OUT=${4:-plan_out}
AUTOPAR=${AUTOPAR:-"python -m planner"}
mkdir -p "$OUT"
# 1. search the fastest plan that fits; write it as YAML (solver status, bound and gap included) and emit the
#    training script a user would write by hand (runs with torchrun, no autopar needed)
$AUTOPAR plan "$MODEL" --cluster "$CLUSTER" --global-batch "$GLOBAL_BATCH" --top-k 3 \
    --out "$OUT/plan.yaml" --emit "$OUT/train.py"
# 2. explain it: stages, memory per GPU, step-time breakdown, why the alternatives lost (and as JSON, and HTML)
$AUTOPAR inspect "$OUT/plan.yaml"
$AUTOPAR inspect "$OUT/plan.yaml" --json > "$OUT/plan.json"
$AUTOPAR inspect "$OUT/plan.yaml" --html "$OUT/report.html" > /dev/null
echo "plan: $OUT/plan.yaml  report: $OUT/report.html  script: $OUT/train.py  (torchrun --nproc-per-node N $OUT/train.py)"
