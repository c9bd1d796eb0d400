#!/usr/bin/env python
"""Per-sequence next-token NLL and greedy predictions of a megatron-delta checkpoint.

  python tools/evaluate.py --load RUN_OR_ITER_DIR --tokens-file F.json --output OUT.json

F.json: a JSON list of token-id lists. OUT.json:
  {"sequences": [{"nll": summed next-token NLL (nats), "tokens": greedy next token after each position,
                  "num_tokens": number of predicted tokens}],
   "total_nll": ..., "total_tokens": ...}
With --logits-file L.pt the fp32 logits (vocabulary padding stripped), one [len, vocab] tensor per
sequence, are saved too (torch.save of a list).

The checkpoint (any TP/PP/VPP layout) is loaded resharded into one TP1/PP1 model in this process:
`--tensor-model-parallel-size` / `--pipeline-model-parallel-size` are accepted for symmetry with
pretrain_gpt.py but evaluation always runs TP1/PP1 here (the numbers do not depend on the layout).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def evaluate_tokens(model, vocab, seqs):
    import torch
    import torch.nn.functional as F

    from megatron_delta.conversion import megatron_logits

    out, logits_all, total_nll, total_tokens = [], [], 0.0, 0
    for ids in seqs:
        t = torch.tensor([ids], dtype=torch.long)
        logits = megatron_logits(model, t)[0, :, :vocab]
        logits_all.append(logits)
        nll = F.cross_entropy(logits[:-1].double(), t[0, 1:], reduction="sum").item() if len(ids) > 1 else 0.0
        out.append({"nll": nll, "tokens": logits.argmax(-1).tolist(), "num_tokens": len(ids) - 1})
        total_nll += nll
        total_tokens += len(ids) - 1
    return {"sequences": out, "total_nll": total_nll, "total_tokens": total_tokens}, logits_all


def main(argv=None):
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True)
    p.add_argument("--tokens-file", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--logits-file", default=None)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from megatron_delta.training import _quiet_known_warnings

    _quiet_known_warnings()
    from megatron_delta.checkpointing import CheckpointError
    from megatron_delta.conversion import ConversionError, load_megatron, true_vocab_size
    from megatron_delta.cpu_platform import destroy_distributed

    seqs = json.load(open(a.tokens_file))
    if not isinstance(seqs, list) or not all(isinstance(s, list) and s and all(isinstance(x, int) for x in s)
                                             for s in seqs):
        print(f"evaluate.py: error: {a.tokens_file} must hold a JSON list of non-empty token-id lists",
              file=sys.stderr)
        return 2
    try:
        model, args, rc = load_megatron(a.load)
        vocab = true_vocab_size(rc)
        bad = [x for s in seqs for x in s if not 0 <= x < vocab]
        if bad:
            raise ConversionError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        result, logits = evaluate_tokens(model, vocab, seqs)
    except (ConversionError, CheckpointError) as err:
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            destroy_distributed()
    with open(a.output, "w") as f:
        json.dump(result, f)
    if a.logits_file:
        torch.save(logits, a.logits_file)
    print(f"[evaluate] {len(seqs)} sequences, {result['total_tokens']} tokens, mean NLL "
          f"{result['total_nll'] / max(result['total_tokens'], 1):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
