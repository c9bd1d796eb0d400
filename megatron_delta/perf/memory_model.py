#!/usr/bin/env python
"""Per-GPU memory plan: weights, gradients, optimizer state and activations per pipeline stage.

    python tools/memory_plan.py --preset qwen3-8b                       # the paper's 8B run (sbatch)
    python tools/memory_plan.py --num-layers 36 --hidden-size 4096 ... --residual delta_block \
        --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --bf16 --world-size 16

Takes pretrain_gpt.py's model/parallel flags (plus --world-size) and prints a table and a JSON object
(--json FILE also writes it). No model is built and no Megatron code runs.

Model of the activations (bytes saved for backward per micro-batch, counted as unique storages):
- local backend: the tensors Megatron's local spec saves, counted on CPU (tests/test_memory_plan.py
  checks this estimate against torch.autograd.graph.saved_tensors_hooks within 10 %). Per layer and
  token: 6 norm-region tensors [h] (input, normalised, norm output; twice), 6 of the query width,
  the qkv output, one of the KV width, 5 x FFN (SwiGLU), the [heads, s] attention probabilities
  (unfused softmax) and fp32 norm statistics; per layer the rope tables and the causal mask.
- transformer_engine backend: norms fused into the linears (input + ln_out per sublayer), flash
  attention (no [s, s] term; fp32 log-sum-exp per head); FP8 keeps FP8 copies (1 byte) of the GEMM
  inputs instead of BF16 ones.
- routed modes (delta, delta_block, attnres, full_attnres): + one [h] tensor per sublayer (the
  routed input next to the residual stream; the sublayer outputs become sources held by reference),
  + per (source, reader) pair one fp32 logit and one fp32 softmax weight per token, one fp32
  inv_rms per source. Except delta_block (exact) in fp32 with the CPU router kernels (--device cpu):
  a router reading the partial block sum P rebuilds it in backward from its output, so those
  sublayers keep no extra [h] tensor.
- TP divides tensor-parallel regions; SP also divides the norm region, the sources and the payloads.
- Pipeline: 1F1B keeps min(PP - stage, micro-batches) micro-batches in flight on a stage
  (interleaved: Megatron's warm-up count + 1 chunk-micro-batches); each in-flight micro-batch of a
  stage that receives a payload also holds the payload tensors beyond x (the sources the stage
  reads). The last stage adds the logits (fp32 [tokens, vocab / TP]) of one micro-batch.
- Interleaved schedule with the source cache (--delta-pp-source-cache on, the default): a chunk holds
  only the payload tensors it was sent, plus the new sources it keeps for the rank's next chunk (which
  the uncached path would free once sent); the boundary lines give the bytes sent per micro-batch with
  and without the cache.
- Weights: bf16 (2 B) + fp32 gradient buffer (4 B, Megatron's grad_reduce_in_fp32 with bf16) +
  Adam in fp32 (master weights, m, v: 12 B; fp32 training: m, v: 8 B), sharded over DP by
  --use-distributed-optimizer. Not counted: the CUDA context, NCCL buffers, allocator
  fragmentation and temporary buffers (add 10-20 %).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_delta.core.modes import (ADDITIVE_MODES, BASELINE, BLOCK_MODES, DELTA_BLOCK,  # noqa: E402
                                       REPLACEMENT_MODES, RESIDUAL_MODES, SOURCE_DEFINITIONS, default_num_blocks)

GiB = 2**30

PRESETS = {
    # The paper's 8B run = examples/slurm/pretrain_qwen3_8b_delta_block.sbatch on 2 nodes x 8 GPUs.
    "qwen3-8b": dict(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                     num_query_groups=8, kv_channels=128, seq_length=2048, vocab_size=151936,
                     untie_embeddings_and_output_weights=True, residual=DELTA_BLOCK, delta_num_blocks=4,
                     tensor_model_parallel_size=2, pipeline_model_parallel_size=1, sequence_parallel=True,
                     use_distributed_optimizer=True, bf16=True, fp8_format="hybrid",
                     transformer_impl="transformer_engine", micro_batch_size=1, global_batch_size=64,
                     world_size=16),
}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 3 x hidden (SwiGLU)")
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--kv-channels", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--residual", choices=RESIDUAL_MODES, default=BASELINE)
    p.add_argument("--delta-num-blocks", type=int, default=None)
    p.add_argument("--delta-sources", choices=SOURCE_DEFINITIONS, default=SOURCE_DEFINITIONS[0])
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--delta-pp-source-cache", choices=["on", "off"], default="on",
                   help="interleaved schedule: a boundary sends only the sources the receiving rank lacks")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None)
    p.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine with --bf16, else local")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--world-size", type=int, default=None, help="default TP x PP (DP 1)")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="cpu: the router's fp32 C kernels (delta_block keeps no partial block sums)")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--router-share", choices=sorted(GPUS), default=None,
                   help="instead: predict the router's share of a training step on this GPU (1B and 8B shapes, "
                        "every routed mode, PyTorch path vs fla's fused kernel)")
    return p


def parse(argv=None):
    p = build_parser()
    pre, _ = p.parse_known_args(argv)
    if pre.preset:
        p.set_defaults(**PRESETS[pre.preset])
    a = p.parse_args(argv)
    if a.ffn_hidden_size is None:
        a.ffn_hidden_size = 3 * a.hidden_size
    if a.kv_channels is None:
        a.kv_channels = a.hidden_size // a.num_attention_heads
    if a.transformer_impl is None:
        a.transformer_impl = "transformer_engine" if a.bf16 else "local"
    t, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    if a.world_size is None:
        a.world_size = t * pp
    if a.world_size % (t * pp) or a.num_layers % pp:
        p.error("world size must be a multiple of TP x PP, and PP must divide --num-layers")
    a.data_parallel_size = a.world_size // (t * pp)
    if a.global_batch_size is None:
        a.global_batch_size = a.micro_batch_size * a.data_parallel_size
    a.num_microbatches = a.global_batch_size // (a.micro_batch_size * a.data_parallel_size)
    a.vpp = None
    if a.num_layers_per_virtual_pipeline_stage:
        a.vpp = a.num_layers // pp // a.num_layers_per_virtual_pipeline_stage
    if a.tensor_model_parallel_size == 1:
        a.sequence_parallel = False
    if a.delta_num_blocks is None:
        a.delta_num_blocks = default_num_blocks(a.residual, a.num_layers)
    return a


def source_plan(a):
    if a.residual == BASELINE:
        return None
    from megatron_delta.core.sources import SourcePlan

    return SourcePlan.from_config(a)


# ----------------------------------------------------------------------------------- parameters
def layer_params(a):
    h, q, kv, f = a.hidden_size, a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels, a.ffn_hidden_size
    tp_split = h * (q + 2 * kv) + q * h + h * 2 * f + f * h  # divided by TP
    replicated = 2 * h + 2 * a.kv_channels  # input norms, q/k norms
    if a.residual != BASELINE:
        replicated += 2 * 2 * h  # two routers: query + key-norm weight
    return tp_split, replicated


def stage_params(a, stage):
    """Parameters on one GPU of pipeline stage `stage` (all its virtual chunks)."""
    t, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    split, rep = layer_params(a)
    n = a.num_layers // pp * (split / t + rep)
    vocab = a.vocab_size / t
    if stage == 0:
        n += vocab * a.hidden_size
    if stage == pp - 1:
        n += a.hidden_size  # final norm
        if a.residual in REPLACEMENT_MODES:
            n += 2 * a.hidden_size  # final router
        if a.untie_embeddings_and_output_weights or pp > 1:
            n += vocab * a.hidden_size  # output layer (a tied copy lives on the last stage when PP > 1)
    return n


# ---------------------------------------------------------------------------------- activations
def layer_activation_bytes(a, first_layer, num_layers):
    """Bytes saved for backward by `num_layers` layers from global layer `first_layer`, one micro-batch."""
    t = a.tensor_model_parallel_size
    sp = t if a.sequence_parallel else 1
    s, b = a.seq_length, a.micro_batch_size
    T = s * b
    h, dh = a.hidden_size, a.kv_channels
    heads, groups = a.num_attention_heads / t, a.num_query_groups / t
    q, kv, f = heads * dh, groups * dh, a.ffn_hidden_size / t
    act = 2 if a.bf16 else 4
    gemm_in = 1 if a.fp8_format else act  # FP8: TE keeps FP8 copies of the GEMM inputs
    if a.transformer_impl == "local":
        # LocalNorm computes in fp32: with bf16 activations its input copy and x*rsqrt are fp32.
        norm_h = (2 * 4 + act) if a.bf16 else 3 * act  # (input, normalised, output) per norm
        per_token = (2 * norm_h * h / sp               # attention + MLP input norms (norm region)
                     + act * (6 * q + (q + 2 * kv) + kv + 5 * f)  # q path, qkv, k, SwiGLU
                     + act * heads * s                  # softmax probabilities [b, np, s, s]
                     + 4 * (2 / sp + heads + groups))   # fp32 rsqrt of the norms
        per_layer = 4 * 4 * dh * s + s * s              # rope cos/sin (fp32, per position), causal mask
    else:
        per_token = (2 * h / sp * (act + gemm_in)      # LayerNormLinear: input + ln_out, twice
                     + act * (3 * q + 3 * kv + (q + 2 * kv) + 4 * f) + gemm_in * (q + f)  # qk-norm/rope, qkv, SwiGLU, proj/fc2 inputs
                     + 4 * (2 / sp + heads + groups + heads))  # rsigma, q/k-norm stats, flash lse
        per_layer = 4 * 4 * dh * s
    total = num_layers * (per_token * T + per_layer)
    plan = source_plan(a)
    if plan is not None:
        total += num_layers * 2 * act * h * T / sp      # the routed input of each sublayer
        rebuilds_p = a.device == "cpu" and not a.bf16 and plan.rules.router_rebuilds_from_x
        for j in range(2 * first_layer, 2 * (first_layer + num_layers)):
            if rebuilds_p and not plan.is_block_start(j):
                total -= act * h * T / sp               # its P is rebuilt from u in backward (router.py)
            m = plan.num_sources_read(j)
            total += 4 * (2 * m + 1) * T / sp           # fp32 softmax weights and logit columns [M, T], one inv_rms
    return total


def in_flight(a, stage):
    """Micro-batches (1F1B) or chunk-micro-batches (interleaved) whose activations a stage holds at peak."""
    pp, m = a.pipeline_model_parallel_size, a.num_microbatches
    if a.vpp:
        warmup = (pp - stage - 1) * 2 + (a.vpp - 1) * pp
        return min(warmup + 1, m * a.vpp)
    return min(pp - stage, m)


def tensor_bytes(a):
    """One [s, b, h] activation tensor on one rank (SP divides s)."""
    sp = a.tensor_model_parallel_size if a.sequence_parallel else 1
    return a.seq_length * a.micro_batch_size * a.hidden_size / sp * (2 if a.bf16 else 4)


def chunk_plan(a, cached=None):
    """The pipeline chunks' SourceCachePlan (even split); cached: the source cache (default: the flag)."""
    from megatron_delta.core.source_cache import SourceCachePlan

    if cached is None:
        cached = a.delta_pp_source_cache == "on"
    return SourceCachePlan.even(source_plan(a), a.pipeline_model_parallel_size, a.vpp or 1, cached)


