"""Where each sublayer routes: the routing diagnostics of a trained checkpoint on held-out text, as
tools/routing_report.py writes them (routing.json, the receiver x source matrix and the per-receiver curves).

The checkpoint, saved under any TP/PP/VPP layout, is read into one process (TP1/PP1: dist_checkpointing reshards)
computing as trained or in the --dtype asked for (run_from_run_config); each dataset (datasets_to_report) runs
through it with routing recording on; each receiver's weights are named by the sources it reads
(source_columns) and aligned into one receiver x source matrix (aligned_matrix), drawn by plot_matrix and
plot_curves.
"""
import json
import os
import re


def run_from_run_config(cfg, opts, where):
    """(model fields, run): the checkpoint's model in a TP1/PP1 layout (megatron_delta.checkpoint.model_config) reading
    sequences of --seq-length (default: the checkpoint's) tokens, and the run the forward passes and
    checkpoint/store.py load_checkpoint reads (batch sizes, tokenizer, seed; the model fields as attributes).
    A checkpoint whose tokenizer cannot be used raises ConversionError naming the flag to pass."""
    from megatron_delta.checkpoint.errors import ConversionError
    from megatron_delta.checkpoint.run_config import checkpoint_args, model_fields
    from megatron_delta.evaluation.precision import eval_in_bf16

    seq = opts.seq_length or cfg.get("seq_length") or cfg.get("max_position_embeddings")
    fields = model_fields(cfg, where, seq_length=seq, bf16=eval_in_bf16(cfg, opts.dtype))
    tok_type, vocab = cfg.get("tokenizer_type"), cfg.get("vocab_size")
    if opts.mock_data:
        tokenizer = dict(tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_size=vocab or 1024)
    else:
        if tok_type == "NullTokenizer":
            raise ConversionError("the checkpoint was trained with NullTokenizer (mock tokens); pass --mock-data")
        model = opts.tokenizer_model or cfg.get("tokenizer_model")
        if not model:
            raise ConversionError(f"{where} records no tokenizer model (run_config.json tokenizer_model); pass "
                                  f"--tokenizer-model")
        tokenizer = dict(tokenizer_type=tok_type or "SentencePieceTokenizer", tokenizer_model=model, vocab_size=vocab)
    run = checkpoint_args(fields, micro_batch_size=opts.micro_batch_size, global_batch_size=opts.micro_batch_size,
                          seed=cfg.get("seed") or 1234, **tokenizer)
    return fields, run


def datasets_to_report(opts, args, tokenizer):
    """[(name, dataset)] to run through the model."""
    from megatron_delta.data.corpus import ensure_default_data
    from megatron_delta.data.datasets import build_gpt_datasets

    n = opts.num_batches * args.global_batch_size

    def build(prefixes, mock=False):
        ds, _, _ = build_gpt_datasets(prefixes, "100,0,0", args.seq_length, args.seed, (n, 0, 0), tokenizer,
                                      mock=mock)
        return ds

    if opts.mock_data:
        return [("mock", build(None, mock=True))]
    if opts.data_path:
        return [("data", build(opts.data_path))]
    paths = ensure_default_data(opts.cache_dir)
    return [("valid", build([paths["sotu_valid_data_path"]])), ("heldout", build([paths["heldout_data_path"]]))]


def source_columns(plan, stats, null_source):
    """Column names of the receiver x source matrix (first appearance order) and, per receiver,
    the names of the sources its weights refer to."""
    from megatron_delta.core.modes import FULL_ATTNRES
    from megatron_delta.core.mtp import mtp_source_names

    names_of = {}
    for key in stats["order"]:
        mtp = _mtp_receiver(key)
        if mtp:
            names = mtp_source_names(*mtp, plan.final_reads(), every_output_is_source=plan.mode == FULL_ATTNRES)
        else:
            names = plan.final_reads() if key == "final" else plan.reads(int(key))
        names_of[key] = list(names) + (["null"] if null_source else [])
        if len(names_of[key]) != stats["receivers"][key]["num_sources"]:  # defensive: unnamed columns
            names_of[key] = [f"s{i}" for i in range(stats["receivers"][key]["num_sources"])]
    columns = []
    for key in stats["order"]:
        for n in names_of[key]:
            if n not in columns and n != "null":
                columns.append(n)
    if null_source:
        columns.append("null")
    return columns, names_of


def aligned_matrix(stats, columns, names_of):
    """Rows = receivers, columns = named sources; None where the receiver does not see it."""
    rows = []
    for key in stats["order"]:
        row = [None] * len(columns)
        for name, w in zip(names_of[key], stats["receivers"][key]["mean_weights"]):
            row[columns.index(name)] = w
        rows.append(row)
    return rows


def _mtp_receiver(key):
    """(depth, router) of an MTP depth's receiver key (core.mtp.mtp_receiver), else None."""
    m = re.match(r"^mtp(\d+)\.(attn|mlp|final)$", key)
    return (int(m.group(1)), m.group(2)) if m else None


def receiver_label(key):
    if key == "final":
        return "final"
    mtp = _mtp_receiver(key)
    if mtp:
        return f"MTP depth {mtp[0]} {mtp[1]}"
    j = int(key)
    return f"{j // 2}.{'attn' if j % 2 == 0 else 'mlp'}"


