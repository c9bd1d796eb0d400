"""The GPU acceptance checks of tools/gpu_check.py, each a function of (opts, env): (a) parity, (b) router_case,
(c) and (d) train (tokens/s, peak memory, losses) with compare_speed setting the cost model's prediction beside
the measurement. Env says what differs between a GPU run and the CPU dry run, check_session sets the
one-process world up (the dry run: fla's naive_attnres standing in for the Triton kernel) and CheckRun keeps
the results: the JSON rewritten after every run, the time budget, a failed run recorded and the rest run on.
opts: tools/gpu_check.py's flags. torch, Megatron and Transformer Engine are imported inside the functions, so
that the tool refuses a machine without CUDA at once."""
import contextlib
import gc
import importlib.util
import json
import math
import os
import time
import types

from megatron_delta.core.modes import ADDITIVE_MODES, BASELINE, BLOCK_MODES, DELTA, DELTA_BLOCK
from megatron_delta.perf import cost_model, memory_model
from megatron_delta.perf.shapes import SHAPES as MODEL_SHAPES

NO_GPU_EXIT = 2
TARGETS = {("8B", DELTA_BLOCK): (0.95, 1.10), ("1B", DELTA): (0.85, None)}
# K of every block-mode run, passed explicitly: the targets are the paper's K = 4, so every layer count here
# (the 8B slice's, the 1B shape's 28, the parity and training models' 4) is a multiple of it.
NUM_BLOCKS = 4
# (c)'s tokens/s targets where they are set per GPU (the router at the memory floor: delta_block at the 8B shape,
# delta at 1B); other GPUs take TARGETS'.
GPU_TOKENS_TARGETS = {"H100": {("8B", DELTA_BLOCK): 0.95, ("1B", DELTA): 0.83},
                      "H200": {("8B", DELTA_BLOCK): 0.96, ("1B", DELTA): 0.87}}


def target(gpu, shape_name, mode):
    """(c)'s target of a run with a fused kernel on ``gpu`` (cost_model.GPUS key): (tokens/s ratio at full depth,
    peak memory ratio or None), or None where the run has none."""
    t = TARGETS.get((shape_name, mode))
    if t is None:
        return None
    return GPU_TOKENS_TARGETS.get(gpu, {}).get((shape_name, mode), t[0]), t[1]


# Local-spec parameter names -> TE-spec names (TE fuses the sublayer input norms into the linears).
FUSED_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}

# (c)'s shapes (perf.shapes; the 8B slice takes as many layers as fit, a multiple of NUM_BLOCKS, unless
# --num-layers-8b); the dry run's
# are tiny stand-ins with the same roles.
SHAPES = {name: dict(hidden=s["hidden_size"], ffn=s["ffn_hidden_size"], heads=s["num_attention_heads"],
                     groups=s["num_query_groups"], seq=s["seq_length"],
                     layers=None if name == "8B" else s["num_layers"])
          for name, s in ((n, MODEL_SHAPES[n]) for n in ("8B", "1B"))}
DRY_SHAPES = {"8B": dict(hidden=64, ffn=192, heads=4, groups=2, seq=32, layers=4),
              "1B": dict(hidden=32, ffn=96, heads=4, groups=2, seq=32, layers=4)}
# (b): (null source, gate, x) of each router case.
ROUTER_CASES = [(False, False, False), (False, False, True), (True, False, True), (False, True, True),
                (True, True, True), (True, False, False)]
SPEED_MICRO_BATCHES = 8  # (c): micro-batches per timed step (a training step's forward + backward, not one)


def speed_runs(env, shape_name=None, routers=("fla", "triton", "torch")):
    """(c): (mode, router backend, group size) of each run at a shape: the baseline, then the additive modes
    (those with targets; the shape's target mode first, so that a run cut short by --time-budget-s has measured
    it) on every GPU router backend this checkout has (--delta-router-kernels: fla, triton where present, torch;
    the dry run takes triton only under TRITON_INTERPRET=1, the Triton interpreter). delta runs with
    --delta-router-group-size 1 (one router per pass, what the cost model prices for torch and fla) and, on
    triton, also with ``auto`` (the group router on its Triton kernels); the group size is None (not applicable)
    for the other modes. ``routers``: the backends to time (--speed-routers)."""
    from megatron_delta.core.group_plan import AUTO, FINE_GRAINED_MODES

    backends = [k for k in ("fla", "triton", "torch") if k in routers and k in (*router_kernels(env), "torch")]
    runs = [(BASELINE, "-", None)]
    for m in sorted(ADDITIVE_MODES, key=lambda m: (shape_name, m) not in TARGETS):
        for k in backends:
            if m not in FINE_GRAINED_MODES:
                runs.append((m, k, None))
            else:
                runs += [(m, k, AUTO)] if k == "triton" else []
                runs.append((m, k, 1))
    return runs


def speed_precisions(opts, env):
    """(c)'s precisions: BF16 (None), and FP8 (hybrid, delayed scaling) where Transformer Engine has FP8 (not in
    the dry run, not with --no-fp8)."""
    if env.impl != "transformer_engine" or opts.no_fp8:
        return [None]
    try:
        from transformer_engine.pytorch import fp8 as te_fp8

        ok, _ = te_fp8.check_fp8_support()
    except Exception:  # noqa: BLE001  (an older TE without the check, or none)
        ok = False
    return [None, "delayed"] if ok else [None]


def local_to_te_name(name: str) -> str:
    """Map one local-spec state-dict key to the TE spec's key (identity for unfused parameters)."""
    for local, te in FUSED_NORM_NAMES.items():
        if name.endswith("." + local):
            return name[: -len(local)] + te
    return name


