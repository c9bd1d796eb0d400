#!/usr/bin/env python
"""Per-sequence next-token NLL and greedy predictions of a megatron-delta checkpoint.

  python tools/evaluate.py --load RUN_OR_ITER_DIR --tokens-file F.json --output OUT.json

F.json: a JSON list of token-id lists. OUT.json:
  {"sequences": [{"nll": summed next-token NLL (nats), "tokens": greedy next token after each position,
                  "num_tokens": number of predicted tokens}],
   "total_nll": ..., "total_tokens": ...}
With --logits-file L.pt the fp32 logits (vocabulary padding stripped), one [len, vocab] tensor per
sequence, are saved too (torch.save of a list).

The checkpoint, saved under any TP/PP/VPP layout, is resharded on load into the layout asked for:

  python tools/evaluate.py --load CKPT ...                         one process, TP1/PP1
  torchrun --nproc-per-node 4 tools/evaluate.py --load CKPT ... \
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

As in pretrain_gpt.py, the world size is TP x PP x DP: each model replica runs every sequence through
Megatron's pipeline schedule (forward only; logits gathered over TP on the last stage), the DP replicas
share the sequences, and rank 0 writes OUT.json. A layout whose TP x PP does not divide the world size
is refused. The numbers do not depend on the layout (fp32: equal to TP1 within 1e-4 in NLL).

--dtype auto (the default) computes in the precision the checkpoint was trained in: a `--bf16` run's model
in bf16, as Megatron-LM's own evaluation during training holds it (Float16Module; the routers compute in
fp32); --dtype fp32 computes with the same weights in fp32. OUT.json records the dtype used.

The checkpoint's files are verified against its integrity.json before it is read (--no-verify-integrity skips
it): a damaged checkpoint is one error line, and OUT.json is not written.
"""
import argparse
import json
import os
import sys

from megatron_delta.checkpoint.integrity import add_verify_integrity_argument
from megatron_delta.evaluation.precision import add_dtype_argument
from megatron_delta.platform.patches import known_warnings_quieted

os.environ.setdefault("OMP_NUM_THREADS", "1")


@known_warnings_quieted()
def main(argv=None):
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True)
    p.add_argument("--tokens-file", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--logits-file", default=None)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    add_dtype_argument(p)
    add_verify_integrity_argument(p)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)

    from megatron_delta.checkpoint.errors import CheckpointError, ConversionError
    from megatron_delta.evaluation.token_nll import evaluate_checkpoint, read_token_sequences

    try:
        seqs = read_token_sequences(a.tokens_file)
    except ValueError as err:
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 2
    try:
        result, logits, parallel = evaluate_checkpoint(a.load, seqs, a.tensor_model_parallel_size,
                                                       a.pipeline_model_parallel_size, a.dtype,
                                                       where=f"--tokens-file {a.tokens_file}",
                                                       verify_integrity=a.verify_integrity)
    except (ConversionError, CheckpointError) as err:
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.output, "w") as f:
            json.dump(result, f)
        if a.logits_file:
            torch.save(logits, a.logits_file)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = (f" (TP{a.tensor_model_parallel_size} PP{a.pipeline_model_parallel_size} "
                  f"DP{world // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size)})" if parallel else "")
        print(f"[evaluate] {len(seqs)} sequences, {result['total_tokens']} tokens, mean NLL "
              f"{result['total_nll'] / max(result['total_tokens'], 1):.4f} in {result['dtype']}{layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
