#!/usr/bin/env bash
# A Hugging Face model (a transformers config class with overrides; random weights, nothing downloaded): plan it
# for this machine's gloo ranks with tensor parallelism pinned, emit the script, and train a few steps.
#
#   examples/hf_model.sh [OUTDIR] [STEPS]
set -euo pipefail
OUT=${1:-hf_out}
STEPS=${2:-5}
AUTOPAR=${AUTOPAR:-"python -m planner"}
MODEL="hf:llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,vocab_size=128"
mkdir -p "$OUT"
$AUTOPAR plan "$MODEL" --cluster cpu-local --fix tp=2 --global-batch 8 --out "$OUT/plan.yaml" --emit "$OUT/train.py"
# the emitted script needs only torch and transformers
OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 "$OUT/train.py" --steps "$STEPS"