def transformer_engine_installed() -> bool:
    """Whether Transformer Engine is installed here (found, not imported: its import fails without CUDA)."""
    return importlib.util.find_spec("transformer_engine") is not None


def missing_requirement(transformer_impl="transformer_engine"):
    """Why this machine cannot run the GPU check with ``transformer_impl`` (--transformer-impl; a sentence ending
    "Nothing was run."), or None. ``local`` needs no Transformer Engine."""
    import torch

    if not torch.cuda.is_available():
        return ("no CUDA device visible (torch.cuda.is_available() is False); this check needs one "
                "GPU with Transformer Engine and fla-core (or run --dry-run on CPU). Nothing was run.")
    if transformer_impl == "transformer_engine" and not transformer_engine_installed():
        return ("Transformer Engine is not installed (use an NGC PyTorch container or "
                "`pip install megatron-delta[te]` on the GPU machine; or run --transformer-impl local, which checks "
                "the routers on Megatron's local layers, without FP8 or the MoE fusions). Nothing was run.")
    from megatron_delta.core import fla_router

    if not fla_router.available():
        return "fla-core is not importable (pip install 'megatron-delta[gpu]'). Nothing was run."
    return None


class Env:
    """What differs between the GPU run and the dry run."""

    def __init__(self, opts):
        import torch

        self.dry = opts.dry_run
        self.device = "cpu" if self.dry else "cuda"
        # the GPU run's layers: Transformer Engine's, or Megatron's local ones (--transformer-impl local: no TE here)
        self.impl = "local" if self.dry else opts.transformer_impl
        self.shapes = DRY_SHAPES if self.dry else SHAPES
        self.gpu_name = "CPU (dry run)" if self.dry else torch.cuda.get_device_name()

    def sync(self):
        import torch

        if not self.dry:
            torch.cuda.synchronize()

    def reset_peak(self):
        """Starts a run's peak memory; returns the GiB still allocated from before (None in the dry run): the first
        H200 run's peaks carried about 15 GiB from earlier runs into later ones (docs/gpu.md), so a run's own peak is
        counted above what it found allocated."""
        import torch

        if self.dry:
            return None
        torch.cuda.reset_peak_memory_stats()
        self.resident = torch.cuda.memory_allocated()
        return self.resident / 2**30

    def peak_gib(self):
        """The GiB the run allocated at its peak, above what was allocated when it started (reset_peak)."""
        import torch

        return None if self.dry else (torch.cuda.max_memory_allocated() - self.resident) / 2**30

    def gpu_kind(self):
        """cost_model.GPUS key for the prediction (H100 where the name says neither)."""
        for k in ("B200", "H200", "H100"):
            if k in self.gpu_name:
                return k
        return "H100"


SEED = 1234
# Adam as in pretrain_gpt.py's default run (tests/helpers/flags.py QWEN3); the learning rate is --lr, its floor lr / 10.
ADAM = dict(weight_decay=0.1, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95)


