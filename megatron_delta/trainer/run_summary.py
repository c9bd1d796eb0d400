"""One training run with its measurements (tools/compare_runs.py train): pretrain_gpt.py's main in this process,
then RUN_DIR/summary.json with what the metrics file lacks: residual mode, blocks, parameters (counted on the
built model), added router parameters, the most sources any router reads, the process's peak RSS
(resource.getrusage; includes Python + torch, about the same for every mode, so ratios understate activation
differences at tiny sizes) and wall time. megatron_delta.evaluation.run_comparison reads it.
"""
import json
import os
import resource
import time

from megatron_delta.core.modes import BASELINE, BLOCK_MODES


def train_with_summary(run_dir, flags):
    """Train with pretrain_gpt.py ``flags`` (adding ``--delta-metrics-file RUN_DIR/metrics.jsonl`` unless given;
    an old metrics file is removed, not appended to) and write RUN_DIR/summary.json. Returns the trainer's exit
    status."""
    from megatron_delta.trainer import main as trainer

    os.makedirs(run_dir, exist_ok=True)
    if "--delta-metrics-file" not in flags:
        flags = flags + ["--delta-metrics-file", os.path.join(run_dir, "metrics.jsonl")]
    metrics = flags[flags.index("--delta-metrics-file") + 1]
    if os.path.exists(metrics):
        os.remove(metrics)  # a fresh run, not appended to an old one
    t0 = time.time()
    rc = trainer.main(flags)
    wall = time.time() - t0
    if rc:
        return rc
    model = trainer.LAST_RUN.model  # the model pretrain_gpt.py built: count its parameters
    captured = {"parameters": sum(p.numel() for m in model for p in m.parameters()),
                "router_parameters": sum(p.numel() for m in model for p in m.parameters()
                                         if getattr(p, "is_delta_router", False)),
                "args": trainer.LAST_RUN.args}
    args = captured["args"]
    max_sources = 0
    if args.residual != BASELINE:
        from megatron_delta.core.sources import SourcePlan

        max_sources = SourcePlan.from_config(args).max_sources() + int(bool(args.delta_null_source))
    summary = {
        "residual": args.residual,
        "delta_num_blocks": args.delta_num_blocks if args.residual in BLOCK_MODES else None,
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "seq_length": args.seq_length,
        "global_batch_size": args.global_batch_size, "train_iters": args.train_iters, "seed": args.seed,
        "parameters": captured["parameters"], "router_parameters": captured["router_parameters"],
        "max_sources": max_sources,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": wall, "flags": flags,
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0