def chunk_payload_bytes(a, k):
    """What chunk k holds of the pipeline payload per micro-batch beyond the baseline's one tensor: the tensors
    it was sent (with the source cache only those: the rest are tensors the rank already holds) and the new
    sources it keeps for the rank's next chunk (which the uncached path frees once sent)."""
    plan = source_plan(a)
    if plan is None:
        return 0
    chunks = chunk_plan(a)
    sent = chunks.sent_names(k) if k else []
    received = set(plan.payload_names(chunks.first_layers[k])) if k else set()
    kept_new = [n for n in chunks.kept_names(k) if n not in received]
    return (max(len(sent) - 1, 0) + len(kept_new)) * tensor_bytes(a)


def boundary_traffic(a):
    """Per (virtual) pipeline boundary: the tensors and bytes sent per micro-batch, with the source cache as
    configured and without it."""
    if source_plan(a) is None:
        return [{"chunk": k, "first_layer": k * a.num_layers // (a.pipeline_model_parallel_size * (a.vpp or 1)),
                 "tensors": 1, "bytes": tensor_bytes(a), "tensors_without_cache": 1,
                 "bytes_without_cache": tensor_bytes(a)}
                for k in range(1, a.pipeline_model_parallel_size * (a.vpp or 1))]
    return [{"chunk": k, "first_layer": first, "tensors": len(sent), "bytes": len(sent) * tensor_bytes(a),
             "tensors_without_cache": len(sent) + len(kept), "bytes_without_cache": (len(sent) + len(kept))
             * tensor_bytes(a)} for k, first, sent, kept in chunk_plan(a).boundaries()]


