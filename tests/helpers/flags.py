"""Megatron-LM flag lists the tests share (pretrain_gpt.py takes Megatron-LM's flags with Megatron-LM's
defaults, so every choice the project's tiny models make is spelled out here), and each mode's flags.

QWEN3: the Qwen3-style architecture of the project's models (RMSNorm, SwiGLU, RoPE base 1e6,
qk-layernorm, grouped-query attention, no biases) and the optimiser settings of its default run.
CPU: what a Megatron-LM job needs on a machine without CUDA: the local (non-TE) layers, gloo, and
none of the CUDA-only fusions.
SPEED: what the tests' tiny models leave out for speed alone, none of it part of the function.
"""

QWEN3 = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--qk-layernorm",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "1000000",
         "--group-query-attention", "--init-method-std", "0.02", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
         "--seed", "1234"]

CPU = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--distributed-backend", "gloo",
       "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
       "--use-cpu-initialization", "--no-persist-layer-norm"]


# Why: a tiny model's batch is built in microseconds, but each of a run's train / valid / test loaders forks 2 worker
# processes (Megatron-LM's --num-workers default) and pickles every batch back: about half of a 1 s run.
SPEED = ["--num-workers", "0"]

def tiny(num_layers=2, hidden=64, heads=4, groups=2, seq=64, mbs=4, gbs=None, vocab=256, lr=3e-3,
         train_iters=None, mock=True, warmup_iters=0, decay_iters=None) -> list[str]:
    """A tiny Qwen3-style model in Megatron-LM's flags, with the CPU switches (NullTokenizer mock data
    unless mock=False: then pass --data-path and a tokenizer yourself)."""
    flags = ["--num-layers", str(num_layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(3 * hidden),
             "--num-attention-heads", str(heads), "--num-query-groups", str(groups), "--seq-length", str(seq),
             "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
             "--global-batch-size", str(gbs or mbs), "--lr", str(lr), "--min-lr", str(lr / 10),
             "--lr-decay-style", "cosine", "--lr-warmup-iters", str(warmup_iters)]
    if decay_iters is not None:
        flags += ["--lr-decay-iters", str(decay_iters)]
    if mock:
        flags += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]
    if train_iters is not None:
        flags += ["--train-iters", str(train_iters)]
    return flags + QWEN3 + CPU + SPEED


# The tiny model of every multi-process training test (tests/helpers/rank_runner.py's runs): 4 layers, hidden 64,
# 4 heads in 2 query groups, seq 32, MBS 2, GBS 8, lr 1e-2 (warm-up 1, cosine to 1e-3 over 20 iterations whatever
# --train-iters is), one evaluation iteration. NullTokenizer --vocab-size 256 (EOD = 255): 256 tokens pad to 256
# under TP1 and TP2 alike (a checkpoint only loads into the same padded vocabulary).
MODEL = tiny(num_layers=4, hidden=64, heads=4, groups=2, seq=32, mbs=2, gbs=8, lr=1e-2, warmup_iters=1,
             decay_iters=20) + ["--eval-iters", "1", "--eval-interval", "1000"]


def mode_flags(mode: str, num_layers: int = 4) -> list[str]:
    """--residual MODE; the block modes with K = L/2 blocks of 2 layers (under PP4 and PP2+VPP2, one layer per
    chunk, every block straddles a chunk boundary; under PP2 the boundary is a block boundary)."""
    from megatron_delta.core.modes import BLOCK_MODES

    return ["--residual", mode] + (["--delta-num-blocks", str(num_layers // 2)] if mode in BLOCK_MODES else [])


# The command-line tests' tiny run (pretrain_gpt.py refusals, flag parsing): 2 layers, hidden 32, real data flags
# given by each test, or CLI_MOCK's mock data.
CLI_TINY = tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, mock=False, train_iters=1) + [
    "--eval-iters", "1", "--eval-interval", "1000", "--save-interval", "1000"]
CLI_MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]

# The layouts of the session's 4-rank launch (tests/conftest.py four_rank_runs)
TP2_PP2_SP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
PP4 = ["--pipeline-model-parallel-size", "4"]
