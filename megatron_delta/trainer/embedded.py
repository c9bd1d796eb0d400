"""The embedded default run: ``main([])`` and ``main(["--residual", "delta_block"])``.

When is a run the embedded default run? Exactly when its arguments name NO data: none of
``--data-path``, ``--mock-data``, ``--train-data-path``, ``--valid-data-path``, ``--test-data-path``,
``--data-args-path``, ``--per-split-data-args-path`` (Megatron-LM's data flags; ``--delta-heldout-data-path``
does not count). Then:

- data: the bundled corpus (megatron_delta.data.corpus.ensure_default_data, built once under runs/cache):
  ``--train-data-path`` the SOTU training speeches, ``--valid-data-path`` the SOTU validation speeches,
  ``--delta-heldout-data-path`` the Wikipedia sample, ``--tokenizer-type SentencePieceTokenizer
  --tokenizer-model`` the bundled BPE tokenizer. Giving ``--tokenizer-type``/``--tokenizer-model``/
  ``--vocab-size`` without data is an error (the corpus is tokenized with its own tokenizer).
- every flag of :data:`EMBEDDED_DEFAULTS` that the arguments do not give is added: the embedded
  defaults (4 layers, hidden 128, Qwen3-style: RMSNorm, SwiGLU, RoPE base 1e6, qk-layernorm, GQA 4
  heads / 2 groups (none with --multi-latent-attention), no biases;
  seq 128, MBS 8, 200 iterations, lr 3e-3 cosine to 3e-4, warmup 5 %,
  weight decay 0.1, clip 1, beta2 0.95, eval every 100 iterations over 10 batches, log every 10);
  a flag given on the command line wins (``--train-iters 20``, ``--num-layers 8``, ...); training
  Megatron-LM's ``--exit-duration-in-mins 5`` guards the 5 minutes the run promises (on an idle 2-core
  machine the 200 iterations take well under a minute; past the limit Megatron saves and exits).
- ``--save runs/default-<residual>`` (``--save-interval`` = ``--train-iters``: saved once, at the end).
- on CPU (no CUDA) the CPU switches: local transformer, gloo, no fusions, CPU initialisation.

Outside the embedded run nothing is added: the flags are Megatron-LM's, with Megatron-LM's defaults.
"""
from __future__ import annotations

import os
from typing import List, Sequence

DATA_FLAGS = ("--data-path", "--mock-data", "--train-data-path", "--valid-data-path", "--test-data-path",
              "--data-args-path", "--per-split-data-args-path")
TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-size")
CACHE_DIR = os.path.join("runs", "cache")

# flag -> value (None: a store_true switch). Iteration-dependent defaults (warmup, decay, save interval)
# are filled in by embedded_argv from the run's --train-iters.
EMBEDDED_DEFAULTS = {
    "--num-layers": "4", "--hidden-size": "128", "--ffn-hidden-size": "384", "--num-attention-heads": "4",
    "--group-query-attention": None, "--num-query-groups": "2", "--seq-length": "128",
    "--max-position-embeddings": "128", "--position-embedding-type": "rope", "--rotary-base": "1000000",
    "--swiglu": None, "--normalization": "RMSNorm", "--norm-epsilon": "1e-6", "--qk-layernorm": None,
    "--disable-bias-linear": None, "--init-method-std": "0.02", "--hidden-dropout": "0",
    "--attention-dropout": "0", "--make-vocab-size-divisible-by": "128",
    "--micro-batch-size": "8", "--train-iters": "200", "--lr": "3e-3", "--min-lr": "3e-4",
    "--lr-decay-style": "cosine", "--weight-decay": "0.1", "--clip-grad": "1.0", "--adam-beta1": "0.9",
    "--adam-beta2": "0.95", "--adam-eps": "1e-8", "--seed": "1234",
    "--eval-interval": "100", "--eval-iters": "10", "--log-interval": "10",
    "--exit-duration-in-mins": "5",  # at most 5 minutes on 2 CPU cores, counted from the run's start
}


def _cpu_switches() -> dict:
    """flag -> value (None: a switch) of the CPU switches: the one list is trainer.arguments.GPU_DEFAULTS."""
    from megatron_delta.trainer.arguments import GPU_DEFAULTS

    return dict((flag.split(" ") + [None])[:2] for _, _, flag in GPU_DEFAULTS)


class EmbeddedRunError(ValueError):
    """A flag that the embedded default run cannot take (main prints `pretrain_gpt.py: error: ...`)."""


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _value(argv: Sequence[str], flag: str, default: str) -> str:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def is_embedded(argv: Sequence[str]) -> bool:
    """True when the arguments name no data (module docstring). `--help` is never the embedded run."""
    if _given(argv, "--help") or _given(argv, "-h"):
        return False
    return not any(_given(argv, f) for f in DATA_FLAGS)


def embedded_argv(argv: Sequence[str]) -> List[str]:
    """The arguments of the embedded default run: the given ones + data + defaults not given."""
    import torch

    argv = list(argv)
    bad = [f for f in TOKENIZER_FLAGS if _given(argv, f)]
    if bad:
        raise EmbeddedRunError(
            f"{' '.join(bad)} needs --data-path (data tokenized with that tokenizer: tools/preprocess_data.py) "
            f"or --mock-data; without them the run uses the bundled corpus and its own tokenizer")
    from megatron_delta.data.corpus import ensure_default_data

    paths = ensure_default_data(CACHE_DIR)
    extra = ["--train-data-path", *paths["train_data_path"], "--valid-data-path", paths["sotu_valid_data_path"],
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", paths["tokenizer_model"]]
    if not _given(argv, "--delta-heldout-data-path"):
        extra += ["--delta-heldout-data-path", paths["heldout_data_path"]]
    defaults = dict(EMBEDDED_DEFAULTS)
    if not torch.cuda.is_available():
        defaults.update(_cpu_switches())
    if _given(argv, "--multi-latent-attention"):  # its latents replace the query groups (Megatron-LM refuses both)
        del defaults["--group-query-attention"], defaults["--num-query-groups"]
    for flag, value in defaults.items():
        if not _given(argv, flag):
            extra += [flag] if value is None else [flag, value]
    iters = int(_value(argv, "--train-iters", EMBEDDED_DEFAULTS["--train-iters"]))
    if not (_given(argv, "--lr-warmup-iters") or _given(argv, "--lr-warmup-fraction")
            or _given(argv, "--lr-warmup-samples")):
        extra += ["--lr-warmup-iters", str(iters // 20)]
    if not (_given(argv, "--lr-decay-iters") or _given(argv, "--lr-decay-samples")):
        extra += ["--lr-decay-iters", str(max(iters, 1))]
    if not _given(argv, "--save"):
        extra += ["--save", os.path.join("runs", f"default-{_value(argv, '--residual', 'baseline')}")]
    if not _given(argv, "--save-interval"):
        extra += ["--save-interval", str(max(iters, 1))]
    return argv + extra
