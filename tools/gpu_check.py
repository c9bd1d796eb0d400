#!/usr/bin/env python
"""The one acceptance run for a GPU (issues 7 and 19): at most 8 minutes on one H100 / H200.

    python tools/gpu_check.py --out runs/gpu_check.json    # one GPU, Transformer Engine and fla-core installed
    python tools/gpu_check.py --dry-run --out /tmp/dry.json  # CPU: everything except CUDA / TE, tiny sizes

Prints a table per part and writes JSON (rewritten after every part: a timeout still leaves results), in order:

(a) parity: every mode built three ways with the SAME weights - Transformer Engine spec, local spec, and
    the local spec with the routers on PyTorch ops instead of fla's fused kernel - BF16 logits compared
    (relative L2 error below --parity-tol). TE-spec names: `input_layernorm.weight` ->
    `self_attention.linear_qkv.layer_norm_weight`, `pre_mlp_layernorm.weight` -> `mlp.linear_fc1.layer_norm_weight`.
(b) router: fla's fused kernel vs the PyTorch router on the same bf16 sources, with and without null
    source, gate and x: the output and every gradient (sources, x, query, key-norm weight, null, gate),
    errors relative to each tensor's scale (--router-tol).
(c) speed and memory: tokens/s and peak memory (torch.cuda.max_memory_allocated) against the baseline, at
    an 8B layer slice (hidden 4096, FFN 12288, 32 heads / 8 groups, seq 2048, as many layers as fit; the
    memory plan picks them) and at the paper's 1B width (Qwen3-1.7B shape), for delta_block and delta, both
    router backends; beside each, tools/memory_plan.py's PREDICTED ratio (router bytes vs GEMM FLOPs on
    this GPU). Targets: delta_block >= 0.95x tokens/s and <= 1.10x peak memory at the 8B slice, delta
    >= 0.85x at 1B (both with the fused kernel).
(d) training: every mode trains --iters iterations in BF16 and FP8 (hybrid; delayed scaling, and current
    scaling - recipe `tensorwise` - where the installed TE has it), TE spec, routers on the fused kernel;
    the loss must be finite and fall.

--dry-run runs all four on CPU at tiny sizes: (a) without the TE spec, (b) in fp32 and bf16, (c) CPU
tokens/s (no peak memory), (d) fp32 without FP8; fla's pure-PyTorch ``naive_attnres`` stands in for the
Triton kernel (megatron_delta.core.fla_router.use_kernel). Without --dry-run and without CUDA, Transformer
Engine or fla it exits at once with status 2 and says why.
"""

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_delta.platform.patches import known_warnings_quieted  # noqa: E402


from megatron_delta.core.modes import (ADDITIVE_MODES, BASELINE, DELTA, DELTA_BLOCK,  # noqa: E402
                                       RESIDUAL_MODES as MODES)

NO_GPU_EXIT = 2
TARGETS = {("8B", DELTA_BLOCK): (0.95, 1.10), ("1B", DELTA): (0.85, None)}

# Local-spec parameter names -> TE-spec names (TE fuses the sublayer input norms into the linears).
FUSED_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}

# (c)'s shapes; the dry run's are tiny stand-ins with the same roles.
SHAPES = {"8B": dict(hidden=4096, ffn=12288, heads=32, groups=8, seq=2048, layers=None),
          "1B": dict(hidden=2048, ffn=6144, heads=16, groups=8, seq=2048, layers=28)}
DRY_SHAPES = {"8B": dict(hidden=64, ffn=192, heads=4, groups=2, seq=32, layers=4),
              "1B": dict(hidden=32, ffn=96, heads=4, groups=2, seq=32, layers=4)}