def model_fields(opts, env, mode, *, shape, impl=None, fp8=None):
    """The model fields (megatron_delta.checkpoint.model_config) of one run: ``shape``, the GPU's backend in BF16 (the
    dry run: local, fp32), and FP8 with the recipe ``fp8`` (delayed / tensorwise) when given."""
    s = shape
    fields = dict(residual=mode, transformer_impl=impl or env.impl, vocab_size=opts.vocab_size,
                  num_layers=s["layers"], hidden_size=s["hidden"], ffn_hidden_size=s["ffn"],
                  num_attention_heads=s["heads"], num_query_groups=s["groups"], seq_length=s["seq"],
                  bf16=not env.dry)
    if mode in BLOCK_MODES:
        fields["delta_num_blocks"] = NUM_BLOCKS
    if fp8:
        fields.update(fp8_format="hybrid", fp8_recipe=fp8, fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    return fields


def build(env, fields, kernels="fla", group_size=None, **config_overrides):
    """(resolved fields, config, model chunk on the device); ``kernels``: the routers' backend (fla / triton /
    torch); ``group_size``: delta's / full_attnres' --delta-router-group-size (None: the default);
    ``config_overrides``: DeltaTransformerConfig fields set directly (the MoE fusions of (e))."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields
    from megatron_delta.core.model import build_model_chunks

    fields = resolve_model_fields(fields)
    over = {} if fields["residual"] == BASELINE else {"delta_router_kernels": kernels}
    if group_size is not None:
        over["delta_router_group_size"] = group_size
    config, options = model_config(fields, use_cpu_initialization=env.dry, **over, **config_overrides)
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
PARITY_REFERENCE = "fp32"  # (a)'s reference: the local spec in fp32, routers on PyTorch ops, the same weights
PARITY_SLACK = 1.5  # (a): how much further from the reference than the PyTorch path's bf16 logits a backend may be


def parity(opts, env, mode):
    """(a): every backend's BF16 logits against the same model in fp32 (local spec, routers on PyTorch ops, the
    same weights): the local spec with fla's kernel, on PyTorch ops and on our Triton kernels (delta: the group
    router), and the TE spec where the run has it. A backend passes when its relative L2 error is below
    --parity-tol or at most PARITY_SLACK times the PyTorch path's own: with sharp routing (random queries) bf16
    rounding alone moves the attention-residual modes' logits by a few per cent (docs/gpu.md), which a comparison
    of one bf16 backend with another cannot attribute."""
    import torch


    shape = dict(hidden=opts.parity_hidden_size, ffn=3 * opts.parity_hidden_size,
                 heads=max(4, opts.parity_hidden_size // 128), groups=2, seq=opts.parity_seq_length, layers=4)
    local = model_fields(opts, env, mode, shape=shape, impl="local")
    models = {"local-fla-router": build(env, local)[2], "local-torch-router": build(env, local, kernels="torch")[2]}
    if "triton" in router_kernels(env):
        models["local-triton-router"] = build(env, local, kernels="triton")[2]
    if env.impl == "transformer_engine":
        models["te"] = build(env, model_fields(opts, env, mode, shape=shape, impl="transformer_engine"))[2]
    models[PARITY_REFERENCE] = build(env, dict(local, bf16=False), kernels="torch")[2]
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():  # random router queries, so that routing matters
        for name, p in models["local-fla-router"].named_parameters():
            if name.endswith(".query"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    src = models["local-fla-router"].state_dict()
    for name, m in models.items():
        if name == "local-fla-router":
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
    seq = shape["seq"]
    tokens = torch.randint(0, opts.vocab_size, (2, seq), generator=g).to(env.device)
    pos = torch.arange(seq, device=env.device).unsqueeze(0).expand(2, -1)
    logits = {}
    with torch.no_grad():
        for name, m in models.items():
            m.eval()
            logits[name] = m(tokens, pos, None).float()
    ref = logits.pop(PARITY_REFERENCE)
    errors = {k: _rel(v, ref) for k, v in logits.items()}
    limit = max(opts.parity_tol, PARITY_SLACK * errors["local-torch-router"])
    out = {"mode": mode, "reference": PARITY_REFERENCE, "rel_l2": errors, "limit": limit,
           "ok": all(v <= limit for v in errors.values())}
    free(env, models, logits)
    return out


# ------------------------------------------------------------------------------------------- (b)
@contextlib.contextmanager
def counting_syncs(env):
    """Counts the CUDA stream synchronisations the block makes (torch.cuda.set_sync_debug_mode's warnings): yields
    a one-element list that holds the count on exit (0 in the dry run: no CUDA)."""
    import warnings

    import torch

    count = [0]
    if env.dry:
        yield count
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    count[0] = sum("synchronizing CUDA operation" in str(w.message) for w in caught)


def router_kernels(env):
    """(b)'s fused kernels: fla's, and our Triton kernels where this checkout has them (the dry run: under the
    Triton interpreter only)."""
    from megatron_delta.core.router import KERNEL_CHOICES

    return ["fla"] + (["triton"] if "triton" in KERNEL_CHOICES
                      and (not env.dry or os.environ.get("TRITON_INTERPRET") == "1") else [])


def router_case(opts, env, dtype, null, gate, with_x, n=5, kernel="fla"):
    """A fused kernel (``kernel``: fla / triton) vs the PyTorch router: output and every gradient, relative to each
    tensor's scale."""
    import torch

    from megatron_delta.core.router import DepthRouter, make_source

    d, t = (256, 1024) if not env.dry else (64, 24)
    g = torch.Generator(device="cpu").manual_seed(5)
    vals = [torch.randn(t, 1, d, generator=g).to(env.device, dtype) * (1 + i) for i in range(n)]
    x = torch.randn(t, 1, d, generator=g).to(env.device, dtype)
    W = torch.randn(t, 1, d, generator=g).to(env.device)
    results = {}
    for kind in (kernel, "torch"):
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
        env.sync()
        with counting_syncs(env) as syncs:
            out = r([make_source(v, 1e-6) for v in vs], base=xx, apply_gate=True)
            (out.float() * W).sum().backward()
        if kind == kernel:
            kernel_syncs = syncs[0]
        named = {f"s{i}": v.grad for i, v in enumerate(vs)}
        if with_x:
            named["x"] = xx.grad
        named.update({k: p.grad for k, p in r.named_parameters()})
        results[kind] = (out.detach(), named)
    (of, gf), (ot, gt) = results[kernel], results["torch"]
    errs = {"out": _rel(of, ot)}
    errs.update({k: _rel(gf[k], gt[k]) for k in gt})
    tol = opts.router_tol if dtype != torch.float32 else 1e-4
    # the null source's gradient is a sum over tokens of the kernel's per-token gradients, which are in the
    # sources' dtype (bf16): ~1-2 % off the PyTorch path's fp32 sum (docs/gpu.md)
    tols = {k: tol * (3 if k == "null_source" and dtype != torch.float32 else 1) for k in errs}
    # our kernels must not wait for the GPU (triton_router.device_tables); fla's count is reported only
    return {"kernel": kernel, "dtype": str(dtype).replace("torch.", ""), "null": null, "gate": gate, "x": with_x,
            "max_rel": max(errs.values()), "errors": errs, "syncs": kernel_syncs,
            "ok": all(errs[k] < tols[k] for k in errs) and (kernel != "triton" or kernel_syncs == 0)}


# ------------------------------------------------------------------------------------------- (b2)
BANDWIDTH_SOURCES = (5, 17)  # (b2): sources per router call (delta_block's K + 1 at K = 4; a deep delta router)


def copy_bandwidth(env, nbytes=1 << 30, reps=10):
    """This machine's device-to-device copy rate in GB/s (bytes read + written), the ceiling (b2) sets each
    router kernel's rate against (the dry run: a CPU copy of 64 MiB)."""
    import torch

    n = (nbytes if not env.dry else 1 << 26) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=env.device)
    b = torch.empty_like(a)
    b.copy_(a)
    seconds = _timed(env, lambda: b.copy_(a), reps)
    out = 2 * 2 * n / seconds / 1e9
    free(env, a, b)
    return out


