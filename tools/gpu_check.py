#!/usr/bin/env python
"""One prepared GPU check (issue 7): Transformer Engine parity, BF16/FP8 training, throughput and memory.

Run on ONE GPU with Transformer Engine installed (e.g. an NGC PyTorch container):

    python tools/gpu_check.py --out runs/gpu_check.json          # everything, < 8 minutes on an H100/H200
    python tools/gpu_check.py --skip-train                        # only the TE-vs-local logits check

(a) parity: for every residual mode, a model built with the local spec and one built with the TE spec
    get the SAME weights (the local state dict copied across, fused-norm names mapped:
    `input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`,
    `pre_mlp_layernorm.weight` -> `mlp.linear_fc1.layer_norm_weight`); their BF16 logits must agree
    (relative L2 error below --parity-tol).
(b) training: every mode trains --iters iterations in BF16 and in FP8 (hybrid format, delayed
    recipe) on mock data, TE spec; the loss must be finite and fall.
(c) throughput (tokens/s over the iterations after --warmup) and peak memory
    (torch.cuda.max_memory_allocated) of each run, and their ratios to the baseline of the same
    precision, at a 1B-like width (default 4 layers, hidden 4096, FFN 12288, seq 2048, mbs 1).
(d) everything goes to a JSON file, rewritten after each run (a timeout still leaves results).

Without CUDA (or without Transformer Engine) it exits at once with status 2 and says why.
"""

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
import time

MODES = ("baseline", "attnres", "full_attnres", "delta", "delta_block")
NO_GPU_EXIT = 2

# Local-spec parameter names -> TE-spec names (TE fuses the sublayer input norms into the linears).
FUSED_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def local_to_te_name(name: str) -> str:
    """Map one local-spec state-dict key to the TE spec's key (identity for unfused parameters)."""
    for local, te in FUSED_NORM_NAMES.items():
        if name.endswith("." + local):
            return name[: -len(local)] + te
    return name


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check.json")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--ffn-hidden-size", type=int, default=12288)
    p.add_argument("--num-attention-heads", type=int, default=32)
    p.add_argument("--num-query-groups", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="iterations excluded from the throughput")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--parity-hidden-size", type=int, default=1024)
    p.add_argument("--parity-seq-length", type=int, default=512)
    p.add_argument("--parity-tol", type=float, default=2e-2, help="max relative L2 error of BF16 logits")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--time-budget-s", type=float, default=450, help="skip the remaining runs after this")
    return p.parse_args(argv)


def require_gpu():
    """Exit at once (status 2) with a clear message when this machine cannot run the check."""
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); this check needs one "
              "GPU with Transformer Engine. Nothing was run.", file=sys.stderr)
        sys.exit(NO_GPU_EXIT)
    if importlib.util.find_spec("transformer_engine") is None:
        print("gpu_check: Transformer Engine is not installed (use an NGC PyTorch container or "
              "`pip install megatron-delta[te]` on the GPU machine). Nothing was run.", file=sys.stderr)
        sys.exit(NO_GPU_EXIT)


def flags(opts, mode, impl, *, hidden=None, seq=None, fp8=False):
    hidden = hidden or opts.hidden_size
    seq = seq or opts.seq_length
    heads = opts.num_attention_heads if hidden == opts.hidden_size else max(8, hidden // 128)
    groups = min(opts.num_query_groups, heads)
    ffn = opts.ffn_hidden_size if hidden == opts.hidden_size else 3 * hidden
    argv = ["--residual", mode, "--transformer-impl", impl, "--bf16", "--mock-data",
            "--vocab-size", str(opts.vocab_size), "--num-layers", str(opts.num_layers),
            "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads),
            "--num-query-groups", str(groups), "--seq-length", str(seq),
            "--micro-batch-size", str(opts.micro_batch_size), "--train-iters", str(opts.iters),
            "--lr", str(opts.lr), "--min-lr", str(opts.lr / 10), "--lr-warmup-iters", "2"]
    if fp8:
        argv += ["--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                 "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]
    return argv


def build(argv):
    """(args, config, model chunk on the GPU) for one flag set, GPU-initialised."""
    import torch

    from megatron_delta.arguments import parse_args
    from megatron_delta.model import build_model_chunks, padded_vocab_size, transformer_config_from_args

    args = parse_args(argv, world_size=1)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args)
    config = transformer_config_from_args(args, use_cpu_initialization=False)
    torch.manual_seed(args.seed)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    (chunk,) = build_model_chunks(args, config, args.padded_vocab_size)
    return args, config, chunk.cuda()