def local_to_te_name(name: str) -> str:
    """Map one local-spec state-dict key to the TE spec's key (identity for unfused parameters)."""
    for local, te in FUSED_NORM_NAMES.items():
        if name.endswith("." + local):
            return name[: -len(local)] + te
    return name


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, naive_attnres for the kernel")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--vocab-size", type=int, default=None, help="default 32000 (dry run 64)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--speed-iters", type=int, default=None, help="(c): iterations per run (default 12, dry 4)")
    p.add_argument("--warmup", type=int, default=None, help="(c): iterations excluded (default 4, dry 1)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-4 (dry run 3e-3)")
    p.add_argument("--parity-hidden-size", type=int, default=None, help="default 1024 (dry 32)")
    p.add_argument("--parity-seq-length", type=int, default=None, help="default 512 (dry 16)")
    p.add_argument("--parity-tol", type=float, default=2e-2, help="max relative L2 error of BF16 logits")
    p.add_argument("--router-tol", type=float, default=None, help="(b): default 2e-2 in bf16 (fp32: 1e-4)")
    p.add_argument("--num-layers-8b", type=int, default=None, help="(c): default as many as fit (memory plan)")
    p.add_argument("--skip", nargs="*", default=[], choices=["parity", "router", "speed", "train"])
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--time-budget-s", type=float, default=450, help="skip the remaining runs after this")
    o = p.parse_args(argv)
    dry = o.dry_run
    for name, full, small in (("vocab_size", 32000, 64), ("speed_iters", 12, 4), ("warmup", 4, 1),
                              ("lr", 3e-4, 3e-3), ("parity_hidden_size", 1024, 32), ("parity_seq_length", 512, 16)):
        if getattr(o, name) is None:
            setattr(o, name, small if dry else full)
    if o.router_tol is None:
        o.router_tol = 2e-2
    return o


def require_gpu():
    """Exit at once (status 2) with a clear message when this machine cannot run the check."""
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); this check needs one "
              "GPU with Transformer Engine and fla-core (or run --dry-run on CPU). Nothing was run.", file=sys.stderr)
        sys.exit(NO_GPU_EXIT)
    if importlib.util.find_spec("transformer_engine") is None:
        print("gpu_check: Transformer Engine is not installed (use an NGC PyTorch container or "
              "`pip install megatron-delta[te]` on the GPU machine). Nothing was run.", file=sys.stderr)
        sys.exit(NO_GPU_EXIT)
    from megatron_delta.core import fla_router

    if not fla_router.available():
        print("gpu_check: fla-core is not importable (pip install 'megatron-delta[gpu]'). Nothing was run.",
              file=sys.stderr)
        sys.exit(NO_GPU_EXIT)


class Env:
    """What differs between the GPU run and the dry run."""

    def __init__(self, opts):
        import torch

        self.dry = opts.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.impl = "local" if self.dry else "transformer_engine"
        self.shapes = DRY_SHAPES if self.dry else SHAPES
        self.gpu_name = "CPU (dry run)" if self.dry else torch.cuda.get_device_name()

    def sync(self):
        import torch

        if not self.dry:
            torch.cuda.synchronize()

    def reset_peak(self):
        import torch

        if not self.dry:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        import torch

        return None if self.dry else torch.cuda.max_memory_allocated() / 2**30

    def gpu_kind(self):
        """memory_plan.GPUS key for the prediction (H100 where the name says neither)."""
        for k in ("B200", "H200", "H100"):
            if k in self.gpu_name:
                return k
        return "H100"


SEED = 1234
# Adam as in pretrain_gpt.py's default run (tests/flags.py QWEN3); the learning rate is --lr, its floor lr / 10.
ADAM = dict(weight_decay=0.1, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95)


