#!/usr/bin/env python
"""Per-GPU memory plan: weights, gradients, optimizer state and activations per pipeline stage.

    python tools/memory_plan.py --preset qwen3-8b                       # the paper's 8B run (sbatch)
    python tools/memory_plan.py --num-layers 36 --hidden-size 4096 ... --residual delta_block \
        --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --bf16 --world-size 16

Takes pretrain_gpt.py's model/parallel flags (plus --world-size) and prints a table and a JSON object
(--json FILE also writes it). No model is built and no Megatron code runs. "deferred stash (bwd)": the Triton
kernels' deferred block pass holds one block's router output gradients during backward (block modes,
--delta-router-kernels triton or auto, --device gpu; included in the total). The model:
megatron_delta/perf/memory_model.py (below); --router-share: megatron_delta/perf/cost_model.py.
"""

import argparse
import json
import sys

from megatron_delta.core.modes import KERNEL_CHOICES, RESIDUAL_MODES, SOURCE_DEFINITIONS
from megatron_delta.perf import cost_model, memory_model
from megatron_delta.perf.memory_model import GiB
from megatron_delta.perf.shapes import PRESETS


def build_parser():
    p = argparse.ArgumentParser(description=__doc__ + "\n" + memory_model.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--ffn-hidden-size", type=int, help="default 3 x hidden (SwiGLU)")
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-query-groups", type=int)
    p.add_argument("--kv-channels", type=int)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--residual", choices=RESIDUAL_MODES)
    p.add_argument("--mtp-num-layers", type=int, help="multi-token prediction depths (on the last stage)")
    p.add_argument("--delta-num-blocks", type=int)
    p.add_argument("--delta-sources", choices=SOURCE_DEFINITIONS)
    p.add_argument("--tensor-model-parallel-size", type=int)
    p.add_argument("--pipeline-model-parallel-size", type=int)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    p.add_argument("--delta-pp-source-cache", choices=["on", "off"],
                   help="interleaved schedule: a boundary sends only the sources the receiving rank lacks")
    p.add_argument("--num-experts", type=int, help="mixture of experts: experts per MoE layer")
    p.add_argument("--moe-ffn-hidden-size", type=int, help="an expert's FFN width (default --ffn-hidden-size)")
    p.add_argument("--moe-router-topk", type=int)
    p.add_argument("--moe-shared-expert-intermediate-size", type=int)
    p.add_argument("--moe-layer-freq", help="N (an MoE layer every N layers) or a 0/1 list, e.g. '([0]*1+[1]*3)'")
    p.add_argument("--expert-model-parallel-size", type=int)
    p.add_argument("--expert-tensor-parallel-size", type=int, help="default: --tensor-model-parallel-size")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    p.add_argument("--transformer-impl", choices=["local", "transformer_engine"],
                   help="default: transformer_engine with --bf16, else local")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--world-size", type=int, help="default TP x PP (DP 1)")
    p.add_argument("--delta-router-kernels", choices=KERNEL_CHOICES,
                   help="as pretrain_gpt.py's flag (default auto: on a GPU the Triton kernels, whose deferred block "
                        "pass is counted; fla: fla-core's kernel; c, torch: the PyTorch path on a GPU)")
    p.add_argument("--device", choices=["gpu", "cpu"],
                   help="cpu: the router's fp32 C kernels (delta_block keeps no partial block sums)")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--format", choices=["table", "json"], default="table",
                   help="table: the table, then (memory plan) the JSON; json: only the JSON (--router-share: "
                        "{shape: {mode: {backend: predicted tokens/s ratio}}})")
    p.add_argument("--router-share", choices=sorted(cost_model.GPUS), default=None,
                   help="instead: predict the router's share of a training step on this GPU from the counted "
                        "traffic of every pass (perf/cost_model.step_traffic): 1B and 8B shapes, every routed mode, "
                        "PyTorch path vs fla's fused kernel")
    p.set_defaults(**memory_model.PLAN_DEFAULTS)
    return p


def parse(argv=None):
    """The flags as a resolved plan config (memory_model.resolve_plan_config), --preset's values as defaults."""
    p = build_parser()
    pre, _ = p.parse_known_args(argv)
    if pre.preset:
        p.set_defaults(**PRESETS[pre.preset])
    try:
        return memory_model.resolve_plan_config(p.parse_args(argv))
    except memory_model.PlanError as e:
        p.error(str(e))