def _timed(env, fn, reps):
    """Seconds per call of fn() over ``reps`` calls after one more (CUDA events on a GPU, wall clock in the dry
    run)."""
    import torch

    fn()
    if env.dry:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _rate(env, call, row_numel, reps, copy_gbps):
    """(b2): one call()'s counted bytes (core.traffic: the tensors of ``row_numel`` elements or more its kernels
    read and write, and the Triton kernels' per-program partial sums, smaller but priced by the cost model too:
    partial_bytes) over its time (_timed): ms, bytes, partial_bytes, gbps, of_copy (the share of the copy rate)."""
    from megatron_delta.core import traffic, triton_router

    with traffic.counting() as count:
        call()
    partial = sum(rd + wr for (kernel, _), (rd, wr) in count.bytes().items() if kernel == triton_router.REDUCE_KERNEL)
    moved = partial + sum(rd + wr for (kernel, _), (rd, wr) in count.bytes(row_numel).items()
                          if kernel != triton_router.REDUCE_KERNEL)
    seconds = _timed(env, call, reps)
    gbps = moved / seconds / 1e9
    return {"ms": 1e3 * seconds, "bytes": moved, "partial_bytes": partial, "gbps": gbps, "of_copy": gbps / copy_gbps,
            "ok": True}


def kernel_bandwidth(opts, env, kernel, shape_name, n_sources, copy_gbps, reps=20):
    """(b2): one router call's forward + backward on ``kernel`` (torch / fla / triton): ``n_sources`` bf16 sources
    of [seq, 1, hidden] at the shape's width (the dry run: fp32, tiny), x added (delta's u = x + r). Its time per
    call, its counted bytes (core.traffic: every tensor of [tokens, hidden] or more that its kernels read or
    write), so its rate in GB/s and that rate's share of the copy bandwidth: near 1, the call moves its bytes as
    fast as a copy does; the cost model assumes exactly that."""
    import torch

    from megatron_delta.core.router import DepthRouter, make_source

    s = env.shapes[shape_name]
    t, d = s["seq"], s["hidden"]
    dtype = torch.float32 if env.dry else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(7)
    vals = [torch.randn(t, 1, d, generator=g).to(env.device, dtype).requires_grad_() for _ in range(n_sources)]
    x = torch.randn(t, 1, d, generator=g).to(env.device, dtype).requires_grad_()
    grad = torch.randn(t, 1, d, generator=g).to(env.device, dtype)
    r = DepthRouter(d, null_source=False, gate=False, eps=1e-6, kernels=kernel).to(env.device)
    with torch.no_grad():
        r.query.copy_(0.1 * torch.randn(d, generator=g).to(env.device))

    def call():
        out = r([make_source(v, 1e-6) for v in vals], base=x, apply_gate=True)
        return torch.autograd.grad(out, [*vals, x, r.query], grad)

    out = dict(kernel=kernel, shape=shape_name, sources=n_sources, **_rate(env, call, t * d, reps, copy_gbps))
    free(env, vals, x, grad, r)
    return out


STACK_LAYERS = 8  # (b2): layers of delta's routed stream timed whole (16 routers, the last reading 16 sources)


def stack_runs(env):
    """(b2)'s runs of delta's whole routed stream: (router backend, group size) - one router per pass on each
    backend, and the group router (``auto``) on triton (group_router.GroupRouting: its sizes for 16 routers)."""
    return [("torch", 1)] + [(k, g) for k in router_kernels(env) for g in ((1, "auto") if k == "triton" else (1,))]


def stack_bandwidth(opts, env, kernel, group_size, shape_name, copy_gbps, layers=STACK_LAYERS, reps=5):
    """(b2): delta's routed stream alone over ``layers`` layers (2 layers' routers each, x the sum of the sources,
    as delta runs) with identity sublayers (each sublayer's output is its routed input, so no GEMM runs), forward
    + backward, at the shape's width and sequence: its time, its counted bytes (every router pass, the sums of
    x and autograd's adds: core/traffic.py), their rate against the copy rate, and the time per router call.
    For the group router this is the one measurement of its kernels at full width (the old pass's tile holds S
    partial mixes of a whole row)."""
    import torch

    s = env.shapes[shape_name]
    t, d = s["seq"], s["hidden"]
    call, held = routed_stream(DELTA, layers, kernel, group_size, t, d, env.device,
                               torch.float32 if env.dry else torch.bfloat16, seed=8)
    out = dict(kernel=kernel, group_size=group_size, shape=shape_name, layers=layers,
               **_rate(env, call, t * d, reps, copy_gbps))
    out["ms_per_router"] = out["ms"] / (2 * layers)
    free(env, *held)
    return out


# (k): the Triton kernel each traffic record of the routed stream is (core/traffic.py's kernel and phase)
KERNEL_OF_RECORD = {("group_old_pass", "forward"): "_old_forward", ("group_old_pass", "backward"): "_old_backward",
                    ("group_merge", "forward"): "_merge_forward", ("group_merge", "backward"): "_merge_backward",
                    ("x_sum", "forward"): "_final_sum", ("triton_route", "forward"): "_forward",
                    ("triton_route", "backward"): "_backward", ("triton_block_grad", "backward"): "_block_grad"}


def kernel_time_runs(env):
    """(k)'s runs: (mode, group size) of the routed streams at the 1B shape's width and depth on our Triton kernels
    (none where this checkout or the dry run has none): delta on the group router, and delta_block. Not delta with
    one router per pass: its per-router kernels take the number of sources as a compile-time constant, so the 1B
    depth would compile 2 x 56 variants first, minutes of a GPU session's time."""
    return [(DELTA, "auto"), (DELTA_BLOCK, 1)] if "triton" in router_kernels(env) else []


