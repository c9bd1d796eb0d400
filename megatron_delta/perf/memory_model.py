"""Per-GPU memory model: weights, gradients, optimizer state and activations per pipeline stage.

A plan config is a namespace of pretrain_gpt.py's model and parallel fields (plus world_size and device,
PLAN_DEFAULTS): tools/memory_plan.py parses it from flags, plan_config() takes the fields as keywords, and
resolve_plan_config() derives the rest (FFN width, data-parallel size, micro-batches, virtual stages, K).
memory_plan() returns the per-stage plan and the pipeline boundaries' traffic. No model is built and no
Megatron code runs.

Model of the activations (bytes saved for backward per micro-batch, counted as unique storages):
- local backend: the tensors Megatron's local spec saves, counted on CPU (tests/unit/test_memory_plan.py
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
- Multi-token prediction (--mtp-num-layers D, on the last stage; docs/design.md section 1.7): per depth its
  parameters (enorm, hnorm, eh_proj [h, 2h] / TP, one layer, the final norm; in the replacement modes its
  three routers), the embedding on the last stage when PP > 1, and per micro-batch one layer's activations
  (baseline's layer; in the replacement modes + its routed inputs and per (source, reader) fp32 logits and
  weights over the decoder's final sources and its own), the eh_proj input [2h], its three norms and fp32
  logits [tokens, vocab / TP].
- Mixture of experts (--num-experts, in the layers --moe-layer-freq names): each rank holds E / EP experts, each
  split over the expert tensor-parallel size (ETP, default TP), the router (E x h) and the shared experts
  (split over TP). Per token an MoE layer saves the router's fp32 logits and probabilities [E], the top-k
  permuted copies of its input and of the expert outputs [k, h], and the SwiGLU tensors of the k expert MLPs
  (5 x the expert FFN / ETP each) and of the shared experts; balanced routing is assumed (each rank's experts
  get k x its tokens, whatever EP is). The distributed optimizer shards the expert parameters over the expert
  data-parallel size, world / (ETP x EP x PP).
- Weights: bf16 (2 B) + fp32 gradient buffer (4 B, Megatron's grad_reduce_in_fp32 with bf16) +
  Adam in fp32 (master weights, m, v: 12 B; fp32 training: m, v: 8 B), sharded over DP by
  --use-distributed-optimizer. Not counted: the CUDA context, NCCL buffers, allocator
  fragmentation and temporary buffers (add 10-20 %).
- Backward transient of the Triton kernels' deferred block pass (``deferred_block_stash``, block modes on a GPU with
  --delta-router-kernels triton, or auto: PyTorch's CUDA wheels ship Triton, so auto counts as triton; pass fla
  where your install lacks it): where group_plan.block_defers(R, C) says the R routers of a block in one buffer scope
  (a pipeline chunk here) defer the gradients of the C completed sources they read through KernelSinks, each
  router's backward stashes its output gradient ([tokens, h] in the activation dtype), three fp32 coefficients
  per token and completed source and its fp32 query [h] (BlockDeferral), and the block's pass releases them all.
  Backward runs one block at a time, so a stage holds at most its costliest block's stash, once (one micro-batch's
  backward at a time). It is added to the stage's activations and total: it is held while a micro-batch's
  backward runs, when the stage still holds the in-flight activations (an upper bound by at most the part of one
  micro-batch's activations that backward has already freed).
"""
import ast
from types import SimpleNamespace

from megatron_delta.core.modes import (
    BASELINE,
    BLOCK_MODES,
    GATES,
    KERNEL_CHOICES,
    REPLACEMENT_MODES,
    SOURCE_DEFINITIONS,
    check_delta_options,
)

GiB = 2**30