def format_router_share(gpu, rows):
    """Per shape and mode: the counted traffic of one step (u = one [tokens, hidden] bf16 tensor moved once) and
    the predicted tokens/s ratio to the baseline, one column pair per router backend."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    by_key = {}
    for r in rows:
        by_key.setdefault((r["shape"], r["mode"]), {})[r["backend"]] = r
    lines = [f"Predicted on {gpu}: bf16, one micro-batch of 2048 tokens, no recompute; GEMMs at "
             f"{cost_model.GEMM_EFFICIENCY:.0%} of peak, HBM at {cost_model.HBM_EFFICIENCY:.0%}; u = one [tokens, "
             f"hidden] tensor read or written once (perf/cost_model.step_traffic; triton's with its kernels' "
             f"per-program partial sums, {cost_model.triton_router_programs_per_sm()} programs per SM: "
             f"cost_model.reduction_u).", "",
             "| shape | mode | layers | " + " | ".join(f"{b} u/step" for b in backends) + " | "
             + " | ".join(f"{b} tokens/s x baseline" for b in backends) + " |",
             "|---|---|---|" + "---|" * (2 * len(backends))]
    for (shape, mode), per in by_key.items():
        first = next(iter(per.values()))
        lines.append(f"| {shape} | {mode} | {first['num_layers']} | "
                     + " | ".join(f"{per[b]['traffic_u']:,.0f}" for b in backends) + " | "
                     + " | ".join(f"{per[b]['tokens_per_sec_ratio']:.3f}" for b in backends) + " |")
    return "\n".join(lines)


def format_table(plan):
    c = plan["config"]
    head = (f"per-GPU memory plan: {c['residual']} | L {c['num_layers']} h {c['hidden_size']} ffn "
            f"{c['ffn_hidden_size']} heads {c['num_attention_heads']}/{c['num_query_groups']} seq "
            f"{c['seq_length']} mbs {c['micro_batch_size']} | TP {c['tensor_model_parallel_size']}"
            f"{'+SP' if c['sequence_parallel'] else ''} PP {c['pipeline_model_parallel_size']}"
            f"{' VPP ' + str(c['vpp']) if c['vpp'] else ''} DP {c['data_parallel_size']}"
            f"{' dist-opt' if c['use_distributed_optimizer'] else ''} | "
            f"{'fp8-' + c['fp8_format'] if c['fp8_format'] else 'bf16' if c['bf16'] else 'fp32'} "
            f"{c['transformer_impl']}{' | router ' + c['router_backend'] if c['router_backend'] else ''}")
    if c["num_experts"]:
        head += (f" | MoE: {sum(c['moe_layers'])} of {c['num_layers']} layers, {c['num_experts']} experts "
                 f"(ffn {c['moe_ffn_hidden_size']}) top-{c['moe_router_topk']}, EP {c['expert_model_parallel_size']}"
                 f" ETP {c['expert_tensor_parallel_size']}")
    cols = ["stage", "params (M)", "weights", "grads", "optimizer", "activations", "(payload)", "in flight",
            "deferred stash (bwd)", "total GiB"]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in plan["stages"]:
        lines.append("| " + " | ".join([
            str(s["stage"]), f"{s['params'] / 1e6:,.0f}", f"{s['weights'] / GiB:.2f}", f"{s['grads'] / GiB:.2f}",
            f"{s['optimizer'] / GiB:.2f}", f"{s['activations'] / GiB:.2f}", f"{s['of_which_payload'] / GiB:.2f}",
            str(s["in_flight"]), f"{s['deferred_block_stash'] / GiB:.2f}", f"{s['total'] / GiB:.2f}"]) + " |")
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
        rows = cost_model.router_share_rows(a.router_share)
        if a.format == "json":
            print(json.dumps(cost_model.router_share_ratios(a.router_share), indent=1))
        else:
            print(format_router_share(a.router_share, rows))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    plan = memory_model.memory_plan(a)
    if a.format == "table":
        print(format_table(plan))
    text = json.dumps(plan, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