def plan_stage(a, stage):
    pp, t = a.pipeline_model_parallel_size, a.tensor_model_parallel_size
    chunks = a.vpp or 1
    per_chunk = a.num_layers // (pp * chunks)
    n = stage_params(a, stage)
    w = n * (2 if a.bf16 else 4)
    g = n * 4
    o = n * (12 if a.bf16 else 8) / (a.data_parallel_size if a.use_distributed_optimizer else 1)
    # Activations of one micro-batch through each chunk on this stage, and its payload.
    chunk_acts, chunk_payload = [], []
    for c in range(chunks):
        first = (c * pp + stage) * per_chunk
        chunk_acts.append(layer_activation_bytes(a, first, per_chunk))
        chunk_payload.append(chunk_payload_bytes(a, c * pp + stage))
    k = in_flight(a, stage)
    if a.vpp:
        per = (sum(chunk_acts) + sum(chunk_payload)) / chunks
        acts = per * k
        payload = sum(chunk_payload) / chunks * k
    else:
        acts = (chunk_acts[0] + chunk_payload[0]) * k
        payload = chunk_payload[0] * k
    T = a.seq_length * a.micro_batch_size
    extra = 0
    if stage == 0:
        extra += T * 16  # tokens, labels (int64)
    if stage == pp - 1:
        extra += T * a.vocab_size / t * 4 + T  # fp32 logits/softmax of one micro-batch, loss mask
        sp = t if a.sequence_parallel else 1
        act = 2 if a.bf16 else 4
        if a.transformer_impl == "local":  # final norm: input, normalised, output (+ fp32 rsqrt)
            extra += T / sp * (a.hidden_size * ((2 * 4 + act) if a.bf16 else 3 * act) + 4)
        else:
            extra += T / sp * (a.hidden_size * act + 4)
    total = w + g + o + acts + extra
    return {"stage": stage, "params": n, "weights": w, "grads": g, "optimizer": o,
            "activations": acts + extra, "of_which_payload": payload, "in_flight": k, "total": total}