# A plan config's fields and their defaults (tools/memory_plan.py's flags, less --preset, --json and --router-share).
PLAN_DEFAULTS = dict(
    num_layers=4, hidden_size=128, ffn_hidden_size=None, num_attention_heads=4, num_query_groups=2, kv_channels=None,
    seq_length=128, vocab_size=32000, untie_embeddings_and_output_weights=False, residual=BASELINE,
    delta_num_blocks=None, delta_sources=SOURCE_DEFINITIONS[0], tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None, delta_pp_source_cache="on",
    sequence_parallel=False, use_distributed_optimizer=False, bf16=False, fp8_format=None, transformer_impl=None,
    micro_batch_size=1, global_batch_size=None, world_size=None, device="gpu", mtp_num_layers=None,
    num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2, moe_shared_expert_intermediate_size=None,
    moe_layer_freq=1, expert_model_parallel_size=1, expert_tensor_parallel_size=None, delta_router_kernels="auto")


class PlanError(ValueError):
    """A plan config whose parallel layout or blocks do not divide (the message names the flags)."""


def resolve_plan_config(a):
    """Derive a plan config's implied fields in place (FFN 3 x hidden, head width, backend, DP size, global
    batch, micro-batches, virtual stages, K) and return it; PlanError where the layout or the blocks do not divide."""
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
        raise PlanError("world size must be a multiple of TP x PP, and PP must divide --num-layers")
    a.data_parallel_size = a.world_size // (t * pp)
    if a.global_batch_size is None:
        a.global_batch_size = a.micro_batch_size * a.data_parallel_size
    a.num_microbatches = a.global_batch_size // (a.micro_batch_size * a.data_parallel_size)
    a.vpp = None
    if a.num_layers_per_virtual_pipeline_stage:
        a.vpp = a.num_layers // pp // a.num_layers_per_virtual_pipeline_stage
    if a.tensor_model_parallel_size == 1:
        a.sequence_parallel = False
    resolve_moe(a)
    if a.delta_router_kernels not in KERNEL_CHOICES:
        raise PlanError(f"--delta-router-kernels {a.delta_router_kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
    a.router_backend = router_backend(a)
    if a.residual in BLOCK_MODES:  # K as pretrain_gpt.py resolves it: given, or the default (at most 4 blocks)
        try:
            a.delta_num_blocks = check_delta_options(a.residual, a.num_layers, a.delta_num_blocks, False,
                                                     GATES[0], a.delta_sources)
        except ValueError as e:
            raise PlanError(str(e)) from None
    return a


def moe_layer_pattern(freq, num_layers: int) -> list:
    """--moe-layer-freq as Megatron-LM reads it: N (an MoE layer every N layers, from the first) or a list of 0/1
    per layer, also as Megatron-LM's expression string, e.g. "([0]*1+[1]*3)" (lists of 0/1, + and *)."""
    if isinstance(freq, str):
        try:
            freq = int(freq)
        except ValueError:
            freq = _list_expression(freq)
    if isinstance(freq, int):
        if freq < 1:
            raise PlanError(f"--moe-layer-freq {freq} must be a positive integer or a list of 0/1 per layer")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers or set(freq) - {0, 1}:
        raise PlanError(f"--moe-layer-freq {freq} must give 0 or 1 for each of the {num_layers} layers")
    return list(freq)


def _list_expression(text: str) -> list:
    """A list expression of integer lists, + and * (what Megatron-LM's --moe-layer-freq strings use), evaluated
    without eval."""
    def value(node):
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError
    try:
        out = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        out = None
    if not isinstance(out, list):
        raise PlanError(f"--moe-layer-freq {text!r} is not an integer or a list expression like '([0]*1+[1]*3)'")
    return out


def resolve_moe(a):
    """The MoE fields: the expert FFN (default --ffn-hidden-size, as Megatron-LM), ETP (default TP), the MoE layers'
    pattern; PlanError where EP does not divide the experts or ETP x EP x PP the world size."""
    a.moe_layers = [0] * a.num_layers
    if not a.num_experts:
        return
    if a.moe_ffn_hidden_size is None:
        a.moe_ffn_hidden_size = a.ffn_hidden_size
    if a.expert_tensor_parallel_size is None:
        a.expert_tensor_parallel_size = a.tensor_model_parallel_size
    ep, etp = a.expert_model_parallel_size, a.expert_tensor_parallel_size
    if a.num_experts % ep:
        raise PlanError(f"--expert-model-parallel-size {ep} must divide --num-experts {a.num_experts}")
    if a.world_size % (etp * ep * a.pipeline_model_parallel_size):
        raise PlanError("world size must be a multiple of expert TP x EP x PP")
    a.moe_layers = moe_layer_pattern(a.moe_layer_freq, a.num_layers)


def plan_config(**fields):
    """A resolved plan config from keyword fields (PLAN_DEFAULTS for the rest)."""
    unknown = sorted(set(fields) - set(PLAN_DEFAULTS))
    if unknown:
        raise TypeError(f"plan_config: unknown fields {unknown} (the fields are PLAN_DEFAULTS' keys)")
    return resolve_plan_config(SimpleNamespace(**{**PLAN_DEFAULTS, **fields}))


def router_backend(a):
    """What routes the sources on the planned device: 'triton' (the project's Triton kernels: --delta-router-kernels
    triton, or auto on a GPU, where PyTorch's CUDA wheels ship Triton), 'fla', 'c' (auto or c on CPU) or 'torch'
    (c on a GPU: the C kernels take CPU tensors only); None for the baseline."""
    if a.residual == BASELINE:
        return None
    k = a.delta_router_kernels
    if a.device == "gpu":
        return {"auto": "triton", "c": "torch"}.get(k, k)
    return "c" if k == "auto" else "torch" if k in ("triton", "fla") else k


def source_plan(a):
    if a.residual == BASELINE:
        return None
    from megatron_delta.core.sources import SourcePlan

    # x_from_sources as for the PyTorch, C and Triton paths (fla's running x stream is not modelled): the plan
    # reads its kernels' field only through router_backend
    return SourcePlan.from_config(SimpleNamespace(**{k: v for k, v in vars(a).items() if k != "delta_router_kernels"}))


# ----------------------------------------------------------------------------------- parameters
def layer_params(a, moe: bool = False):
    """(parameters divided by TP, replicated ones) of a dense layer, or of an MoE layer without its experts."""
    h, q, kv, f = (a.hidden_size, a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels,
                   a.ffn_hidden_size)
    tp_split = h * (q + 2 * kv) + q * h  # divided by TP
    replicated = 2 * h + 2 * a.kv_channels  # input norms, q/k norms
    if not moe:
        tp_split += h * 2 * f + f * h
    else:
        replicated += a.num_experts * h  # the router
        tp_split += 3 * h * (a.moe_shared_expert_intermediate_size or 0)  # shared experts (SwiGLU)
    if a.residual != BASELINE:
        replicated += 2 * 2 * h  # two routers: query + key-norm weight
    return tp_split, replicated


def expert_params(a):
    """Parameters of one MoE layer's experts on one rank: E / EP SwiGLU MLPs split over ETP."""
    return a.num_experts // a.expert_model_parallel_size * 3 * a.hidden_size * a.moe_ffn_hidden_size \
        / a.expert_tensor_parallel_size


def stage_layers(a, stage) -> list:
    """Global (0-based) numbers of the layers on pipeline stage `stage` (all its virtual chunks; even split)."""
    pp, chunks = a.pipeline_model_parallel_size, a.vpp or 1
    per_chunk = a.num_layers // (pp * chunks)
    return [(c * pp + stage) * per_chunk + i for c in range(chunks) for i in range(per_chunk)]


def stage_expert_params(a, stage):
    """The experts' parameters on one GPU of pipeline stage `stage` (sharded over the expert data-parallel ranks
    by the distributed optimizer)."""
    return sum(a.moe_layers[i] for i in stage_layers(a, stage)) * expert_params(a) if a.num_experts else 0


def stage_params(a, stage):
    """Parameters on one GPU of pipeline stage `stage` (all its virtual chunks), experts included."""
    t, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    n = stage_expert_params(a, stage)
    for i in stage_layers(a, stage):
        split, rep = layer_params(a, moe=bool(a.moe_layers[i]))
        n += split / t + rep
    vocab = a.vocab_size / t
    if stage == 0:
        n += vocab * a.hidden_size
    if stage == pp - 1:
        n += a.hidden_size  # final norm
        if a.residual in REPLACEMENT_MODES:
            n += 2 * a.hidden_size  # final router
        if a.untie_embeddings_and_output_weights or pp > 1:
            n += vocab * a.hidden_size  # output layer (a tied copy lives on the last stage when PP > 1)
        n += mtp_params(a)
    return n


def _mtp_own_sources(a):
    """The sources an MTP depth's routers read beyond the decoder's final ones (attention, MLP, final router):
    attnres one partial, full_attnres z and each output (docs/design.md section 1.7)."""
    return (1, 2, 3) if a.residual == "full_attnres" else (1, 1, 1)


def mtp_params(a):
    """Parameters of the MTP depths (last stage), the embedding they read included when PP > 1."""
    if not a.mtp_num_layers:
        return 0
    t, h = a.tensor_model_parallel_size, a.hidden_size
    split, rep = layer_params(SimpleNamespace(**{**vars(a), "residual": BASELINE}))  # Megatron's own layer
    per_depth = 3 * h + 2 * h * h / t + split / t + rep
    if a.residual in REPLACEMENT_MODES:
        per_depth += 3 * 2 * h  # the depth's two sublayer routers and its final router
    return a.mtp_num_layers * per_depth + (a.vocab_size / t * h if a.pipeline_model_parallel_size > 1 else 0)


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
                     # qk-norm/rope, qkv, SwiGLU, proj/fc2 inputs
                     + act * (3 * q + 3 * kv + (q + 2 * kv) + 4 * f) + gemm_in * (q + f)
                     + 4 * (2 / sp + heads + groups + heads))  # rsigma, q/k-norm stats, flash lse
        per_layer = 4 * 4 * dh * s
    total = num_layers * (per_token * T + per_layer)
    for i in range(first_layer, first_layer + num_layers):
        if a.moe_layers[i]:  # the dense MLP's SwiGLU tensors -> the router, the permuted tokens and the experts'
            e, k = a.num_experts, a.moe_router_topk
            fe, fs = a.moe_ffn_hidden_size / a.expert_tensor_parallel_size, (
                a.moe_shared_expert_intermediate_size or 0) / t
            total += T * (act * (k * (2 * h + 5 * fe) + 5 * fs - 5 * f) + 2 * 4 * e)
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