def kernel_times(opts, env, mode, group_size, shape_name="1B", reps=3):
    """(k): where the GPU's time goes in ``mode``'s routed stream (identity sublayers) at the shape's width AND
    depth (at 1B: 28 layers, so 56 routers and the group sizes ``auto`` takes there; (b2)'s stream has 8 layers).
    One forward + backward under torch.profiler gives each CUDA kernel's calls and device time; the same call
    unprofiled gives the wall time. device_share = device time / wall time says what sets the pace: near 1 the
    kernels, well below 1 the host. For each of our Triton kernels, its counted bytes (core.traffic, mapped by
    KERNEL_OF_RECORD) over its device time, against the rate the cost model assumes (cost_model.HBM_EFFICIENCY of
    the GPU's peak) and against tools/kernel_resources.py's ceiling. The dry run: the wall time only (no CUDA)."""
    import torch

    from megatron_delta.core import traffic
    from megatron_delta.perf.cost_model import GPUS, HBM_EFFICIENCY

    s = env.shapes[shape_name]
    layers = s["layers"] or MODEL_SHAPES[shape_name]["num_layers"]
    t, d = s["seq"], s["hidden"]
    call, held = routed_stream(mode, layers, "triton", group_size, t, d, env.device,
                               torch.float32 if env.dry else torch.bfloat16, seed=9)
    with traffic.counting() as count:
        call()
    moved, records = {}, count.bytes(t * d)
    for (name, phase), (rd, wr) in records.items():
        kernel = KERNEL_OF_RECORD.get((name, phase))
        if kernel == "_final_sum" and ("group_old_pass", "forward") not in records:
            continue  # x summed by PyTorch's adds: the final-sum kernel runs only where the routers route in groups
        if kernel is not None:
            moved[kernel] = moved.get(kernel, 0) + rd + wr
    wall = _timed(env, call, reps)
    kernels = []
    if not env.dry:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        modelled = HBM_EFFICIENCY * GPUS[env.gpu_kind()][0]
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0)
            if us <= 0:
                continue
            row = dict(name=e.key, calls=e.count, ms=us / 1e3)
            if e.key in moved:
                row.update(bytes=moved[e.key], of_modelled_rate=moved[e.key] / (us * 1e-6) / modelled)
            kernels.append(row)
        kernels.sort(key=lambda r: -r["ms"])
    device_ms = sum(r["ms"] for r in kernels)
    out = dict(mode=mode, group_size=group_size, shape=shape_name, layers=layers, routers=2 * layers,
               wall_ms=1e3 * wall, wall_ms_per_router=1e3 * wall / (2 * layers), device_ms=device_ms,
               device_share=device_ms / (1e3 * wall) if kernels else None, kernels=kernels,
               counted_bytes=moved, ok=wall > 0 and (env.dry or bool(kernels)))
    free(env, *held)
    return out