# ------------------------------------------------------------------------- the router's share of a step
GPUS = {  # name: (HBM bytes/s, dense bf16 FLOP/s) - datasheet peaks
    "H100": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
    "B200": (8.0e12, 2250e12),
}
GEMM_EFFICIENCY = 0.75  # fraction of peak FLOP/s Megatron's GEMMs reach at these shapes (H200: ~790 of 989)
HBM_EFFICIENCY = 0.85   # fraction of peak bandwidth a streaming elementwise pass reaches
SHAPES = {  # the router-share shapes: the paper's 1B width (Qwen3-1.7B) and the 8B layer slice (Qwen3-8B)
    "1B": dict(num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8,
               kv_channels=128, seq_length=2048),
    "8B": dict(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8,
               kv_channels=128, seq_length=2048),
}


def _reads_per_router(plan):
    """Per receiving router of one micro-batch, per source it reads: (readers of that source value, whether
    this router is its first reader). A source a commit rewrites (modes.RoutedMode.rewritten_by_commit) is a new value at each read."""
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


def router_share(gpu, shape_name, mode, backend="torch", num_blocks=4, null_source=False, gate=False,
                 micro_batch=1, act_bytes=2, num_layers=None):
    """Predicted router time against the layers' GEMM time for one training step (one micro-batch):
    router bytes / (HBM x HBM_EFFICIENCY) vs GEMM FLOPs / (peak x GEMM_EFFICIENCY). Returns a dict with
    both times, the share of the step (router / (GEMM + router)) and the predicted tokens/s ratio to the
    baseline (GEMM / (GEMM + router): the baseline's step taken as its GEMMs). ``num_layers`` overrides
    the shape's (gpu_check's layer slice)."""
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
        kb = num_blocks if mode in BLOCK_MODES and L % num_blocks == 0 else L
        cfg = SimpleNamespace(residual=mode, num_layers=L, delta_num_blocks=kb, delta_sources="exact",
                              delta_gate="scalar" if gate else "none",
                              delta_router_kernels="fla" if backend == "fla" else "torch")
        plan = SourcePlan.from_config(cfg)
        router_s = router_bytes(plan, tokens, shape["hidden_size"], act_bytes, backend, null_source,
                                gate) / (bw * HBM_EFFICIENCY)
    return {"gpu": gpu, "shape": shape_name, "mode": mode, "backend": backend, "num_layers": L,
            "gemm_ms": gemm_s * 1e3, "router_ms": router_s * 1e3, "router_share": router_s / (gemm_s + router_s),
            "tokens_per_sec_ratio": gemm_s / (gemm_s + router_s)}