def plot_matrix(path, title, rows, columns, receivers):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.ma.masked_invalid(np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=float))
    h = max(3.0, 0.25 * len(rows) + 1.5)
    w = max(4.0, 0.3 * len(columns) + 2.5)
    fig, ax = plt.subplots(figsize=(w, h))
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("white")
    im = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=max(float(data.max()) if data.count() else 1.0, 1e-6),
                   aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels(columns, rotation=90, fontsize=7)
    ax.set_yticks(range(len(receivers)))
    ax.set_yticklabels([receiver_label(k) for k in receivers], fontsize=7)
    ax.set_xlabel("source")
    ax.set_ylabel("receiving sublayer (layer.sublayer)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="mean routing weight")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(path, title, stats):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = stats["order"]
    xs = list(range(len(keys)))
    rec = [stats["receivers"][k] for k in keys]
    maxw = [r["max_weight"] if r["max_weight"] is not None else float("nan") for r in rec]
    uniform = [1.0 / r["num_sources"] if r["num_sources"] else float("nan") for r in rec]
    ent = [r["entropy"] if r["entropy"] is not None else float("nan") for r in rec]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(6.0, 0.25 * len(keys) + 2), 6), sharex=True)
    a1.plot(xs, maxw, "o-", label="mean max weight")
    a1.step(xs, uniform, "--", where="mid", color="gray", label="uniform routing (1/N)")
    a1.set_ylabel("max weight")
    a1.set_ylim(0, 1.05)
    a1.legend(fontsize=8)
    a1.set_title(title, fontsize=9)
    a2.plot(xs, ent, "o-", color="C1", label="mean H(alpha)/log N")
    a2.axhline(1.0, ls="--", color="gray", label="uniform routing")
    a2.set_ylabel("normalised entropy")
    a2.set_ylim(0, 1.05)
    a2.legend(fontsize=8)
    a2.set_xticks(xs)
    a2.set_xticklabels([receiver_label(k) for k in keys], rotation=90, fontsize=7)
    a2.set_xlabel("receiving sublayer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def annotate(stats, plan, null_source):
    """Name each receiver's sources, give its uniform max weight (1/N) and add the aligned receiver x source
    matrix (stats["columns"], stats["aligned_matrix"]) to RoutingStatsAccumulator.to_dict() statistics."""
    columns, names_of = source_columns(plan, stats, null_source)
    for key in stats["order"]:
        stats["receivers"][key]["source_names"] = names_of[key]
        n = stats["receivers"][key]["num_sources"]
        stats["receivers"][key]["uniform_max_weight"] = 1.0 / n if n else None
    stats["columns"] = columns
    stats["aligned_matrix"] = aligned_matrix(stats, columns, names_of)
    return stats


def write_routing_report(ckpt_dir, iteration, cfg, fields, args, opts, collect, log=print):
    """Load the checkpoint, run each dataset through it and write routing.json and the PNGs under opts.output;
    returns the report (routing.json's content).

    collect(args, model, dataset, num_batches) -> {"stats", "text"} runs the forward passes: the trainer's
    megatron_delta.trainer.forward_pass.collect_routing_stats (Megatron's schedule with the trainer's loss),
    passed in because evaluation/ sits below trainer/. log prints the loaded checkpoint and each dataset's table."""
    from megatron_delta.checkpoint.model_config import model_config
    from megatron_delta.checkpoint.store import load_checkpoint
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.core.sources import SourcePlan
    from megatron_delta.data.tokenizers import build_tokenizer
    from megatron_delta.evaluation.loaders import as_trained
    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed

    initialize_distributed(1, 1, seed=args.seed)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        config, options = model_config(fields)
        model = as_trained(build_model_chunks(config, fields["padded_vocab_size"], **options), config, fields["bf16"])
        load_checkpoint(ckpt_dir, model, None, None, args, load_optim=False, load_rng=False,
                        verify_integrity=getattr(opts, "verify_integrity", True))
        log(f" loaded {ckpt_dir} (iteration {iteration}, --residual {args.residual}, saved with TP"
            f"{cfg.get('tensor_model_parallel_size')} PP{cfg.get('pipeline_model_parallel_size')}"
            f" VPP{cfg.get('virtual_pipeline_model_parallel_size')}; read as TP1 PP1, computing in "
            f"{'bf16' if fields['bf16'] else 'fp32'})")
        plan = SourcePlan.from_config(config)
        report = {"checkpoint": os.path.abspath(ckpt_dir), "iteration": iteration, "residual": args.residual,
                  "num_layers": args.num_layers, "delta_num_blocks": args.delta_num_blocks,
                  "delta_sources": args.delta_sources, "delta_null_source": bool(args.delta_null_source),
                  "dtype": "bf16" if fields["bf16"] else "fp32",
                  "seq_length": args.seq_length, "tokens_per_dataset": opts.num_batches * args.global_batch_size
                  * args.seq_length, "datasets": {}}
        os.makedirs(opts.output, exist_ok=True)
        for name, ds in datasets_to_report(opts, args, tokenizer):
            res = collect(args, model, ds, num_batches=opts.num_batches)
            stats = annotate(res["stats"], plan, bool(args.delta_null_source))
            report["datasets"][name] = stats
            title = f"{args.residual} (iteration {iteration}), {name}"
            plot_matrix(os.path.join(opts.output, f"routing_matrix_{name}.png"), title,
                        stats["aligned_matrix"], stats["columns"], stats["order"])
            plot_curves(os.path.join(opts.output, f"routing_curves_{name}.png"), title, stats)
            log(f"\n[{name}]\n{res['text']}")
        with open(os.path.join(opts.output, "routing.json"), "w") as f:
            json.dump(report, f, indent=1)
    finally:
        destroy_distributed()
    return report
