#!/usr/bin/env bash
# Train every residual mode (and delta_block with K = 2, 4, 6) with ONE tiny configuration, one seed,
# one data order and one token budget on CPU, then print the comparison table.
#
#   bash examples/compare_residuals.sh                 # 12 layers (divisible by 2, 4 and 6), 200 iterations
#   ITERS=20 OUT=runs/cmp-smoke bash examples/compare_residuals.sh
#   MOCK=1 ITERS=5 bash examples/compare_residuals.sh  # mock tokens (no held-out set): a plumbing check
#
# Data: the bundled SOTU corpus (train), its by-speech validation split and the Wikipedia held-out
# sample (built once under runs/cache by megatron_delta.data.ensure_default_data), passed explicitly
# so every run reads the same batches. Each run: OUT/<name>/metrics.jsonl + summary.json
# (tools/compare_runs.py train); the table: OUT/table.md; the curves: OUT/loss.png.
# Throughput and memory on a shared CPU are noisy: compare them only between runs of one invocation.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/compare}
ITERS=${ITERS:-200}
LAYERS=${LAYERS:-12}
HIDDEN=${HIDDEN:-64}
HEADS=${HEADS:-4}
SEQ=${SEQ:-128}
MBS=${MBS:-8}
SEED=${SEED:-1234}
MOCK=${MOCK:-0}
EVAL_ITERS=${EVAL_ITERS:-4}

if [[ "$MOCK" == 1 ]]; then
  DATA=(--mock-data)
else
  mapfile -t P < <("$PY" - <<'PYEOF'
from megatron_delta.data import ensure_default_data
p = ensure_default_data("runs/cache")
print(p["train_data_path"][0]); print(p["sotu_valid_data_path"]); print(p["heldout_data_path"]); print(p["tokenizer_model"])
PYEOF
)
  DATA=(--data-path "${P[0]}" --valid-data-path "${P[1]}" --heldout-data-path "${P[2]}"
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "${P[3]}")
fi

COMMON=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --seq-length "$SEQ"
        --micro-batch-size "$MBS" --global-batch-size "$MBS" --train-iters "$ITERS" --seed "$SEED"
        --eval-interval "$ITERS" --eval-iters "$EVAL_ITERS" --log-interval $(( ITERS < 10 ? 1 : ITERS / 10 ))
        "${DATA[@]}")

RUNS=()
run() {  # run NAME FLAGS...
  local name=$1; shift
  echo "=== $name ==="
  "$PY" tools/compare_runs.py train --run-dir "$OUT/$name" -- "${COMMON[@]}" "$@"
  RUNS+=("$OUT/$name")
}

run baseline      --residual baseline
run delta_block   --residual delta_block   # K = 4 (the default)
run delta         --residual delta
run attnres       --residual attnres       # K = 4
run full_attnres  --residual full_attnres
for K in 2 6; do
  if (( LAYERS % K == 0 )); then
    run "delta_block_K$K" --residual delta_block --delta-num-blocks "$K"
  else
    echo "skipping delta_block K=$K: it does not divide $LAYERS layers"
  fi
done

"$PY" tools/compare_runs.py table "${RUNS[@]}" --output "$OUT/table.md"
"$PY" tools/plot_metrics.py --metrics-file "${RUNS[@]/%//metrics.jsonl}" --output "$OUT/loss.png" --smooth 10
