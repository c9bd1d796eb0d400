"""What the conversion tests share (tests/integration/test_conversion.py, the MLA and SmolLM2 chains): the export's
tolerance and token sequences, HF logits, and pretrain_gpt.py --finetune of an imported checkpoint."""
import os
import subprocess
import sys

import torch

from megatron_delta.checkpoint import run_config
from tests.helpers import REPO_ROOT
from tests.helpers.flags import CPU

EXPORT_TOL = 5e-6  # the export test: fp32 round-off of the same function, not 1e-4
SEQS = [[1, 5, 9, 200, 3, 3, 17, 255, 0, 42, 7], [250, 2, 64, 128]]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def finetune(ckpt, save, extra=("--mock-data",), iters=2, seq=16):
    """pretrain_gpt.py --finetune --load CKPT (an imported checkpoint) with its model flags (+ `extra`)."""
    from megatron_delta.checkpoint.run_config import read_run_config, resolve_checkpoint_dir

    rc = read_run_config(resolve_checkpoint_dir(ckpt)[0])
    argv = (run_config.model_flags(rc) + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(rc["vocab_size"]),
                                          "--finetune", "--load", ckpt, "--delta-router-lr-mult", "100", "--lr", "5e-5",
                                          "--min-lr", "5e-6", "--lr-warmup-iters", "0", "--weight-decay", "0.0",
                                          "--seq-length", str(seq), "--micro-batch-size", "1",
                                          "--global-batch-size", "2", "--train-iters", str(iters),
                                          "--eval-iters", "1", "--eval-interval", "1000", "--log-interval", "1",
                                          "--save", save, "--save-interval", "1000", "--no-save-optim"] +
            CPU + list(extra))
    proc = subprocess.run([sys.executable, "pretrain_gpt.py"] + argv, cwd=REPO_ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout
