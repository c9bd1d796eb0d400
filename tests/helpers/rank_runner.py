"""The rank side of every multi-process training test: pretrain_gpt.py's own code (megatron_delta.trainer.main.main,
Megatron-LM's trainer) run on flags, one run after another in one process (torch.distributed is kept between
runs, megatron.training's globals are reset after each), launched by tests.helpers.dist_utils.run_distributed.

    train(argv, metrics)        one run; its metrics file read back (losses, lr, iterations, validation losses)
    read_metrics(path, key)     the one reader of --delta-metrics-file
    run_specs(root, tag, ...)   several configurations under one layout, each from its TP1 initial model

A configuration ("spec") is ``[L:]mode[/flavour]``: ``delta``, ``delta/authors-code`` (--delta-sources
authors-code), ``delta/gate`` (--delta-gate scalar), ``attnres/mtp`` (--mtp-num-layers 1), ``6:delta`` (6 layers
instead of 4). Every spec trains the tiny model of tests/helpers/flags.py (MODEL). Its initial model ROOT/init-SPEC is
saved under TP1 (`--train-iters 0 --save`) by the session's TP1 reference (tests/conftest.py) and every layout trains
ITERS iterations from it (`--load --finetune`) in one or more variants (VARIANTS: precision, router lr, source cache).

What a run used is recorded by wrapping the real forwards once: the dim-0 size of every payload a chunk received
from the previous pipeline stage (PAYLOADS), and the dtypes met at the decoder's input and output and the routers'
outputs (SEEN).
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers.flags import MODEL, mode_flags  # noqa: E402

# pretrain_gpt.py's flags of the tiny model; the runs log and save only when asked
COMMON = MODEL + ["--log-interval", "1000", "--save-interval", "1000"]
ITERS = 4
# Routers start at zero and, at the model's lr, move too little in a few iterations for their part of the function
# to stand out from bf16 rounding (logits ~0.03 off with the routers zeroed, against ~0.01 of bf16 rounding); x10
# moves them ~10x further, so a wrong router (in training, in a layout or in the export) shows.
ROUTER_LR = ["--delta-router-lr-mult", "10"]  # the *_r10 variants; not on baseline (it has no routers)

VARIANTS = {
    "fp32": [],
    "fp32_r10": ROUTER_LR,
    # the group router at S = 2 (delta and full_attnres only; tests/integration/test_parallel_parity.py's pp2 launch)
    "fp32_g2": ["--delta-router-group-size", "2"],
    "bf16_r10": ["--bf16"] + ROUTER_LR,
    # the pipeline source cache (tests/integration/test_source_cache.py)
    "off": ["--delta-pp-source-cache", "off"],
    "on": ["--delta-pp-source-cache", "on"],
    "on_recompute": ["--delta-pp-source-cache", "on", "--recompute-granularity", "full", "--recompute-method",
                     "uniform", "--recompute-num-layers", "1"],
    # fp32, the distributed optimizer in its fully reshardable checkpoint format, and a checkpoint at iteration 2
    # as well (with `save`: tests/integration/test_moe.py resumes and reshards it)
    "distopt_ckpt2": ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable", "--save-interval", "2"],
}
# MoE flavours (tests/integration/test_moe.py): Megatron-Core's MoE layers in layers 2-4 (the first one dense), 4
# experts, top-2, a shared expert, load-balancing and z-losses, the fp32 router; alltoall or allgather token dispatch.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq",
       "[0,1,1,1]", "--moe-shared-expert-intermediate-size", "32", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-router-dtype", "fp32"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "4", "--mscale", "1.0",
       "--mscale-all-dim", "1.0"]
DEEPSEEK_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq",
                "[0,1,1,1]", "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3", "--moe-router-num-groups",
                "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
                "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
                "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall"]
FLAVOURS = {"": [], "authors-code": ["--delta-sources", "authors-code"], "gate": ["--delta-gate", "scalar"],
            # untied: megatron-core 0.19.2 gives a tied model's MTP stage under PP > 1 an output-layer weight that
            # its sharded state dict refuses (NVIDIA/Megatron-LM PR #7577), so --load fails there in every mode
            "mtp": ["--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"],
            "moe": MOE + ["--moe-token-dispatcher-type", "alltoall"],
            "moe-allgather": MOE + ["--moe-token-dispatcher-type", "allgather"],
            # multi-latent attention (tests/unit/test_mla.py), DeepSeek-V3's shapes at a tiny size: query and key/value
            # latents (TP2 divides both down projections), YaRN rotary scaling (Megatron-LM's MLA default)
            "mla": MLA,
            # and DeepSeek-V3's MoE routing: sigmoid scores with the aux-loss-free expert bias, group-limited top-k,
            # scaled top-k weights, a shared expert, the first layer dense
            "mla-moe": MLA + DEEPSEEK_MOE}

PAYLOADS: dict = {}  # {first global layer of a receiving chunk: dim-0 size of the payload it got}
SEEN: dict = {}  # {what: set of dtype names} of the tensors met during the current run


def is_last_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1


def read_metrics(path: str, key: str = "lm_loss", split: str | None = None) -> list:
    """``key`` of the per-iteration records (split None) or of the evaluations (split "valid") in a
    --delta-metrics-file, in order; not the routing records. [] when there is no file."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("split") == split and "lm_loss" in r and key in r:
                out.append(r[key])
    return out


def read_records(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _note(what: str, t) -> None:
    import torch

    if isinstance(t, (tuple, list)):
        t = t[0] if t else None
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        SEEN.setdefault(what, set()).add(str(t.dtype).replace("torch.", ""))


def _instrument() -> None:
    """Wrap (once) the forwards of Megatron's TransformerBlock, the routed DeltaTransformerBlock and the routers (and
    SourceBuffer.route, through which the group router routes):
    note the received payload sizes and the dtypes of their inputs / outputs."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_delta.core.block import DeltaTransformerBlock
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer

    def wrap(cls, what, method="forward"):
        inner = getattr(cls, method)
        if getattr(inner, "_rank_runner_notes", False):
            return

        def forward(self, *a, **k):
            if what != "router":
                if not self.pre_process and self.input_tensor is not None:
                    if isinstance(self, DeltaTransformerBlock):
                        PAYLOADS[self.first_layer] = int(self.input_tensor.shape[0])
                    _note("block_input_from_previous_stage", self.input_tensor)
                else:
                    _note("block_input", k.get("hidden_states", a[0] if a else None))
            out = inner(self, *a, **k)
            _note(f"{what}_output", out)
            return out

        forward._rank_runner_notes = True
        setattr(cls, method, forward)

    wrap(TransformerBlock, "block")
    wrap(DeltaTransformerBlock, "block")
    wrap(DepthRouter, "router")
    wrap(SourceBuffer, "router", "route")  # the group router (delta, full_attnres) routes without DepthRouter.forward


def _read_config_docstrings_once() -> None:
    """Why: Megatron-LM's parser reads and AST-parses the source of ~26 config dataclasses for their fields' help
    text on every parse_args, twice a run (the trainer's and ft_integration's): ~0.3 s of a ~1 s test run. A class's
    docstrings do not change within a process, so the harness keeps each class's (the parser and its help text are
    unchanged)."""
    from megatron.training import argument_utils

    factory = argument_utils.ArgumentGroupFactory
    if getattr(factory._get_field_docstrings, "_rank_runner_cached", False):
        return
    parse, cache = factory._get_field_docstrings, {}

    def cached(self, cls):
        if cls not in cache:
            cache[cls] = parse(self, cls)
        return dict(cache[cls])

    cached._rank_runner_cached = True
    factory._get_field_docstrings = cached


def train(argv: list[str], metrics: str | None = None) -> dict:
    """pretrain_gpt.py's main on ``argv`` (+ --delta-metrics-file METRICS); asserts exit code 0. Returns the
    metrics read back (written by the last rank only: every rank waits for it) and the iteration reached."""
    import torch

    from megatron_delta.trainer import main as trainer

    _instrument()
    _read_config_docstrings_once()
    PAYLOADS.clear()
    SEEN.clear()
    if metrics is not None:
        if is_last_rank() and os.path.exists(metrics):
            os.remove(metrics)
        argv = argv + ["--delta-metrics-file", metrics]
    code = trainer.main(argv)
    assert code == 0, f"pretrain_gpt.py {' '.join(argv)} exited with {code}"
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    args = trainer.LAST_RUN.args
    out = {"iteration": args.consumed_train_samples // args.global_batch_size if args.train_iters else 0}
    if metrics is not None:
        out.update(losses=read_metrics(metrics), lr=read_metrics(metrics, "lr"),
                   iterations=read_metrics(metrics, "iteration"), valid=read_metrics(metrics, split="valid"))
    return out


def last_run():
    """The trainer's record of the last run (model chunks, optimizer, args)."""
    from megatron_delta.trainer import main as trainer

    return trainer.LAST_RUN


# ------------------------------------------------------------------------------------------- configurations
def parse_spec(spec: str) -> tuple[str, str, int]:
    """``[L:]mode[/flavour]`` -> (mode, flavour, number of layers)."""
    layers, _, rest = spec.rpartition(":")
    mode, _, flavour = rest.partition("/")
    return mode, flavour, int(layers or 4)


def spec_flags(spec: str) -> list[str]:
    """The model and mode flags of a configuration (the common flags included)."""
    mode, flavour, layers = parse_spec(spec)
    model = list(COMMON)
    model[model.index("--num-layers") + 1] = str(layers)
    if "--multi-latent-attention" in FLAVOURS[flavour]:  # Megatron-LM refuses it with grouped-query attention
        model.remove("--group-query-attention")
        del model[model.index("--num-query-groups"):model.index("--num-query-groups") + 2]
    return model + mode_flags(mode, layers) + FLAVOURS[flavour]


def variant_flags(spec: str, variant: str) -> list[str]:
    flags = list(VARIANTS[variant])
    if parse_spec(spec)[0] == "baseline" and ROUTER_LR[0] in flags:
        i = flags.index(ROUTER_LR[0])
        del flags[i:i + 2]
    return flags


def data_cache(root: str) -> list[str]:
    """Megatron-LM's --data-cache-path under ROOT: the mock dataset's sample indices are built by the first run
    and read back by the others (the same indices; building them costs every rank ~0.2 s per virtual stage)."""
    return ["--data-cache-path", os.path.join(root, "data-cache")]


def init_dir(root: str, spec: str) -> str:
    return os.path.join(root, "init-" + spec.replace("/", "-").replace(":", "L"))


def router_state(model) -> dict:
    """{global name: [param values], ...} and grads (main_grad) of every router parameter on this rank."""
    from megatron.core.utils import unwrap_model

    from megatron_delta.core.block import DeltaTransformerBlock

    params, grads = {}, {}
    for inner in unwrap_model(list(model)):
        dec = getattr(inner, "decoder", None)
        if not isinstance(dec, DeltaTransformerBlock):
            continue
        named = []
        for layer in dec.layers:
            for n, p in layer.named_parameters():
                if getattr(p, "is_delta_router", False):
                    named.append((f"layer{layer.layer_number}.{n}", p))
        if dec.final_router is not None:
            named += [(f"final.{n}", p) for n, p in dec.final_router.named_parameters()]
        for name, p in named:
            params[name] = p.detach().double().reshape(-1).tolist()
            g = getattr(p, "main_grad", None)
            if g is not None:
                grads[name] = g.detach().double().reshape(-1).tolist()
    return {"params": params, "grads": grads}


def all_grads(model) -> dict:
    """{global parameter name: main_grad values} of this rank's chunks (a decoder layer named by its global
    number), DDP and Float16Module wrappers off."""
    from megatron.core.utils import unwrap_model

    out = {}
    for inner in unwrap_model(list(model)):
        for n, p in inner.named_parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                continue
            key = n
            if n.startswith("decoder.layers."):  # local index -> the layer's global number
                idx, rest = n[len("decoder.layers."):].split(".", 1)
                key = f"layer{inner.decoder.layers[int(idx)].layer_number}.{rest}"
            out[key] = g.detach().double().reshape(-1).tolist()
    return out


