#!/usr/bin/env bash
# Train every residual mode (and delta_block with K = 2, 4, 6) with ONE tiny configuration, one seed,
# one data order and one token budget on CPU, then print the comparison table.
#
#   bash examples/compare_residuals.sh                 # 12 layers (divisible by 2, 4 and 6), 200 iterations
#   ITERS=20 OUT=runs/cmp-smoke bash examples/compare_residuals.sh
#   MOCK=1 ITERS=5 bash examples/compare_residuals.sh  # mock tokens (no held-out set): a plumbing check
#
# Data: the bundled SOTU corpus (train), its by-speech validation split and the Wikipedia held-out
# sample (built once under runs/cache by megatron_delta.data.corpus.ensure_default_data), passed explicitly
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
if (( LAYERS > 4 && LAYERS % 4 )); then  # pretrain_gpt.py would refuse the delta_block / attnres rows below
  echo "compare_residuals.sh: LAYERS=$LAYERS: delta_block and attnres run with the default K = 4 blocks, which" \
       "must divide the layers; choose a multiple of 4" >&2
  exit 2
fi

if [[ "$MOCK" == 1 ]]; then
  DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 4096)
else
  mapfile -t P < <("$PY" - <<'PYEOF'
from megatron_delta.data.corpus import ensure_default_data
p = ensure_default_data("runs/cache")
print(p["train_data_path"][0]); print(p["sotu_valid_data_path"]); print(p["heldout_data_path"]); print(p["tokenizer_model"])
PYEOF
)
  DATA=(--train-data-path "${P[0]}" --valid-data-path "${P[1]}" --delta-heldout-data-path "${P[2]}"
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "${P[3]}")
fi

# Megatron-LM's flags (pretrain_gpt.py is megatron.training.pretrain): a Qwen3-style model, the embedded
# run's optimiser settings, and the CPU switches (no CUDA: local layers, gloo, no GPU fusions).
COMMON=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size $(( 3 * HIDDEN ))
        --num-attention-heads "$HEADS" --group-query-attention --num-query-groups $(( HEADS / 2 ))
        --seq-length "$SEQ" --max-position-embeddings "$SEQ" --normalization RMSNorm --norm-epsilon 1e-6
        --swiglu --qk-layernorm --disable-bias-linear --position-embedding-type rope --rotary-base 1000000
        --micro-batch-size "$MBS" --global-batch-size "$MBS" --train-iters "$ITERS" --seed "$SEED"
        --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters $(( ITERS / 20 )) --weight-decay 0.1
        --clip-grad 1.0 --adam-beta2 0.95 --hidden-dropout 0 --attention-dropout 0
        --eval-interval "$ITERS" --eval-iters "$EVAL_ITERS" --log-interval $(( ITERS < 10 ? 1 : ITERS / 10 ))
        --transformer-impl local --no-gradient-accumulation-fusion --distributed-backend gloo
        --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion
        --use-cpu-initialization --no-persist-layer-norm
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
