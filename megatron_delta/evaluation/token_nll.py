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
"""
import argparse
import json
import os
import sys

from megatron_delta.platform.patches import known_warnings_quieted

os.environ.setdefault("OMP_NUM_THREADS", "1")


def evaluate_tokens(model, vocab, seqs):
    import torch
    import torch.nn.functional as F

    from megatron_delta.evaluation.loaders import megatron_logits

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


def evaluate_tokens_parallel(chunks, vocab, seqs):
    """evaluate_tokens under the current TP x PP x DP layout: every rank returns the full result
    (rank 0 writes it)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from megatron_delta.evaluation.loaders import megatron_logits_parallel

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mine = {}
    for i, ids in enumerate(seqs):
        if i % dp != dp_rank:
            continue
        logits = megatron_logits_parallel(chunks, ids)
        if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            logits = logits[:, :vocab]
            t = torch.tensor(ids[1:], dtype=torch.long)
            nll = F.cross_entropy(logits[:-1].double(), t, reduction="sum").item() if len(ids) > 1 else 0.0
            mine[i] = ({"nll": nll, "tokens": logits.argmax(-1).tolist(), "num_tokens": len(ids) - 1}, logits)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    every = {i: r for part in gathered for i, r in part.items()}
    assert sorted(every) == list(range(len(seqs))), sorted(every)
    out = [every[i][0] for i in range(len(seqs))]
    result = {"sequences": out, "total_nll": sum(r["nll"] for r in out),
              "total_tokens": sum(r["num_tokens"] for r in out)}
    return result, [every[i][1] for i in range(len(seqs))]


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
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="precision of the forward: auto = as the checkpoint was trained (run_config.json bf16)")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)

    from megatron_delta.checkpoint.errors import CheckpointError, ConversionError
    from megatron_delta.checkpoint.run_config import true_vocab_size
    from megatron_delta.evaluation.loaders import load_megatron, load_megatron_parallel
    from megatron_delta.platform.distributed import destroy_distributed

    try:
        seqs = json.load(open(a.tokens_file))
    except (OSError, ValueError) as err:
        print(f"evaluate.py: error: --tokens-file {a.tokens_file}: {err}", file=sys.stderr)
        return 2
    if not isinstance(seqs, list) or not all(isinstance(s, list) and s and all(isinstance(x, int) for x in s)
                                             for s in seqs):
        print(f"evaluate.py: error: {a.tokens_file} must hold a JSON list of non-empty token-id lists",
              file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = world > 1 or a.tensor_model_parallel_size * a.pipeline_model_parallel_size > 1
    try:
        if parallel:
            chunks, args, rc = load_megatron_parallel(a.load, a.tensor_model_parallel_size,
                                                      a.pipeline_model_parallel_size, dtype=a.dtype)
        else:
            model, args, rc = load_megatron(a.load, dtype=a.dtype)
        dtype = "bf16" if args.bf16 else "fp32"
        vocab = true_vocab_size(rc)
        bad = [x for s in seqs for x in s if not 0 <= x < vocab]
        if bad:
            raise ConversionError(f"--tokens-file {a.tokens_file}: token ids out of range [0, {vocab}): {bad[:5]}")
        long = [len(s) for s in seqs if len(s) > rc["max_position_embeddings"]]
        if long:
            raise ConversionError(f"--tokens-file {a.tokens_file}: sequences of {long[:5]} tokens are longer than "
                                  f"the model's {rc['max_position_embeddings']} positions")
        result, logits = evaluate_tokens_parallel(chunks, vocab, seqs) if parallel else \
            evaluate_tokens(model, vocab, seqs)
        result["dtype"] = dtype
    except (ConversionError, CheckpointError) as err:
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.output, "w") as f:
            json.dump(result, f)
        if a.logits_file:
            torch.save(logits, a.logits_file)
        layout = (f" (TP{a.tensor_model_parallel_size} PP{a.pipeline_model_parallel_size} "
                  f"DP{world // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size)})" if parallel else "")
        print(f"[evaluate] {len(seqs)} sequences, {result['total_tokens']} tokens, mean NLL "
              f"{result['total_nll'] / max(result['total_tokens'], 1):.4f} in {dtype}{layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