def dtypes(model, optimizer) -> dict:
    """{"model": {router|other: dtypes}, "main": {router|other: dtypes}} of this rank's parameters."""
    out = {"model": {}, "main": {}}
    router_ids = set()
    for chunk in model:
        for _, p in chunk.named_parameters():
            kind = "router" if getattr(p, "is_delta_router", False) else "other"
            if kind == "router":
                router_ids.add(id(p))
            out["model"].setdefault(kind, set()).add(str(p.dtype).replace("torch.", ""))
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        # Megatron's mixed-precision optimizer keeps [model param, main param] pairs: fp32 copies of the bf16
        # params (fp32_from_float16_groups) and the fp32 params themselves (fp32_from_fp32_groups).
        model_groups = getattr(opt, "float16_groups", None)
        for g16, g32 in zip(model_groups or [], getattr(opt, "fp32_from_float16_groups", None) or []):
            for pm, pmain in zip(g16, g32):
                kind = "router" if id(pm) in router_ids else "other"
                out["main"].setdefault(kind, set()).add(str(pmain.dtype).replace("torch.", ""))
        for g in getattr(opt, "fp32_from_fp32_groups", None) or []:
            for p in g:
                kind = "router" if id(p) in router_ids else "other"
                out["main"].setdefault(kind, set()).add(str(p.dtype).replace("torch.", ""))
        if model_groups is None:  # fp32: Adam updates the model's params
            for g in opt.param_groups:
                for p in g["params"]:
                    kind = "router" if id(p) in router_ids else "other"
                    out["main"].setdefault(kind, set()).add(str(p.dtype).replace("torch.", ""))
    return {k: {kk: sorted(vv) for kk, vv in v.items()} for k, v in out.items()}


def run_specs(root: str, tag: str, layout: list[str], runs: list[list[str]], iters: int = ITERS,
              collect: list[str] = (), save: list[str] = ()) -> dict:
    """Each [spec, variant] of ``runs`` trains ``iters`` iterations from ROOT/init-SPEC (saved here first, under
    this layout, where it does not exist: the TP1 reference's job) under ``layout`` + VARIANTS[variant]; the
    variants in ``save`` save ROOT/ckpt-TAG-VARIANT-SPEC at the end. Returns, on every rank,
    {spec: {variant: {"losses", "lr", "iterations", "valid", "payloads", + what ``collect`` names}}}:
    "routers" (router_state), "grads" (all_grads), "dtypes" (of the parameters, the optimizer's main
    parameters and the activations seen), "cache" (source caches linked on the rank and micro-batches left)."""
    import torch

    out = {}
    for spec, variant in runs:
        init = init_dir(root, spec)
        if not os.path.exists(init):
            train(spec_flags(spec) + data_cache(root) + ["--train-iters", "0", "--save", init])
        name = spec.replace("/", "-").replace(":", "L")
        saving = ["--save", os.path.join(root, f"ckpt-{tag}-{variant}-{name}")] if variant in save else []
        r = train(spec_flags(spec) + layout + variant_flags(spec, variant) + saving + data_cache(root) +
                  ["--train-iters", str(iters), "--load", init, "--finetune"],
                  os.path.join(root, f"{tag}-{variant}-{name}.jsonl"))
        entry = {k: r[k] for k in ("losses", "lr", "iterations", "valid")}
        entry["payloads"] = {str(k): v for k, v in PAYLOADS.items()}
        # the routing statistics of the final validation (routed modes; written by the last rank)
        entry["routing"] = [rec["routing"] for rec in read_records(os.path.join(root, f"{tag}-{variant}-{name}.jsonl"))
                            if "routing" in rec]
        run = last_run()
        if "routers" in collect and parse_spec(spec)[0] != "baseline":
            entry["routers"] = router_state(run.model)
        if "grads" in collect:
            entry["grads"] = all_grads(run.model)
        if "dtypes" in collect:
            entry["dtypes"] = dtypes(run.model, run.optimizer)
            entry["seen"] = {k: sorted(v) for k, v in SEEN.items()}
        if "cache" in collect:
            from megatron.core.utils import unwrap_model

            caches = {id(c.decoder.source_cache): c.decoder.source_cache for c in unwrap_model(list(run.model))
                      if getattr(c.decoder, "source_cache", None) is not None}
            entry["cache"] = {"linked": len(caches), "in_flight": sum(c.in_flight for c in caches.values())}
        out.setdefault(spec, {})[variant] = entry
        torch.distributed.barrier()
    return out


