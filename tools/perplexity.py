#!/usr/bin/env python
"""Held-out perplexity of a megatron-delta checkpoint: SOTU validation speeches and the Wikipedia sample.

    python tools/perplexity.py --load runs/default-delta_block [--output ppl.json]
        [--data-path [NAME=]PREFIX ...] [--max-tokens 65536] [--seq-length S] [--batch-size 8]

By default it reads the two held-out sets of the bundled corpus (megatron_delta.data.corpus.ensure_default_data,
built once under --cache-dir): `sotu_valid` (every 10th State of the Union speech, never trained on) and
`wiki` (the Wikipedia sample, another distribution). `--data-path` takes other preprocessed prefixes
(tokenised with the checkpoint's tokenizer), optionally named `NAME=PREFIX`.

What is measured: each dataset's documents are concatenated in file order (EOD after each document, as
preprocessing wrote them) and the first --max-tokens tokens (0 = all) are cut into consecutive windows of
--seq-length + 1 tokens that overlap by one token, so every token after the first is predicted exactly
once, with up to --seq-length tokens of context from its own window. The perplexity is
exp(sum of next-token NLL / number of predicted tokens) over the tokenizer's vocabulary (the padding rows
of Megatron's embedding are dropped, as in the exported Hugging Face model). Unlike the validation that
pretrain_gpt.py prints (the first --eval-iters batches of Megatron's shuffled GPTDataset), this covers a
fixed, contiguous prefix of each set, the same for every checkpoint, so runs compare directly.

The checkpoint (any TP/PP/VPP layout) is read resharded into one TP1/PP1 model in this process. With
--dtype auto (the default) it computes in the precision it was trained in (a `--bf16` run's model in bf16,
routers in fp32, as in training); --dtype fp32 computes with the same weights in fp32.
"""
import argparse
import json
import os
import sys

from megatron_delta.checkpoint.integrity import add_verify_integrity_argument
from megatron_delta.evaluation.perplexity import PerplexityError, measure_perplexity
from megatron_delta.evaluation.precision import add_dtype_argument
from megatron_delta.platform.patches import known_warnings_quieted

os.environ.setdefault("OMP_NUM_THREADS", "1")

PROG = "perplexity.py"


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--load", required=True, help="a run directory (its latest checkpoint) or an iter_* directory")
    p.add_argument("--output", default=None, help="write the figures as JSON here")
    p.add_argument("--data-path", nargs="+", default=None, metavar="[NAME=]PREFIX",
                   help="preprocessed data prefixes (default: the bundled SOTU validation split and Wikipedia sample)")
    p.add_argument("--max-tokens", type=int, default=65536, help="tokens read per dataset (0 = all; default 65536)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="tokens of context per window (default: the checkpoint's --seq-length)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    add_dtype_argument(p)
    add_verify_integrity_argument(p)
    p.add_argument("--cache-dir", default=os.path.join("runs", "cache"), help="where the default data is built")
    return p


def main(argv=None):
    opts = build_parser().parse_args(argv)
    try:
        if opts.max_tokens < 0:
            raise PerplexityError(f"--max-tokens must be >= 0 (0 = all), got {opts.max_tokens}")
        if opts.batch_size < 1:
            raise PerplexityError(f"--batch-size must be >= 1, got {opts.batch_size}")
        if opts.seq_length is not None and opts.seq_length < 1:
            raise PerplexityError(f"--seq-length must be >= 1, got {opts.seq_length}")
        if not os.path.exists(opts.load):  # before the slow imports
            raise PerplexityError(f"--load: {opts.load} does not exist")
        return _run(opts)
    except PerplexityError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


@known_warnings_quieted()
def _run(opts):
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = measure_perplexity(opts)
    if opts.output:
        os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
        with open(opts.output, "w") as f:
            json.dump(result, f, indent=1)
        print(f" wrote {opts.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