def block_deferrals(a, first_layer, num_layers):
    """The deferred block passes of one buffer scope (the layers first_layer .. +num_layers: a pipeline chunk) with
    the routers on the Triton kernels: per block whose routers defer (group_plan.block_defers), (block, R routers, C
    completed sources). As SourceBuffer does: a source read by several receivers of the scope gets a KernelSink at
    its first read there (a rename keeps it, a commit's new value gets its own); the block's first router in the
    scope defers the sources it reads through sinks."""
    from megatron_delta.core.group_plan import block_defers

    plan = source_plan(a)
    sublayers = range(2 * first_layer, 2 * (first_layer + num_layers))
    scope = set(sublayers) | ({"final"} if first_layer + num_layers == a.num_layers and plan.final_reads() else set())
    sinks, blocks = {}, []
    for j in sublayers:
        for name in plan.reads(j):
            if name not in sinks:
                sinks[name] = sum(k in scope for k in plan.value_readers(name, j)) > 1
        b = plan.block_of(j)
        if j == sublayers[0] or plan.block_of(j - 1) != b:  # the block's first router in the scope
            routers = sum(plan.block_of(k) == b for k in sublayers)
            shared = sum(sinks[name] for name in plan.reads(j))
            if shared and block_defers(routers, shared):
                blocks.append((b, routers, shared))
        old = plan.rules.rewritten_by_commit(j)
        if old is not None:
            new = plan.rules.renamed_by_routing(j)
            kept = sinks.pop(old, None)
            if new is not None and kept is not None:
                sinks[new] = kept
    return blocks