def run_layouts(root: str, launches: list, iters: int = ITERS, collect: list[str] = (), save: list[str] = ()) -> dict:
    """run_specs for each [tag, layout, runs] of ``launches``, one after another in this one launch (the layouts
    share the world size; Megatron's parallel state is rebuilt for every run): {tag: run_specs' result}. One
    launch instead of one per layout saves each further launch's start-up (every rank imports torch and Megatron)."""
    return {tag: run_specs(root, tag, layout, runs, iters, collect, save) for tag, layout, runs in launches}


# ----------------------------------------------------------------------------------------- other launches
_FULL = ["--recompute-granularity", "full", "--recompute-method"]
RECOMPUTE_VARIANTS = {
    "none": [],
    "full_uniform_2": _FULL + ["uniform", "--recompute-num-layers", "2"],
    "full_uniform_1": _FULL + ["uniform", "--recompute-num-layers", "1"],
    "full_block_3": _FULL + ["block", "--recompute-num-layers", "3"],
    "selective": ["--recompute-granularity", "selective"],
}


def recompute_compare(root: str, modes: list[str], variants: list[str], iters: int = 2) -> dict:
    """Train `iters` iterations from the same seed with each recompute variant; return, per mode and variant, the
    losses and the largest |grad difference| to the variant 'none' (last iteration: its gradients went through
    the recomputed forward, its loss through the previous iteration's update)."""
    out = {}
    for mode in modes:
        ref_grads = None
        out[mode] = {}
        for v in variants:
            r = train(spec_flags(mode) + RECOMPUTE_VARIANTS[v] + data_cache(root) + ["--train-iters", str(iters)],
                      os.path.join(root, f"recompute-{mode.replace('/', '-')}-{v}.jsonl"))
            grads = all_grads(last_run().model)
            if ref_grads is None:
                ref_grads, gdiff = grads, 0.0
            else:
                assert set(grads) == set(ref_grads)
                gdiff = max(max(abs(a - b) for a, b in zip(grads[k], ref_grads[k])) for k in grads)
            out[mode][v] = {"losses": r["losses"], "max_grad_diff": gdiff}
    return out


def checkpoint_swap(root: str, layout: list[str], mode: str, iters: int = 4) -> dict:
    """For (a, b) = (on, off) and (off, on) of --delta-pp-source-cache: `iters` iterations straight with the cache
    `a`, saving half-way; then a run with the cache `b` that resumes from the half-way checkpoint. Both loss
    lists of each."""
    out = {}
    half = iters // 2
    for first, second in (("on", "off"), ("off", "on")):
        ckpt = os.path.join(root, f"swap-{mode}-{first}")
        straight = train(spec_flags(mode) + layout + VARIANTS[first] + data_cache(root) + [
            "--train-iters", str(iters), "--save", ckpt, "--save-interval", str(half)],
            os.path.join(root, f"swap-{mode}-{first}.jsonl"))
        resumed = train(spec_flags(mode) + layout + VARIANTS[second] + data_cache(root) + [
            "--train-iters", str(iters), "--load", ckpt, "--ckpt-step", str(half)],
            os.path.join(root, f"swap-{mode}-{first}-{second}.jsonl"))
        out[f"{first}->{second}"] = {"straight": straight["losses"], "resumed": resumed["losses"]}
    return out


def train_all(argvs: list[list[str]]) -> list[dict]:
    """Run each argv (pretrain_gpt flags, with --save) on this rank in turn; returns each run's result
    (tests/integration/test_conversion.py: several models in one multi-process launch)."""
    import torch

    torch.set_num_threads(1)
    return [train(argv) for argv in argvs]