def free(*objs):
    import torch

    del objs
    gc.collect()
    torch.cuda.empty_cache()
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        FP8GlobalStateManager.reset()
    except Exception:  # older/newer TE: nothing to reset
        pass


def parity(opts, mode):
    """Relative L2 error of the TE model's BF16 logits against the local model's (same weights)."""
    import torch

    seq = opts.parity_seq_length
    _, _, local = build(flags(opts, mode, "local", hidden=opts.parity_hidden_size, seq=seq))
    _, _, te = build(flags(opts, mode, "transformer_engine", hidden=opts.parity_hidden_size, seq=seq))
    src = local.state_dict()
    dst = te.state_dict()
    mapped, unused = {}, []
    for k, v in src.items():
        if k.endswith("_extra_state"):
            continue
        tk = local_to_te_name(k)
        if tk in dst and dst[tk].shape == v.shape:
            mapped[tk] = v
        else:
            unused.append(k)
    missing = [k for k in dst if k not in mapped and not k.endswith("_extra_state")]
    if unused or missing:
        raise RuntimeError(f"{mode}: state dicts do not map (local keys left over {unused}, TE keys without "
                           f"a value {missing})")
    te.load_state_dict(mapped, strict=False)
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, opts.vocab_size, (2, seq), generator=g).cuda()
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(2, -1)
    local.eval(), te.eval()
    with torch.no_grad():
        a = local(tokens, pos, None).float()
        b = te(tokens, pos, None).float()
    rel = ((a - b).norm() / a.norm()).item()
    out = {"mode": mode, "rel_l2": rel, "max_abs": (a - b).abs().max().item(), "ok": rel < opts.parity_tol}
    free(local, te, a, b)
    return out