def model_fields(opts, env, mode, *, shape, impl=None, fp8=None):
    """The model fields (megatron_delta.model_config) of one run: ``shape``, the GPU's backend in BF16 (the dry
    run: local, fp32), and FP8 with the recipe ``fp8`` (delayed / tensorwise) when given."""
    s = shape
    fields = dict(residual=mode, transformer_impl=impl or env.impl, vocab_size=opts.vocab_size,
                  num_layers=s["layers"], hidden_size=s["hidden"], ffn_hidden_size=s["ffn"],
                  num_attention_heads=s["heads"], num_query_groups=s["groups"], seq_length=s["seq"],
                  bf16=not env.dry)
    if fp8:
        fields.update(fp8_format="hybrid", fp8_recipe=fp8, fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    return fields


def build(env, fields, kernels="fla"):
    """(resolved fields, config, model chunk on the device); ``kernels``: the routers' backend (fla / torch)."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields

    fields = resolve_model_fields(fields)
    over = {} if fields["residual"] == BASELINE else {"delta_router_kernels": kernels}
    config, options = model_config(fields, use_cpu_initialization=env.dry, **over)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    (chunk,) = build_model_chunks(config, fields["padded_vocab_size"], **options)
    return fields, config, chunk.to(env.device)


def free(env, *objs):
    import torch

    del objs
    gc.collect()
    if not env.dry:
        torch.cuda.empty_cache()
        try:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

            FP8GlobalStateManager.reset()
        except Exception:  # noqa: BLE001  (older/newer TE: nothing to reset)
            pass


def _rel(a, b):
    return ((a - b).float().norm() / b.float().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------- (a)
def parity(opts, env, mode):
    """Relative L2 errors of BF16 logits: TE spec vs local spec, and fused-kernel routers vs PyTorch ops."""
    import torch

    shape = dict(hidden=opts.parity_hidden_size, ffn=3 * opts.parity_hidden_size,
                 heads=max(4, opts.parity_hidden_size // 128), groups=2, seq=opts.parity_seq_length, layers=4)
    models = {"local": build(env, model_fields(opts, env, mode, shape=shape, impl="local"))[2],
              "local-torch-router": build(env, model_fields(opts, env, mode, shape=shape, impl="local"),
                                          kernels="torch")[2]}
    if not env.dry:
        models["te"] = build(env, model_fields(opts, env, mode, shape=shape, impl="transformer_engine"))[2]
    src = models["local"].state_dict()
    for name, m in models.items():
        if name == "local":
            continue
        dst = m.state_dict()
        mapped, unused = {}, []
        for k, v in src.items():
            if k.endswith("_extra_state"):
                continue
            tk = local_to_te_name(k) if name == "te" else k
            if tk in dst and dst[tk].shape == v.shape:
                mapped[tk] = v
            else:
                unused.append(k)
        missing = [k for k in dst if k not in mapped and not k.endswith("_extra_state")]
        if unused or missing:
            raise RuntimeError(f"{mode}: state dicts do not map to {name} (left over {unused}, without a value "
                               f"{missing})")
        m.load_state_dict(mapped, strict=False)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():  # random router parameters, so that routing matters
        for name, p in models["local"].named_parameters():
            if name.endswith(".query"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
        for name, m in models.items():
            if name != "local":
                m.load_state_dict({local_to_te_name(k) if name == "te" else k: v
                                   for k, v in models["local"].state_dict().items()
                                   if not k.endswith("_extra_state")}, strict=False)
    seq = shape["seq"]
    tokens = torch.randint(0, opts.vocab_size, (2, seq), generator=g).to(env.device)
    pos = torch.arange(seq, device=env.device).unsqueeze(0).expand(2, -1)
    logits = {}
    with torch.no_grad():
        for name, m in models.items():
            m.eval()
            logits[name] = m(tokens, pos, None).to(torch.bfloat16).float()
    ref = logits["local"]
    out = {"mode": mode, "rel_l2": {k: _rel(v, ref) for k, v in logits.items() if k != "local"}}
    out["ok"] = all(v < opts.parity_tol for v in out["rel_l2"].values())
    free(env, models, logits)
    return out


# ------------------------------------------------------------------------------------------- (b)
def router_case(opts, env, dtype, null, gate, with_x, n=5):
    """fla's kernel vs the PyTorch router: output and every gradient, relative to each tensor's scale."""
    import torch

    from megatron_delta.core.router import DepthRouter, make_source

    d, t = (256, 1024) if not env.dry else (64, 24)
    g = torch.Generator(device="cpu").manual_seed(5)
    vals = [torch.randn(t, 1, d, generator=g).to(env.device, dtype) * (1 + i) for i in range(n)]
    x = torch.randn(t, 1, d, generator=g).to(env.device, dtype)
    W = torch.randn(t, 1, d, generator=g).to(env.device)
    results = {}
    for kind in ("fla", "torch"):
        r = DepthRouter(d, null_source=null, gate=gate, eps=1e-6, kernels=kind).to(env.device)
        gg = torch.Generator(device="cpu").manual_seed(6)
        with torch.no_grad():
            r.query.copy_(torch.randn(d, generator=gg).to(env.device))
            r.key_norm_weight.copy_(1 + 0.2 * torch.randn(d, generator=gg).to(env.device))
            if null:
                r.null_source.copy_(torch.randn(d, generator=gg).to(env.device))
            if gate:
                r.gate.fill_(0.7)
        vs = [v.clone().requires_grad_() for v in vals]
        xx = x.clone().requires_grad_() if with_x else None
        out = r([make_source(v, 1e-6) for v in vs], base=xx, apply_gate=True)
        (out.float() * W).sum().backward()
        named = {f"s{i}": v.grad for i, v in enumerate(vs)}
        if with_x:
            named["x"] = xx.grad
        named.update({k: p.grad for k, p in r.named_parameters()})
        results[kind] = (out.detach(), named)
    (of, gf), (ot, gt) = results["fla"], results["torch"]
    errs = {"out": _rel(of, ot)}
    errs.update({k: _rel(gf[k], gt[k]) for k in gt})
    tol = opts.router_tol if dtype != torch.float32 else 1e-4
    # the null source's gradient is a sum over tokens of the kernel's per-token gradients, which are in the
    # sources' dtype (bf16): ~1-2 % off the PyTorch path's fp32 sum (docs/gpu.md)
    tols = {k: tol * (3 if k == "null_source" and dtype != torch.float32 else 1) for k in errs}
    return {"dtype": str(dtype).replace("torch.", ""), "null": null, "gate": gate, "x": with_x,
            "max_rel": max(errs.values()), "errors": errs, "ok": all(errs[k] < tols[k] for k in errs)}


# ------------------------------------------------------------------------------------------- (c), (d)
def train(opts, env, mode, *, shape, fp8=None, kernels="fla", iters=None, warmup=0):
    """`iters` iterations with Megatron's DDP + optimizer + forward-backward schedule on a learnable stream."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.core.optimizer import get_standard_config_overrides

    from megatron_delta.trainer.hooks import router_overrides

    free(env)
    env.reset_peak()
    iters = iters or opts.iters
    fields, config, chunk = build(env, model_fields(opts, env, mode, shape=shape, fp8=fp8), kernels=kernels)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), module=chunk)
    lr = dict(lr=opts.lr, min_lr=opts.lr / 10)
    opt_config = OptimizerConfig(optimizer="adam", **lr, **ADAM, bf16=not env.dry, params_dtype=config.params_dtype)
    # the routers' parameter group, as pretrain_gpt.py makes it (--delta-router-lr-mult 1: no weight decay)
    routers = types.SimpleNamespace(residual=mode, delta_router_lr_mult=1.0, **lr)
    optimizer = get_megatron_optimizer(opt_config, [ddp], config_overrides=router_overrides(
        routers, get_standard_config_overrides(opt_config)))
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync

    s, b = fields["seq_length"], 1
    g = torch.Generator(device="cpu").manual_seed(1)
    base = torch.randint(0, opts.vocab_size, (16,), generator=g)  # period 16: the loss must fall fast
    seqs = base.repeat((s + 1) // 16 + 2)[: s + 1].to(env.device)
    batch = {"tokens": seqs[:-1].expand(b, -1), "labels": seqs[1:].expand(b, -1),
             "position_ids": torch.arange(s, device=env.device).expand(b, -1)}

    def step_fn(_, model):
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_fn(o):
            loss = o.float().mean()
            return loss, {"lm loss": loss.detach()}
        return out, loss_fn

    losses, times = [], []
    fb = get_forward_backward_func()
    for _ in range(iters):
        env.sync()
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = fb(forward_step_func=step_fn, data_iterator=iter([None]), model=ddp, num_microbatches=1,
                     seq_length=s, micro_batch_size=b, forward_only=False)
        optimizer.step()
        env.sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(reports[0]["lm loss"]))
    timed = times[warmup:] or times
    out = {"mode": mode, "kernels": kernels if mode != BASELINE else "-", "precision": fp8 and f"fp8-hybrid-{fp8}"
           or ("fp32" if env.dry else "bf16"), "num_layers": fields["num_layers"], "losses": losses,
           "tokens_per_sec": s * b * len(timed) / sum(timed), "peak_mem_gib": env.peak_gib(),
           "ok": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]}
    free(env, ddp, optimizer, chunk)
    return out


