"""The router's share of a training step on a GPU: the bytes every router pass moves through HBM
(router_bytes, per residual mode and router backend) against the layers' GEMM FLOPs (layer_gemm_flops), at
datasheet peaks (GPUS) derated by GEMM_EFFICIENCY and HBM_EFFICIENCY. router_share predicts the tokens/s
ratio to the baseline for one shape (perf.shapes.SHAPES); tools/memory_plan.py --router-share prints it and
tools/gpu_check.py sets it beside its measurement. No model is built."""
from megatron_delta.core.modes import ADDITIVE_MODES, BASELINE, BLOCK_MODES, REPLACEMENT_MODES
from megatron_delta.perf.shapes import SHAPES

GPUS = {  # name: (HBM bytes/s, dense bf16 FLOP/s) - datasheet peaks
    "H100": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
    "B200": (8.0e12, 2250e12),
}
GEMM_EFFICIENCY = 0.75  # fraction of peak FLOP/s Megatron's GEMMs reach at these shapes (H200: ~790 of 989)
HBM_EFFICIENCY = 0.85   # fraction of peak bandwidth a streaming elementwise pass reaches


def _reads_per_router(plan):
    """Per receiving router of one micro-batch, per source it reads: (readers of that source value, whether
    this router is its first reader). A source a commit rewrites (modes.RoutedMode.rewritten_by_commit) is a
    new value at each read."""
    out, seen = [], {}
    receivers = list(range(plan.num_sublayers)) + (["final"] if plan.final_reads() else [])
    for j in receivers:
        names = plan.final_reads() if j == "final" else plan.reads(j)
        row = []
        for n in names:
            rewritten = n == plan.rules.rewritten_by_commit(plan.num_sublayers - 1 if j == "final" else j)
            if rewritten or n not in seen:
                seen[n] = len(plan.value_readers(n, j))
                row.append((seen[n], True))
            else:
                row.append((seen[n], False))
        out.append(row)
    return out


def router_bytes(plan, tokens, hidden, act_bytes=2, backend="torch", null_source=False, gate=False):
    """Bytes the routers of one micro-batch move through HBM in forward + backward (every router, every
    [tokens, hidden] pass; the [M, tokens] softmax tensors are ignored, they are 1/hidden as large).

    Unit: one [tokens, hidden] tensor in the activation dtype = a bytes; fp32 = c = 4 bytes per element.
    ``torch`` (router.py's PyTorch path; each eager op one pass): a source read by J >= 2 routers is
    projected once (_ProjectSource: norm + GEMM, 2 reads; backward: 2 GEMM reads, one fused write into
    its gradient); a local source (one reader) costs its router an fp32 copy and 2 reads of it (c reads);
    the weighted sum starts from an fp32 copy of x (a + c; none without x), adds each source (a + 2c),
    the null source (2c), and casts once (c + a); backward: grad to fp32 (a + c), per source one dot
    product (a + 3c: the product into a buffer, its row sums) and one scaled add into its gradient sink
    (2a + c), plus the local sources' projection gradient (a + 2c).
    ``fla`` (fla_router.py around fused_attnres, checkpoint_level 1): forward reads the M residuals once
    and writes r (M a + a), then u = x + r (3a; with the gate: fp32 combine, 2a + 2c + a); backward
    re-reads the residuals twice (mix recompute + dv loop) and do, writes M source gradients and an fp32
    [T, d] query-gradient partial that a second kernel reads (2 M a + a + M a + 2c); autograd adds each
    source gradient after the first reader's into the source's (3a). The null source is one
    more residual, materialised (a write) and its gradient summed (a read)."""
    a, c = act_bytes, 4
    total = 0.0
    for reads in _reads_per_router(plan):
        n = len(reads)
        m = n + int(null_source)
        has_x = plan.additive and not plan.x_from_sources
        if backend == "torch":
            fwd = (a + c if has_x else 0) + n * (a + 2 * c) + (2 * c if null_source else 0) + (c + a)
            bwd = (a + c) + n * ((a + 3 * c) + (2 * a + c))
            for readers, first in reads:
                if readers >= 2:
                    if first:  # projected once per source value, with all its readers
                        total += 2 * a + 2 * a + a
                else:
                    fwd += a + c + 2 * c
                    bwd += a + 2 * c
            total += fwd + bwd
        elif backend == "fla":
            fwd = m * a + a + (a if null_source else 0)
            if has_x:
                fwd += (2 * a + 2 * c + a) if gate else 3 * a
            elif plan.additive:  # x formed from the sources: read them again
                fwd += n * a + 2 * c + a
            bwd = 2 * m * a + a + m * a + 2 * c + (a if null_source else 0)
            bwd += sum(3 * a for _, first in reads if not first)  # autograd adds it into the source's gradient
            total += fwd + bwd
        else:
            raise ValueError(f"backend {backend!r}: torch or fla")
    return total * tokens * hidden