def deferred_block_stash(a, stage):
    """The backward transient of the Triton kernels' deferred block passes on pipeline stage ``stage`` (module
    docstring): the largest block's stash, R x ([T, h] output gradient + 3 x C fp32 coefficients per token + the
    [h] fp32 query), over the stage's chunks; 0 where no pass applies (not a block mode, not the Triton kernels)."""
    if a.residual not in BLOCK_MODES or a.router_backend != "triton":
        return 0
    pp, chunks = a.pipeline_model_parallel_size, a.vpp or 1
    per_chunk = a.num_layers // (pp * chunks)
    sp = a.tensor_model_parallel_size if a.sequence_parallel else 1
    T, h, act = a.seq_length * a.micro_batch_size / sp, a.hidden_size, 2 if a.bf16 else 4
    return max([r * (T * h * act + 3 * 4 * c * T + 4 * h)
                for ch in range(chunks) for _, r, c in block_deferrals(a, (ch * pp + stage) * per_chunk, per_chunk)],
               default=0)


def mtp_activation_bytes(a):
    """Bytes an MTP block saves for backward per micro-batch (all its depths; module docstring)."""
    if not a.mtp_num_layers:
        return 0
    t = a.tensor_model_parallel_size
    sp = t if a.sequence_parallel else 1
    T, h, act = a.seq_length * a.micro_batch_size, a.hidden_size, 2 if a.bf16 else 4
    base = SimpleNamespace(**{**vars(a), "residual": BASELINE})
    norm_h = ((2 * 4 + act) if a.bf16 else 3 * act) if a.transformer_impl == "local" else act
    per_depth = (layer_activation_bytes(base, 0, 1) + 3 * T / sp * (norm_h * h + 4) + act * 2 * h * T
                 + T * a.vocab_size / t * 4)
    plan = source_plan(a)
    if a.residual in REPLACEMENT_MODES:
        trunk = len(plan.final_reads())
        per_depth += 2 * act * h * T / sp  # the routed inputs of its two sublayers
        per_depth += sum(4 * (2 * (trunk + m) + 1) * T / sp for m in _mtp_own_sources(a))
    return a.mtp_num_layers * per_depth


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
    experts = stage_expert_params(a, stage)
    expert_dp = a.world_size // (a.expert_tensor_parallel_size * a.expert_model_parallel_size * pp) if experts else 1
    o = (n - experts) * (12 if a.bf16 else 8) / (a.data_parallel_size if a.use_distributed_optimizer else 1) \
        + experts * (12 if a.bf16 else 8) / (expert_dp if a.use_distributed_optimizer else 1)
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
        extra += mtp_activation_bytes(a)  # the MTP block of that micro-batch (last stage)
    stash = deferred_block_stash(a, stage)  # backward-time, one block at a time: on top of the activations
    total = w + g + o + acts + extra + stash
    return {"stage": stage, "params": n, "weights": w, "grads": g, "optimizer": o,
            "activations": acts + extra, "of_which_payload": payload, "in_flight": k,
            "deferred_block_stash": stash, "total": total}


def memory_plan(a):
    """The plan of a resolved config: its fields (less json), every stage's plan_stage and, with PP > 1, the
    boundaries' traffic (a JSON-ready dict)."""
    return {"config": {k: v for k, v in vars(a).items() if k != "json"},
            "stages": [plan_stage(a, s) for s in range(a.pipeline_model_parallel_size)],
            "boundaries": boundary_traffic(a) if a.pipeline_model_parallel_size > 1 else []}