def router_share_table(gpu, shapes=("1B", "8B"), modes=ADDITIVE_MODES + REPLACEMENT_MODES):
    rows = [router_share(gpu, s, m, b) for s in shapes for m in modes for b in ("torch", "fla")]
    lines = [f"predicted router share of a training step on {gpu} (bf16, one micro-batch of 2048 tokens; "
             f"GEMMs at {GEMM_EFFICIENCY:.0%} of peak, HBM at {HBM_EFFICIENCY:.0%})",
             "| shape | mode | router backend | GEMM ms | router ms | router share | tokens/s x baseline |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['mode']} | {r['backend']} | {r['gemm_ms']:.1f} | {r['router_ms']:.2f} | "
                     f"{r['router_share']:.1%} | {r['tokens_per_sec_ratio']:.3f} |")
    return rows, "\n".join(lines)


def memory_plan(a):
    return {"config": {k: v for k, v in vars(a).items() if k != "json"},
            "stages": [plan_stage(a, s) for s in range(a.pipeline_model_parallel_size)],
            "boundaries": boundary_traffic(a) if a.pipeline_model_parallel_size > 1 else []}


def format_table(plan):
    c = plan["config"]
    head = (f"per-GPU memory plan: {c['residual']} | L {c['num_layers']} h {c['hidden_size']} ffn "
            f"{c['ffn_hidden_size']} heads {c['num_attention_heads']}/{c['num_query_groups']} seq "
            f"{c['seq_length']} mbs {c['micro_batch_size']} | TP {c['tensor_model_parallel_size']}"
            f"{'+SP' if c['sequence_parallel'] else ''} PP {c['pipeline_model_parallel_size']}"
            f"{' VPP ' + str(c['vpp']) if c['vpp'] else ''} DP {c['data_parallel_size']}"
            f"{' dist-opt' if c['use_distributed_optimizer'] else ''} | "
            f"{'fp8-' + c['fp8_format'] if c['fp8_format'] else 'bf16' if c['bf16'] else 'fp32'} "
            f"{c['transformer_impl']}")
    cols = ["stage", "params (M)", "weights", "grads", "optimizer", "activations", "(payload)", "in flight", "total GiB"]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in plan["stages"]:
        lines.append("| " + " | ".join([
            str(s["stage"]), f"{s['params'] / 1e6:,.0f}", f"{s['weights'] / GiB:.2f}", f"{s['grads'] / GiB:.2f}",
            f"{s['optimizer'] / GiB:.2f}", f"{s['activations'] / GiB:.2f}", f"{s['of_which_payload'] / GiB:.2f}",
            str(s["in_flight"]), f"{s['total'] / GiB:.2f}"]) + " |")
    lines.append("(GiB; + CUDA context, NCCL buffers, temporaries and fragmentation: plan 10-20 % headroom)")
    cached = any(b["bytes"] != b["bytes_without_cache"] for b in plan["boundaries"])
    for b in plan["boundaries"]:
        line = (f"payload into layer {b['first_layer']} (chunk {b['chunk']}): {b['tensors']} tensors = "
                f"{b['bytes'] / 2**20:.2f} MiB per micro-batch")
        if cached:
            line += f" (without the cache: {b['tensors_without_cache']} = {b['bytes_without_cache'] / 2**20:.2f} MiB)"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    a = parse(argv)
    if a.router_share:
        rows, table = router_share_table(a.router_share)
        print(table)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    plan = memory_plan(a)
    print(format_table(plan))
    text = json.dumps(plan, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
