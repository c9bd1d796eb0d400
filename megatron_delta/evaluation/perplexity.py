"""Held-out perplexity of a checkpoint over fixed, contiguous token streams (tools/perplexity.py parses its flags).

Each dataset's documents are concatenated in file order (read_token_stream: EOD after each document, as
preprocessing wrote them) and the first max_tokens tokens (0 = all) are cut into consecutive windows of
seq_length + 1 tokens that overlap by one token (windows), so every token after the first is predicted exactly
once, with up to seq_length tokens of context from its own window. The perplexity is exp(sum of next-token NLL /
number of predicted tokens) over the tokenizer's vocabulary (stream_nll; the padding rows of Megatron's embedding
are dropped, as in the exported Hugging Face model). The default sets are the bundled corpus' held-out ones
(datasets_to_measure); measure_perplexity loads the checkpoint (any TP/PP/VPP layout) as one TP1/PP1 model and
measures each set.
"""
import math
import os
import time


class PerplexityError(ValueError):
    """Bad input; the message names the flag or file."""


def read_token_stream(prefix, max_tokens, flag="--data-path"):
    """The documents of a Megatron indexed dataset concatenated in order (first max_tokens; 0 = all)."""
    import numpy as np

    from megatron_delta.data.indexed import validate_indexed_prefix

    validate_indexed_prefix(prefix, flag)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    parts, n = [], 0
    for i in range(len(ds)):
        doc = np.asarray(ds[i], dtype=np.int64)
        if max_tokens:
            doc = doc[:max_tokens - n]
        parts.append(doc)
        n += len(doc)
        if max_tokens and n >= max_tokens:
            break
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def windows(num_tokens, seq_length):
    """[(start, end)] of consecutive windows of up to seq_length + 1 tokens overlapping by one token:
    window k predicts tokens start+1 .. end-1, so tokens 1 .. num_tokens-1 are each predicted once."""
    out, start = [], 0
    while start + 1 < num_tokens:
        end = min(start + seq_length + 1, num_tokens)
        out.append((start, end))
        start = end - 1
    return out


def stream_nll(logits_fn, stream, seq_length, batch_size, vocab):
    """Summed next-token NLL (float64) and the number of predicted tokens. logits_fn: [b, s] -> [b, s, V>=vocab]."""
    import torch
    import torch.nn.functional as F

    tokens = torch.as_tensor(stream, dtype=torch.long)
    spans = windows(len(tokens), seq_length)
    total, count = 0.0, 0
    i = 0
    while i < len(spans):
        # one batch: windows of one length (only the last window may be shorter)
        length = spans[i][1] - spans[i][0]
        batch = [spans[i]]
        while len(batch) < batch_size and i + len(batch) < len(spans) and \
                spans[i + len(batch)][1] - spans[i + len(batch)][0] == length:
            batch.append(spans[i + len(batch)])
        x = torch.stack([tokens[s:e] for s, e in batch])
        logits = logits_fn(x[:, :-1])[..., :vocab].double()
        total += F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
        i += len(batch)
    return total, count


def datasets_to_measure(opts, rc):
    """[(name, prefix, flag)]: the default held-out sets, or --data-path."""
    if opts.data_path:
        out = []
        for item in opts.data_path:
            name, _, prefix = item.rpartition("=") if "=" in item else (None, "", item)
            out.append((name or os.path.basename(prefix).replace("_text_document", ""), prefix, "--data-path"))
        return out
    if rc.get("tokenizer_type") == "NullTokenizer":
        raise PerplexityError("--load: the checkpoint was trained on mock tokens (NullTokenizer); pass --data-path")
    from megatron_delta.data.corpus import ensure_default_data

    paths = ensure_default_data(opts.cache_dir)
    mine = rc.get("tokenizer_model")
    if not mine or not os.path.isfile(mine) or not _same_file(mine, paths["tokenizer_model"]):
        raise PerplexityError(f"--load: the checkpoint's tokenizer ({mine}) is not the bundled corpus' default "
                              f"tokenizer ({paths['tokenizer_model']}); pass --data-path with data preprocessed "
                              f"by the checkpoint's tokenizer")
    return [("sotu_valid", paths["sotu_valid_data_path"], "default SOTU validation data"),
            ("wiki", paths["heldout_data_path"], "default Wikipedia held-out data")]