def train(opts, mode, fp8):
    """Train `--iters` iterations with Megatron's DDP + optimizer + 1F1B-less schedule on mock data."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_delta.training import optimizer_overrides

    free()  # collect what earlier runs left in reference cycles before the peak is measured
    torch.cuda.reset_peak_memory_stats()
    args, config, chunk = build(flags(opts, mode, "transformer_engine", fp8=fp8))
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), module=chunk)
    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                 adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                                 bf16=True, params_dtype=config.params_dtype)
    optimizer = get_megatron_optimizer(opt_config, [ddp], config_overrides=optimizer_overrides(args, opt_config))
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync

    s, b = args.seq_length, args.micro_batch_size
    g = torch.Generator(device="cpu").manual_seed(1)
    # A learnable stream (tokens repeat with period 64), so the loss must fall within a few steps.
    base = torch.randint(0, args.vocab_size, (64,), generator=g)
    seqs = base.repeat((s + 1) // 64 + 2)[: s + 1].cuda()
    batch = {"tokens": seqs[:-1].expand(b, -1), "labels": seqs[1:].expand(b, -1),
             "position_ids": torch.arange(s, device="cuda").expand(b, -1)}

    def step_fn(_, model):
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_fn(o):
            loss = o.float().mean()
            return loss, {"lm loss": loss.detach()}
        return out, loss_fn

    losses, times = [], []
    fb = get_forward_backward_func()
    for it in range(args.train_iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = fb(forward_step_func=step_fn, data_iterator=iter([None]), model=ddp, num_microbatches=1,
                     seq_length=s, micro_batch_size=b, forward_only=False)
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(reports[0]["lm loss"]))
    timed = times[opts.warmup:] or times
    out = {"mode": mode, "precision": "fp8-hybrid-delayed" if fp8 else "bf16",
           "losses": losses, "tokens_per_sec": s * b * len(timed) / sum(timed),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
           "params": sum(p.numel() for p in chunk.parameters()),
           "ok": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]}
    free(ddp, optimizer, chunk)
    return out


def main(argv=None):
    opts = parse(argv)
    require_gpu()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    from megatron_delta.cpu_platform import destroy_distributed, initialize_distributed
    from megatron_delta.training import _quiet_known_warnings

    _quiet_known_warnings()
    t_start = time.time()
    initialize_distributed(1, 1, seed=1234)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "opts": vars(opts),
              "parity": [], "train": [], "skipped": []}
    try:
        import transformer_engine

        result["transformer_engine"] = getattr(transformer_engine, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        result["transformer_engine"] = f"import failed: {e}"

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)

    def over_budget(what):
        if time.time() - t_start > opts.time_budget_s:
            result["skipped"].append(what)
            print(f"gpu_check: time budget spent, skipping {what}", flush=True)
            return True
        return False

    try:
        if not opts.skip_parity:
            for mode in opts.modes:
                if over_budget(f"parity {mode}"):
                    continue
                try:
                    r = parity(opts, mode)
                except Exception as e:  # noqa: BLE001  (report and go on)
                    r = {"mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"}
                result["parity"].append(r)
                print(f"parity {mode:13s} {json.dumps(r)}", flush=True)
                save()
        if not opts.skip_train:
            for fp8 in ([False] if opts.no_fp8 else [False, True]):
                for mode in opts.modes:
                    if over_budget(f"train {mode} fp8={fp8}"):
                        continue
                    try:
                        r = train(opts, mode, fp8)
                    except Exception as e:  # noqa: BLE001
                        r = {"mode": mode, "precision": "fp8-hybrid-delayed" if fp8 else "bf16", "ok": False,
                             "error": f"{type(e).__name__}: {e}"}
                        free()
                    result["train"].append(r)
                    print(f"train {mode:13s} {r['precision']:18s} ok={r['ok']} "
                          f"tok/s={r.get('tokens_per_sec', float('nan')):,.0f} "
                          f"peak={r.get('peak_mem_gib', float('nan')):.2f} GiB "
                          f"loss {r.get('losses', [float('nan')])[0]:.3f}->{r.get('losses', [float('nan')])[-1]:.3f}"
                          f"{' ' + r['error'] if 'error' in r else ''}", flush=True)
                    save()
        # Ratios to the baseline of the same precision.
        base = {r["precision"]: r for r in result["train"] if r["mode"] == "baseline" and "tokens_per_sec" in r}
        print(f"\n{'mode':13s} {'precision':18s} {'tok/s':>10s} {'x base':>7s} {'peak GiB':>9s} {'x base':>7s}")
        for r in result["train"]:
            b0 = base.get(r["precision"])
            if "tokens_per_sec" not in r or b0 is None:
                continue
            r["throughput_ratio"] = r["tokens_per_sec"] / b0["tokens_per_sec"]
            r["peak_mem_ratio"] = r["peak_mem_gib"] / b0["peak_mem_gib"]
            print(f"{r['mode']:13s} {r['precision']:18s} {r['tokens_per_sec']:10,.0f} {r['throughput_ratio']:7.3f} "
                  f"{r['peak_mem_gib']:9.2f} {r['peak_mem_ratio']:7.3f}")
        result["ok"] = all(r["ok"] for r in result["parity"] + result["train"]) and not result["skipped"]
        result["wall_s"] = time.time() - t_start
        save()
        print(f"\ngpu_check: {'PASS' if result['ok'] else 'FAIL'} in {result['wall_s']:.0f} s -> {opts.out}")
        return 0 if result["ok"] else 1
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
