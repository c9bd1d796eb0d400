"""Tools/gpu_check.py's throughput runs set beside the cost model and the targets: each run's tokens/s and peak
memory ratios to a baseline run the same way (eager, or CUDA graphs), the cost model's predicted ratio
(perf/cost_model.router_share), the ratio carried to the shape's full depth where a layer slice ran
(full_depth_ratio), the baseline's pace against its GEMMs, the memory plan, and the targets (target: per GPU, BF16,
on the project's Triton kernels). ``env``: gpu_check's Env (dry, gpu_kind, shapes, impl)."""
from megatron_delta.core.modes import BASELINE, BLOCK_MODES, DELTA, DELTA_BLOCK
from megatron_delta.perf import cost_model, memory_model
from megatron_delta.perf.routed_stream import NUM_BLOCKS
from megatron_delta.perf.shapes import SHAPES as MODEL_SHAPES

# (tokens/s ratio at the shape's full depth, peak memory ratio or None) of the runs with targets; per GPU where
# GPU_TOKENS_TARGETS sets the tokens/s target (the router at the memory floor: delta_block at the 8B shape, delta
# at 1B), TARGETS' elsewhere.
TARGETS = {("8B", DELTA_BLOCK): (0.95, 1.10), ("1B", DELTA): (0.85, None)}
GPU_TOKENS_TARGETS = {"H100": {("8B", DELTA_BLOCK): 0.95, ("1B", DELTA): 0.83},
                      "H200": {("8B", DELTA_BLOCK): 0.96, ("1B", DELTA): 0.87}}


def target(gpu, shape_name, mode):
    """The target of a run on the Triton kernels on ``gpu`` (cost_model.GPUS key): (tokens/s ratio at full depth,
    peak memory ratio or None), or None where the run has none."""
    t = TARGETS.get((shape_name, mode))
    if t is None:
        return None
    return GPU_TOKENS_TARGETS.get(gpu, {}).get((shape_name, mode), t[0]), t[1]


def layers_that_fit(shape, total_bytes, frac=0.8, transformer_impl="transformer_engine"):
    """The most layers of the 8B slice, a multiple of NUM_BLOCKS up to its 36, whose memory plan (delta,
    the hungriest mode, bf16, on ``transformer_impl``'s layers) fits in ``frac`` of ``total_bytes`` (this GPU's
    memory); NUM_BLOCKS at the least (the run then fails and says so where even that does not fit)."""
    best = NUM_BLOCKS
    for L in range(NUM_BLOCKS, MODEL_SHAPES["8B"]["num_layers"] + 1, NUM_BLOCKS):
        if planned_bytes(shape, L, DELTA, transformer_impl) * 1.15 <= frac * total_bytes:
            best = L
    return best


def planned_bytes(shape, num_layers, mode, transformer_impl):
    """Tools/memory_plan.py's memory per GPU (bytes) for a model of a throughput run's ``shape`` with
    ``num_layers`` layers, ``mode`` (the block modes with K = NUM_BLOCKS), bf16, on ``transformer_impl``'s layers,
    one micro-batch."""
    a = memory_model.plan_config(num_layers=num_layers, hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
                                 num_attention_heads=shape["heads"], num_query_groups=shape["groups"],
                                 seq_length=shape["seq"], residual=mode, bf16=True, transformer_impl=transformer_impl,
                                 untie_embeddings_and_output_weights=True,
                                 **({"delta_num_blocks": NUM_BLOCKS} if mode in BLOCK_MODES else {}))
    return memory_model.memory_plan(a)["stages"][0]["total"]


def speed_shape(opts, env, shape_name):
    """The throughput runs' shape ``shape_name`` on this machine, its layer count settled (--num-layers-8b, else
    as many as fit)."""
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
    """A run's milliseconds per micro-batch (one [seq] sequence) from its tokens/s."""
    return 1e3 * env.shapes[shape_name]["seq"] / run["tokens_per_sec"]


def gemm_pace(env, base, shape_name, num_layers):
    """The baseline run ``base``'s pace against its GEMMs alone at the cost model's rate (cost_model.router_share:
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
    """Run ``r``'s tokens/s ratio against a baseline at its GEMMs' pace (the step the predictions take the
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
    """Tools/memory_plan.py's memory per GPU (GiB) for a throughput run: its shape, mode and layers, bf16, this run's
    layers (TE or local), one micro-batch in flight (None in the dry run: no peak to set it beside)."""
    return None if env.dry else planned_bytes(env.shapes[shape_name], num_layers, mode, env.impl) / 2**30


def full_depth_ratio(measured, predicted_slice, predicted_full):
    """The tokens/s ratio at the shape's full depth that a layer slice's measurement implies. The router's
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
    """Set the run ``r``'s throughput and peak-memory ratios to the baseline run ``base``, the predicted ratio
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
    goal = target(env.gpu_kind(), shape_name, mode) if kernels == "triton" else None
    if goal and not env.dry:
        r["target_ok"] = (r["full_depth_ratio"] is not None and r["full_depth_ratio"] >= goal[0]
                          and (goal[1] is None or r["peak_mem_ratio"] <= goal[1]))
    return goal