def _same_file(a, b):
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def measure_perplexity(opts, log=print) -> dict:
    """The perplexity of checkpoint opts.load on each dataset, as tools/perplexity.py writes it to --output.

    opts carries the tool's flags (load, data_path, max_tokens, seq_length, batch_size, dtype, cache_dir); log
    prints one line on loading and one per dataset. Bad input raises PerplexityError naming the flag or file."""
    import torch.distributed as dist

    from megatron_delta.checkpoint.errors import CheckpointError, ConversionError
    from megatron_delta.checkpoint.reader import open_checkpoint
    from megatron_delta.checkpoint.run_config import true_vocab_size
    from megatron_delta.evaluation.loaders import load_megatron, megatron_logits
    from megatron_delta.platform.distributed import destroy_distributed

    try:
        verify = getattr(opts, "verify_integrity", True)
        ckpt_dir, iteration, rc, _, _ = open_checkpoint(opts.load, verify)  # verified before anything is read
        seq = opts.seq_length or rc.get("seq_length") or rc["max_position_embeddings"]
        if seq > rc["max_position_embeddings"]:
            raise PerplexityError(f"--seq-length {seq} exceeds the checkpoint's --max-position-embeddings "
                                  f"{rc['max_position_embeddings']}")
        sets = datasets_to_measure(opts, rc)
        streams = []
        for name, prefix, flag in sets:
            try:
                streams.append((name, prefix, read_token_stream(prefix, opts.max_tokens, flag)))
            except ValueError as err:
                raise PerplexityError(str(err)) from err
        model, args, rc = load_megatron(opts.load, dtype=opts.dtype, verify_integrity=verify)
        dtype = "bf16" if args.bf16 else "fp32"
        vocab = true_vocab_size(rc)
        result = {"checkpoint": os.path.abspath(ckpt_dir), "iteration": iteration, "residual": rc.get("residual"),
                  "seq_length": seq, "max_tokens": opts.max_tokens, "dtype": dtype, "datasets": {}}
        log(f" loaded {ckpt_dir} (iteration {iteration}, --residual {rc.get('residual')}); windows of {seq} "
            f"tokens of context; computing in {dtype}")
        for name, prefix, stream in streams:
            bad = stream[(stream < 0) | (stream >= vocab)]
            if len(bad):
                raise PerplexityError(f"{prefix}: token ids {bad[:5].tolist()} are outside the checkpoint's "
                                      f"vocabulary [0, {vocab}): preprocess it with the checkpoint's tokenizer")
            t0 = time.time()
            nll, count = stream_nll(lambda x: megatron_logits(model, x), stream, seq, opts.batch_size, vocab)
            if count == 0:
                raise PerplexityError(f"{prefix}: fewer than 2 tokens to evaluate")
            mean = nll / count
            result["datasets"][name] = {"data_path": prefix, "num_tokens": int(len(stream)),
                                        "predicted_tokens": count, "windows": len(windows(len(stream), seq)),
                                        "nll": nll, "mean_nll": mean, "ppl": math.exp(min(mean, 50.0))}
            log(f" [{name}] {count:,} predicted tokens | mean NLL {mean:.4f} | ppl {math.exp(min(mean, 50.0)):.3f}"
                f" | {time.time() - t0:.1f} s")
    except (ConversionError, CheckpointError) as err:
        raise PerplexityError(str(err)) from err
    finally:
        if dist.is_available() and dist.is_initialized():
            destroy_distributed()
    return result
