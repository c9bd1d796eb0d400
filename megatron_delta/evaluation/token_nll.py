"""Per-sequence next-token NLL and greedy predictions of a checkpoint (tools/evaluate.py parses its flags).

evaluate_tokens runs one TP1/PP1 model in this process; evaluate_tokens_parallel runs the sequences under the
current TP x PP x DP layout (each model replica through Megatron's pipeline schedule, forward only; the DP replicas
share the sequences). evaluate_checkpoint loads the checkpoint into the layout asked for and runs the one that fits.
"""
import json
import os


def read_token_sequences(path: str) -> list:
    """The JSON list of non-empty token-id lists in ``path`` (--tokens-file); ValueError names the file."""
    try:
        with open(path) as f:
            seqs = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokens-file {path}: {err}") from err
    if not isinstance(seqs, list) or not all(isinstance(s, list) and s and all(isinstance(x, int) for x in s)
                                             for s in seqs):
        raise ValueError(f"{path} must hold a JSON list of non-empty token-id lists")
    return seqs


def evaluate_tokens(model, vocab, seqs):
    """Each sequence through one TP1/PP1 model: (the result as tools/evaluate.py writes it, one [len, vocab] fp32
    logits tensor per sequence)."""
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


def evaluate_checkpoint(load: str, seqs: list, tensor_model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1, dtype: str = "auto", where: str = "--tokens-file",
                        verify_integrity: bool = True):
    """The checkpoint ``load`` (any saved layout) evaluated on ``seqs``: in this process (TP1/PP1), or split over
    TP x PP ranks of this torch.distributed world when it has more than one rank or the layout asks for more.
    Returns (result with its "dtype", logits per sequence, parallel). Token ids outside the vocabulary and
    sequences longer than the model's positions raise ConversionError naming ``where``."""
    import torch.distributed as dist

    from megatron_delta.checkpoint.errors import ConversionError
    from megatron_delta.checkpoint.run_config import true_vocab_size
    from megatron_delta.evaluation.loaders import load_megatron, load_megatron_parallel
    from megatron_delta.platform.distributed import destroy_distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = world > 1 or tensor_model_parallel_size * pipeline_model_parallel_size > 1
    try:
        if parallel:
            chunks, args, rc = load_megatron_parallel(load, tensor_model_parallel_size, pipeline_model_parallel_size,
                                                      dtype=dtype, verify_integrity=verify_integrity)
        else:
            model, args, rc = load_megatron(load, dtype=dtype, verify_integrity=verify_integrity)
        vocab = true_vocab_size(rc)
        bad = [x for s in seqs for x in s if not 0 <= x < vocab]
        if bad:
            raise ConversionError(f"{where}: token ids out of range [0, {vocab}): {bad[:5]}")
        long = [len(s) for s in seqs if len(s) > rc["max_position_embeddings"]]
        if long:
            raise ConversionError(f"{where}: sequences of {long[:5]} tokens are longer than "
                                  f"the model's {rc['max_position_embeddings']} positions")
        result, logits = evaluate_tokens_parallel(chunks, vocab, seqs) if parallel else \
            evaluate_tokens(model, vocab, seqs)
        result["dtype"] = "bf16" if args.bf16 else "fp32"
    finally:
        if dist.is_available() and dist.is_initialized():
            destroy_distributed()
    return result, logits, parallel