def routed_stream(mode, layers, kernels, group_size, seq, hidden, device, dtype=None, seed=8):
    """``mode``'s routed stream alone over ``layers`` layers of identity sublayers (each sublayer's output is its
    routed input; x the sum of the sources in the additive modes; K = 4 blocks where 4 divides L in the block
    modes), one [seq, 1, hidden] micro-batch: a function running one forward + backward, and what it holds (for
    free()). The replacement modes' final router routes after the last layer. (b2)'s stream and perf/host_work.py's."""
    import torch

    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer, SourcePlan

    blocks = NUM_BLOCKS if mode in BLOCK_MODES and layers % NUM_BLOCKS == 0 else layers
    plan = SourcePlan(mode, layers, blocks, x_from_sources=mode in ADDITIVE_MODES, router_group_size=group_size)
    g = torch.Generator(device="cpu").manual_seed(seed)
    keys = [*range(2 * layers)] + (["final"] if plan.final_reads() else [])
    routers = [DepthRouter(hidden, null_source=False, gate=False, eps=1e-6, kernels=kernels).to(device)
               for _ in keys]
    readers = dict(zip(keys, routers))
    with torch.no_grad():
        for r in routers:
            r.query.copy_(0.1 * torch.randn(hidden, generator=g).to(device))
    h0 = torch.randn(seq, 1, hidden, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(seq, 1, hidden, generator=g).to(device, dtype)

    def call():
        buf = SourceBuffer.start(plan, h0, 1e-6, readers=readers)
        for j in range(2 * layers):
            buf.commit(j, buf.routed_input(j, routers[j]))
        return torch.autograd.grad(buf.output(readers.get("final")), [h0, *(r.query for r in routers)], grad)

    return call, (routers, h0, grad)


# ------------------------------------------------------------------------------------------- (c), (d)
# (e): Megatron-Core's MoE layer with Transformer Engine's fused permutation, fused router and grouped GEMM (all
# inside the MoE layer's forward: the routed modes see its output v only). 4 experts, top-2, alltoall dispatcher.
MOE_FIELDS = dict(num_experts=4, moe_router_topk=2)
MOE_FUSIONS = dict(moe_permute_fusion=True, moe_router_fusion=True, moe_grouped_gemm=True,
                   moe_token_dispatcher_type="alltoall")
MOE_FUSION_KERNELS = ("fused_permute", "fused_unpermute", "fused_sort_chunks_by_index",
                      "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss")


def moe_fusions_unavailable(env):
    """Why (e) cannot run here (None where it can): the dry run has no Transformer Engine; a Transformer Engine
    without the fused MoE kernels Megatron-Core imports (moe_utils), or older than 1.7 (no grouped experts), lacks
    them."""
    if env.impl != "transformer_engine":
        return (f"{'dry run' if env.dry else '--transformer-impl local'}: no Transformer Engine (the local backend "
                "has no grouped GEMM, fused permutation or router)")
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.utils import is_te_min_version

    missing = [name for name in MOE_FUSION_KERNELS if getattr(moe_utils, name, None) is None]
    if missing:
        return f"this Transformer Engine lacks {', '.join(missing)}"
    if not is_te_min_version("1.7.0"):
        return "Transformer Engine < 1.7 has no grouped GEMM experts"
    return None


def train(opts, env, mode, *, shape, overrides, fp8=None, kernels="fla", iters=None, warmup=0, micro_batches=1,
          group_size=None, moe=False):
    """`iters` iterations with Megatron's DDP + optimizer + forward-backward schedule on a learnable stream,
    ``micro_batches`` micro-batches per iteration. ``overrides(args, standard_overrides)``: the optimizer's
    parameter-group overrides with the routers' group, as pretrain_gpt.py makes them (the trainer's
    router_overrides). tokens_per_sec: the micro-batches' forward + backward alone; the optimizer step is timed
    apart (optimizer_ms) and step_tokens_per_sec counts it too. ``moe``: every MLP an MoE layer with the fusions
    of MOE_FUSIONS (the experts must be Transformer Engine's grouped MLP)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.pipeline_parallel import get_forward_backward_func

    free(env)
    resident_gib = env.reset_peak()
    iters = iters or opts.iters
    fields = model_fields(opts, env, mode, shape=shape, fp8=fp8)
    if moe:
        fields.update(MOE_FIELDS, moe_ffn_hidden_size=shape["ffn"] // MOE_FIELDS["moe_router_topk"])
    fields, config, chunk = build(env, fields, kernels=kernels, group_size=group_size, **(MOE_FUSIONS if moe else {}))
    if moe:
        experts = {type(layer.mlp.experts).__name__ for layer in chunk.decoder.layers}
        if experts != {"TEGroupedMLP"}:  # Megatron's spec falls back to SequentialMLP with a warning
            raise RuntimeError(f"--moe-grouped-gemm built {sorted(experts)}, not TEGroupedMLP")
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), module=chunk)
    lr = dict(lr=opts.lr, min_lr=opts.lr / 10)
    opt_config = OptimizerConfig(optimizer="adam", **lr, **ADAM, bf16=not env.dry, params_dtype=config.params_dtype)
    # the routers' parameter group, as pretrain_gpt.py makes it (--delta-router-lr-mult 1: no weight decay)
    routers = types.SimpleNamespace(residual=mode, delta_router_lr_mult=1.0, **lr)
    optimizer = get_megatron_optimizer(opt_config, [ddp], config_overrides=overrides(
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

    losses, fb_times, opt_times = [], [], []
    fb = get_forward_backward_func()
    for _ in range(iters):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        env.sync()
        t0 = time.perf_counter()
        reports = fb(forward_step_func=step_fn, data_iterator=iter([None] * micro_batches), model=ddp,
                     num_microbatches=micro_batches, seq_length=s, micro_batch_size=b, forward_only=False)
        env.sync()
        t1 = time.perf_counter()
        optimizer.step()
        env.sync()
        fb_times.append(t1 - t0)
        opt_times.append(time.perf_counter() - t1)
        losses.append(sum(float(r["lm loss"]) for r in reports) / len(reports))
    timed, opt_timed = fb_times[warmup:] or fb_times, opt_times[warmup:] or opt_times
    tokens = s * b * micro_batches * len(timed)
    out = {"mode": mode, "kernels": kernels if mode != BASELINE else "-", "group_size": group_size,
           "precision": fp8 and f"fp8-hybrid-{fp8}" or ("fp32" if env.dry else "bf16"),
           "num_layers": fields["num_layers"],
           "num_blocks": fields["delta_num_blocks"], "micro_batches": micro_batches, "losses": losses,
           "tokens_per_sec": tokens / sum(timed), "fb_ms": [1e3 * t for t in timed],
           "optimizer_ms": 1e3 * sum(opt_timed) / len(opt_timed),
           "step_tokens_per_sec": tokens / (sum(timed) + sum(opt_timed)), "peak_mem_gib": env.peak_gib(),
           "resident_gib": resident_gib,
           "ok": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], "moe": moe}
    free(env, ddp, optimizer, chunk)
    return out


def layers_that_fit(shape, total_bytes, frac=0.8, transformer_impl="transformer_engine"):
    """(c): the most layers of the 8B slice, a multiple of NUM_BLOCKS up to its 36, whose memory plan (delta,
    the hungriest mode, bf16, on ``transformer_impl``'s layers) fits in ``frac`` of ``total_bytes`` (this GPU's
    memory); NUM_BLOCKS at the least (the run then fails and says so where even that does not fit)."""
    best = NUM_BLOCKS
    for L in range(NUM_BLOCKS, MODEL_SHAPES["8B"]["num_layers"] + 1, NUM_BLOCKS):
        if planned_bytes(shape, L, DELTA, transformer_impl) * 1.15 <= frac * total_bytes:
            best = L
    return best


def planned_bytes(shape, num_layers, mode, transformer_impl):
    """tools/memory_plan.py's memory per GPU (bytes) for a model of (c)'s ``shape`` with ``num_layers`` layers,
    ``mode`` (the block modes with K = NUM_BLOCKS), bf16, on ``transformer_impl``'s layers, one micro-batch."""
    a = memory_model.plan_config(num_layers=num_layers, hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
                                 num_attention_heads=shape["heads"], num_query_groups=shape["groups"],
                                 seq_length=shape["seq"], residual=mode, bf16=True, transformer_impl=transformer_impl,
                                 untie_embeddings_and_output_weights=True,
                                 **({"delta_num_blocks": NUM_BLOCKS} if mode in BLOCK_MODES else {}))
    return memory_model.memory_plan(a)["stages"][0]["total"]


def speed_shape(opts, env, shape_name):
    """(c)'s shape ``shape_name`` on this machine, its layer count settled (--num-layers-8b, else as many as fit)."""
    shape = dict(env.shapes[shape_name])
    if shape["layers"] is None:
        if opts.num_layers_8b:
            shape["layers"] = opts.num_layers_8b
        else:
            import torch

            shape["layers"] = layers_that_fit(shape, torch.cuda.get_device_properties(0).total_memory,
                                              transformer_impl=env.impl)
    return shape


def predicted(env, shape_name, mode, kernels, num_layers, group_size=None):
    """The cost model's tokens/s ratio to the baseline for this run on this GPU (perf.cost_model.router_share, bf16,
    with the run's group size; None for a backend the closed form does not know yet)."""
    if mode == BASELINE:
        return 1.0
    if kernels not in cost_model.BACKENDS:
        return None
    r = cost_model.router_share(env.gpu_kind(), shape_name, mode, kernels, num_layers=num_layers,
                                num_blocks=NUM_BLOCKS if mode in BLOCK_MODES else None, group_size=group_size)
    return r["tokens_per_sec_ratio"]


def _ms_per_micro_batch(env, run, shape_name):
    """(c): a run's milliseconds per micro-batch (one [seq] sequence) from its tokens/s."""
    return 1e3 * env.shapes[shape_name]["seq"] / run["tokens_per_sec"]


def gemm_pace(env, base, shape_name, num_layers):
    """(c): the baseline run ``base``'s pace against its GEMMs alone at the cost model's rate (cost_model.router_share:
    FLOPs at GEMM_EFFICIENCY of this GPU's peak), the step the predictions take the baseline's to be: its GEMMs'
    milliseconds per micro-batch over the measured ones. Near 1 the predictions' premise holds; well below, the
    baseline's step is set by something else (the host, or memory-bound ops such as unfused attention), which the
    routed runs' ratios then measure too. None in the dry run (tiny shapes the model does not price)."""
    if env.dry:
        return None
    gemm_ms = cost_model.router_share(env.gpu_kind(), shape_name, BASELINE, num_layers=num_layers)["gemm_ms"]
    measured_ms = _ms_per_micro_batch(env, base, shape_name)
    return dict(gemm_ms=gemm_ms, measured_ms=measured_ms, pace=gemm_ms / measured_ms)


def gemm_paced_ratio(env, r, base, shape_name):
    """(c): run ``r``'s tokens/s ratio against a baseline at its GEMMs' pace (the step the predictions take the
    baseline's to be): its measured milliseconds per micro-batch over the baseline's (the router's cost, as
    measured) added to the baseline's GEMMs at the cost model's rate (``base``'s gemm_pace). Where the baseline ran
    slower than its GEMMs (Megatron's local layers: unfused attention), this is the ratio a run as fast as the
    predictions assume would see with the same router. None without the baseline's pace (the dry run)."""
    pace = base.get("gemm_pace")
    if not pace:
        return None
    router_ms = _ms_per_micro_batch(env, r, shape_name) - pace["measured_ms"]
    return pace["gemm_ms"] / (pace["gemm_ms"] + router_ms)


def planned_gib(env, shape_name, mode, num_layers):
    """tools/memory_plan.py's memory per GPU (GiB) for a run of (c): its shape, mode and layers, bf16, this run's
    layers (TE or local), one micro-batch in flight (None in the dry run: no peak to set it beside)."""
    return None if env.dry else planned_bytes(env.shapes[shape_name], num_layers, mode, env.impl) / 2**30


def full_depth_ratio(measured, predicted_slice, predicted_full):
    """(c): the tokens/s ratio at the shape's full depth that a layer slice's measurement implies. The router's
    measured cost over the slice's GEMMs, against the model's for the slice, is the model's error on this GPU,
    c = (1/measured - 1) / (1/predicted_slice - 1); carried to the full depth: 1 / (1 + c (1/predicted_full - 1)).
    A slice costs the router relatively more than the full depth (the block sums, the first layers' few sources),
    so a target set at full depth is judged on this, not on the slice's own ratio. None where the model has no
    prediction or predicts no router cost."""
    if predicted_slice is None or predicted_full is None or predicted_slice >= 1:
        return None
    c = max(1 / measured - 1, 0.0) / (1 / predicted_slice - 1)
    return 1 / (1 + c * (1 / predicted_full - 1))


def compare_speed(env, r, base, shape_name, mode, kernels, num_layers, group_size=None):
    """(c): set the run ``r``'s throughput and peak-memory ratios to the baseline run ``base``, the predicted ratio
    beside them, the ratio at the shape's full depth (measured there, or implied by a slice: full_depth_ratio) and,
    on a GPU for the runs with targets (target(): per GPU, fused kernel), target_ok: tokens/s judged at full depth,
    peak memory as measured. Returns the target (tokens/s, memory) ratios or None."""
    r["throughput_ratio"] = r["tokens_per_sec"] / base["tokens_per_sec"]
    r["predicted_ratio"] = predicted(env, shape_name, mode, kernels, num_layers, group_size)
    full = MODEL_SHAPES[shape_name]["num_layers"]
    r["full_depth_layers"] = full
    if num_layers == full:
        r["full_depth_predicted"], r["full_depth_ratio"] = r["predicted_ratio"], r["throughput_ratio"]
    else:
        r["full_depth_predicted"] = predicted(env, shape_name, mode, kernels, full, group_size)
        r["full_depth_ratio"] = 1.0 if mode == BASELINE else full_depth_ratio(
            r["throughput_ratio"], r["predicted_ratio"], r["full_depth_predicted"])
    if mode == BASELINE:
        r["gemm_pace"] = gemm_pace(env, r, shape_name, num_layers)
    r["gemm_paced_ratio"] = gemm_paced_ratio(env, r, base, shape_name)
    r["peak_mem_ratio"] = None if r["peak_mem_gib"] is None else r["peak_mem_gib"] / base["peak_mem_gib"]
    r["planned_mem_gib"] = planned_gib(env, shape_name, mode, num_layers)
    goal = target(env.gpu_kind(), shape_name, mode) if kernels in ("fla", "triton") else None  # the fused kernels
    if goal and not env.dry:
        r["target_ok"] = (r["full_depth_ratio"] is not None and r["full_depth_ratio"] >= goal[0]
                          and (goal[1] is None or r["peak_mem_ratio"] <= goal[1]))
    return goal


def train_precisions(opts, env, skipped):
    """(d)'s FP8 recipes beside BF16 (None): delayed scaling, and current scaling (recipe `tensorwise`) where the
    installed Transformer Engine has it; what it cannot run is appended to ``skipped``."""
    precisions = [None]
    if not env.dry and env.impl != "transformer_engine" and not opts.no_fp8:
        skipped.append("fp8 training: --transformer-impl local (FP8 needs Transformer Engine)")
    elif not env.dry and not opts.no_fp8:
        precisions.append("delayed")
        try:
            from transformer_engine.common import recipe as te_recipe

            if hasattr(te_recipe, "Float8CurrentScaling"):
                precisions.append("tensorwise")
            else:
                skipped.append("fp8 current scaling: not in this Transformer Engine")
        except Exception as e:  # noqa: BLE001
            skipped.append(f"fp8 current scaling: {e}")
    return precisions


@contextlib.contextmanager
def check_session(opts):
    """The Env of this run, inside the one-process world (gloo on CPU) and, in the dry run, with fla's
    pure-PyTorch naive_attnres standing in for the Triton kernel (megatron_delta.core.fla_router.set_kernel).
    Both are undone on exit."""
    import logging

    from megatron_delta.core import fla_router
    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed

    if not opts.dry_run:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # DDP / optimizer set-up lines per run
    env = Env(opts)
    injected = None
    if env.dry:
        from fla.ops.attnres import naive_attnres

        injected = fla_router.set_kernel(naive_attnres, devices=("cpu",), name="naive_attnres (dry run)")
    try:
        initialize_distributed(1, 1, seed=SEED)
        yield env
    finally:
        if env.dry:
            fla_router.set_kernel(injected.fn if injected else None, *(injected[1:] if injected else ()))
        destroy_distributed()


class CheckRun:
    """One acceptance run's results (``result``): the JSON at --out, rewritten after every run so that a timeout
    still leaves results; the time budget (--time-budget-s) from the start; attempt() runs one part's run and
    records it, a failure as ok=False with its error."""

    def __init__(self, opts, env):
        import torch

        from megatron_delta.core import fla_router

        self.opts, self.env = opts, env
        self.t_start = time.time()
        self.result = {"device": env.gpu_name, "dry_run": env.dry, "torch": torch.__version__, "opts": vars(opts),
                       "router_kernels": fla_router.describe("fla", cuda=not env.dry),
                       "parity": [], "router": [], "host": [], "kernels": [], "bandwidth": [], "speed": [], "train": [],
                       "moe": [], "skipped": []}
        try:
            import transformer_engine

            self.result["transformer_engine"] = getattr(transformer_engine, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            self.result["transformer_engine"] = f"not available: {type(e).__name__}"

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.opts.out)), exist_ok=True)
        with open(self.opts.out, "w") as f:
            json.dump(self.result, f, indent=1)

    def over_budget(self, what):
        if time.time() - self.t_start > self.opts.time_budget_s:
            self.result["skipped"].append(what)
            print(f"gpu_check: time budget spent, skipping {what}", flush=True)
            return True
        return False

    def attempt(self, part, what, fn, **fields):
        """fn()'s result appended to ``part`` (None when the budget is spent); an exception is recorded as
        ``fields`` + ok False + its error, and the run goes on."""
        if self.over_budget(what):
            return None
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001  (report and go on)
            r = dict(fields, ok=False, error=f"{type(e).__name__}: {e}")
            free(self.env)
        self.result[part].append(r)
        self.save()
        return r

    def finish(self):
        """The verdicts (every run ok and nothing skipped; the targets met), the wall time; saved."""
        result = self.result
        parts = (result["parity"] + result["router"] + result["host"] + result["kernels"] + result["bandwidth"]
                 + result["speed"] + result["train"] + result["moe"])
        result["ok"] = all(r["ok"] for r in parts) and not result["skipped"]
        result["targets_met"] = all(r.get("target_ok", True) for r in result["speed"])
        result["wall_s"] = time.time() - self.t_start
        self.save()
        return result