def layer_gemm_flops(shape, tokens, micro_batch=1):
    """Training FLOPs of one layer's GEMMs (forward 2, backward 4 per multiply-add: 6 x tokens x params) plus
    causal attention (QK^T and PV: 2 x 2 x s^2/2 x heads x head_dim per sequence, x 3 for training)."""
    h, dh = shape["hidden_size"], shape["kv_channels"]
    q, kv, f = shape["num_attention_heads"] * dh, shape["num_query_groups"] * dh, shape["ffn_hidden_size"]
    params = h * (q + 2 * kv) + q * h + h * 2 * f + f * h
    s = shape["seq_length"]
    attn = 3 * 2 * 2 * (s * s / 2) * shape["num_attention_heads"] * dh * micro_batch
    return 6 * tokens * params + attn


def router_share(gpu, shape_name, mode, backend="torch", num_blocks=None, null_source=False, gate=False,
                 micro_batch=1, act_bytes=2, num_layers=None):
    """Predicted router time against the layers' GEMM time for one training step (one micro-batch):
    router bytes / (HBM x HBM_EFFICIENCY) vs GEMM FLOPs / (peak x GEMM_EFFICIENCY). Returns a dict with
    both times, the share of the step (router / (GEMM + router)) and the predicted tokens/s ratio to the
    baseline (GEMM / (GEMM + router): the baseline's step taken as its GEMMs). ``num_layers`` overrides
    the shape's (gpu_check's layer slice); ``num_blocks``: the block modes' K (default: the command line's,
    modes.default_num_blocks, which refuses a layer count it cannot split into at most 4 blocks)."""
    from types import SimpleNamespace

    from megatron_delta.core.sources import SourcePlan

    bw, flops = GPUS[gpu]
    shape = dict(SHAPES[shape_name])
    if num_layers:
        shape["num_layers"] = num_layers
    L = shape["num_layers"]
    tokens = shape["seq_length"] * micro_batch
    gemm_s = L * layer_gemm_flops(shape, tokens, micro_batch) / (flops * GEMM_EFFICIENCY)
    router_s = 0.0
    if mode != BASELINE:
        kb = num_blocks if mode in BLOCK_MODES else None  # None: the block modes' default K (SourcePlan)
        cfg = SimpleNamespace(residual=mode, num_layers=L, delta_num_blocks=kb, delta_sources="exact",
                              delta_gate="scalar" if gate else "none",
                              delta_router_kernels="fla" if backend == "fla" else "torch")
        plan = SourcePlan.from_config(cfg)
        router_s = router_bytes(plan, tokens, shape["hidden_size"], act_bytes, backend, null_source,
                                gate) / (bw * HBM_EFFICIENCY)
    return {"gpu": gpu, "shape": shape_name, "mode": mode, "backend": backend, "num_layers": L,
            "gemm_ms": gemm_s * 1e3, "router_ms": router_s * 1e3, "router_share": router_s / (gemm_s + router_s),
            "tokens_per_sec_ratio": gemm_s / (gemm_s + router_s)}


def router_share_rows(gpu, shapes=("1B", "8B"), modes=ADDITIVE_MODES + REPLACEMENT_MODES):
    """router_share of every shape x mode x router backend (torch, fla) on ``gpu``, in that order."""
    return [router_share(gpu, s, m, b) for s in shapes for m in modes for b in ("torch", "fla")]