def layers_that_fit(env, shape, frac=0.8):
    """(c): the most layers (<= 36) of the 8B slice whose memory plan (delta, the hungriest mode, TE, bf16)
    fits in ``frac`` of this GPU's memory."""
    import torch

    import memory_plan as mp

    total = torch.cuda.get_device_properties(0).total_memory
    best = 1
    for L in range(1, 37):
        a = mp.parse(["--num-layers", str(L), "--hidden-size", str(shape["hidden"]), "--ffn-hidden-size",
                      str(shape["ffn"]), "--num-attention-heads", str(shape["heads"]), "--num-query-groups",
                      str(shape["groups"]), "--seq-length", str(shape["seq"]), "--residual", DELTA, "--bf16",
                      "--transformer-impl", "transformer_engine", "--untie-embeddings-and-output-weights"])
        if mp.memory_plan(a)["stages"][0]["total"] * 1.15 <= frac * total:
            best = L
    return best


def predicted(env, shape_name, mode, kernels, num_layers):
    import memory_plan as mp

    if mode == BASELINE:
        return 1.0
    r = mp.router_share(env.gpu_kind(), shape_name, mode, kernels, num_layers=num_layers)
    return r["tokens_per_sec_ratio"]


# ------------------------------------------------------------------------------------------- main
@known_warnings_quieted()
def main(argv=None):
    opts = parse(argv)
    if not opts.dry_run:
        require_gpu()
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # memory_plan
    import torch


    from megatron_delta.core import fla_router
    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed
    import logging

    logging.getLogger("megatron").setLevel(logging.WARNING)  # DDP / optimizer set-up lines per run
    env = Env(opts)
    injected = None
    if env.dry:
        from fla.ops.attnres import naive_attnres

        injected = fla_router.set_kernel(naive_attnres, devices=("cpu",), name="naive_attnres (dry run)")
    t_start = time.time()
    initialize_distributed(1, 1, seed=1234)
    result = {"device": env.gpu_name, "dry_run": env.dry, "torch": torch.__version__, "opts": vars(opts),
              "router_kernels": fla_router.describe("fla", cuda=not env.dry),
              "parity": [], "router": [], "speed": [], "train": [], "skipped": []}
    print(result["router_kernels"], flush=True)
    try:
        import transformer_engine

        result["transformer_engine"] = getattr(transformer_engine, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        result["transformer_engine"] = f"not available: {type(e).__name__}"

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

    def attempt(part, what, fn, **fields):
        if over_budget(what):
            return None
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001  (report and go on)
            r = dict(fields, ok=False, error=f"{type(e).__name__}: {e}")
            free(env)
        result[part].append(r)
        save()
        return r

    try:
        if "parity" not in opts.skip:
            print("\n(a) parity: relative L2 error of BF16 logits against the local spec (same weights)", flush=True)
            for mode in opts.modes:
                r = attempt("parity", f"parity {mode}", lambda: parity(opts, env, mode), mode=mode)
                if r:
                    print(f"  {mode:13s} {'ok ' if r['ok'] else 'BAD'} "
                          f"{r.get('rel_l2', r.get('error'))}", flush=True)
        if "router" not in opts.skip:
            print("\n(b) router: fused kernel vs PyTorch ops, max relative error over output and every gradient",
                  flush=True)
            dtypes = [torch.float32, torch.bfloat16] if env.dry else [torch.bfloat16]
            for dt in dtypes:
                for null, gate, with_x in [(False, False, False), (False, False, True), (True, False, True),
                                           (False, True, True), (True, True, True), (True, False, False)]:
                    r = attempt("router", f"router {dt} {null} {gate} {with_x}",
                                lambda: router_case(opts, env, dt, null, gate, with_x), dtype=str(dt))
                    if r:
                        print(f"  {r['dtype']:9s} null={null!s:5s} gate={gate!s:5s} x={with_x!s:5s} "
                              f"{'ok ' if r['ok'] else 'BAD'} {r.get('max_rel', float('nan')):.2e}"
                              f"{' ' + r['error'] if 'error' in r else ''}", flush=True)
        if "speed" not in opts.skip:
            print("\n(c) tokens/s and peak memory against the baseline; PREDICTED = tools/memory_plan.py's "
                  f"router-share model on {env.gpu_kind()}", flush=True)
            print(f"  {'shape':5s} {'mode':12s} {'router':6s} {'L':>3s} {'tok/s':>10s} {'x base':>7s} "
                  f"{'PREDICTED':>9s} {'peak GiB':>9s} {'x base':>7s} target", flush=True)
            for shape_name in ("8B", "1B"):
                shape = dict(env.shapes[shape_name])
                if shape["layers"] is None:
                    shape["layers"] = opts.num_layers_8b or layers_that_fit(env, shape)
                # the additive modes (those with targets), each on both router backends
                runs = [(BASELINE, "-")] + [(m, k) for m in ADDITIVE_MODES for k in ("fla", "torch")]
                base = None
                for mode, kern in runs:
                    r = attempt("speed", f"speed {shape_name} {mode} {kern}",
                                lambda: train(opts, env, mode, shape=shape, kernels=kern if kern != "-" else "fla",
                                              iters=opts.speed_iters, warmup=opts.warmup),
                                mode=mode, kernels=kern)
                    if not r:
                        continue
                    r["shape"] = shape_name
                    if mode == BASELINE and "tokens_per_sec" in r:
                        base = r
                    if "tokens_per_sec" not in r or base is None:
                        print(f"  {shape_name:5s} {mode:12s} {kern:6s} {r.get('error', 'no baseline')}", flush=True)
                        continue
                    r["throughput_ratio"] = r["tokens_per_sec"] / base["tokens_per_sec"]
                    r["predicted_ratio"] = predicted(env, shape_name, mode, kern, shape["layers"])
                    r["peak_mem_ratio"] = (None if r["peak_mem_gib"] is None
                                           else r["peak_mem_gib"] / base["peak_mem_gib"])
                    tgt = TARGETS.get((shape_name, mode)) if kern == "fla" else None
                    if tgt and not env.dry:
                        r["target_ok"] = (r["throughput_ratio"] >= tgt[0]
                                          and (tgt[1] is None or r["peak_mem_ratio"] <= tgt[1]))
                    tg = "" if not tgt else f">= {tgt[0]}x tok/s" + (f", <= {tgt[1]}x mem" if tgt[1] else "")
                    if tg and "target_ok" in r:
                        tg += " MET" if r["target_ok"] else " MISSED"
                    mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
                    memr = "-" if r["peak_mem_ratio"] is None else f"{r['peak_mem_ratio']:.3f}"
                    print(f"  {shape_name:5s} {mode:12s} {kern:6s} {r['num_layers']:3d} {r['tokens_per_sec']:10,.0f} "
                          f"{r['throughput_ratio']:7.3f} {r['predicted_ratio']:9.3f} {mem:>9s} {memr:>7s} {tg}",
                          flush=True)
                    save()
        if "train" not in opts.skip:
            precisions = [None]
            if not env.dry and not opts.no_fp8:
                precisions.append("delayed")
                try:
                    from transformer_engine.common import recipe as te_recipe

                    if hasattr(te_recipe, "Float8CurrentScaling"):
                        precisions.append("tensorwise")
                    else:
                        result["skipped"].append("fp8 current scaling: not in this Transformer Engine")
                except Exception as e:  # noqa: BLE001
                    result["skipped"].append(f"fp8 current scaling: {e}")
            print(f"\n(d) training: {opts.iters} iterations per mode, routers on the fused kernel", flush=True)
            for fp8 in precisions:
                for mode in opts.modes:
                    r = attempt("train", f"train {mode} fp8={fp8}",
                                lambda: train(opts, env, mode, shape=dict(env.shapes["1B"], layers=4), fp8=fp8),
                                mode=mode, precision=str(fp8))
                    if r:
                        ls = r.get("losses") or [float("nan")]
                        print(f"  {mode:13s} {r.get('precision', str(fp8)):20s} {'ok ' if r['ok'] else 'BAD'} "
                              f"loss {ls[0]:.3f} -> {ls[-1]:.3f}{' ' + r['error'] if 'error' in r else ''}", flush=True)
        parts = result["parity"] + result["router"] + result["speed"] + result["train"]
        result["ok"] = all(r["ok"] for r in parts) and not result["skipped"]
        result["targets_met"] = all(r.get("target_ok", True) for r in result["speed"])
        result["wall_s"] = time.time() - t_start
        save()
        print(f"\ngpu_check{' --dry-run' if env.dry else ''}: {'PASS' if result['ok'] else 'FAIL'}"
              f"{'' if env.dry else ' (targets ' + ('met' if result['targets_met'] else 'MISSED') + ')'}"
              f" in {result['wall_s']:.0f} s -> {opts.out}")
        return 0 if result["ok"] else 1
    finally:
        if env.dry:
            fla_router.set_kernel(injected.fn if injected else None, *(injected[1:] if injected else ()))
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
