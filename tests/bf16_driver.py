"""Rank functions for tests/test_bf16.py: `--bf16` runs of pretrain_gpt.py's trainer next to the same runs
in fp32, every residual mode in one launch (tests.parity_driver's tiny model, runner and loss reader).

    run_distributed(bf16_driver.run_modes, WORLD, root, tag, layout_flags, modes, iters, precisions, ...)

Besides the losses, each run reports the dtypes it really used: of every parameter (router or not) in the
built model and in the optimizer (the main params Adam updates), and of the tensors that crossed the
decoder block and the routers during training (instrumented by wrapping the real forwards, as
parity_driver._record_payloads does).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.parity_driver import COMMON, _run, mode_flags, read_losses  # noqa: E402

PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}
# Routers start at zero and, at the model's lr, move too little in a few iterations for their part of the
# function to stand out from bf16 rounding (logits ~0.03 off with the routers zeroed, against ~0.01 of bf16
# rounding); x10 moves them ~10x further, so a wrong router (in training or in the export) shows.
ROUTED_EXTRA = ["--delta-router-lr-mult", "10"]

SEEN: dict = {}  # {what: set of dtype names} of the tensors met during the current run


def _note(what: str, t) -> None:
    import torch

    if isinstance(t, (tuple, list)):
        t = t[0] if t else None
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        SEEN.setdefault(what, set()).add(str(t.dtype).replace("torch.", ""))


def _instrument() -> None:
    """Wrap (once) the forwards of Megatron's TransformerBlock, the routed DeltaTransformerBlock and the
    routers to note the dtypes of their inputs / outputs."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_delta.core.block import DeltaTransformerBlock
    from megatron_delta.core.router import DepthRouter

    def wrap(cls, what):
        inner = cls.forward
        if getattr(inner, "_bf16_notes", False):
            return

        def forward(self, *a, **k):
            if what != "router":
                if not self.pre_process and self.input_tensor is not None:
                    _note("block_input_from_previous_stage", self.input_tensor)
                else:
                    _note("block_input", k.get("hidden_states", a[0] if a else None))
            out = inner(self, *a, **k)
            _note(f"{what}_output", out)
            return out

        forward._bf16_notes = True
        cls.forward = forward

    wrap(TransformerBlock, "block")
    wrap(DeltaTransformerBlock, "block")
    wrap(DepthRouter, "router")


def _dtypes(model, optimizer) -> dict:
    """{"model": {router|other: dtypes}, "main": {router|other: dtypes}} of this rank's parameters."""
    out = {"model": {}, "main": {}}
    router_ids = set()
    for chunk in model:
        for name, p in chunk.named_parameters():
            kind = "router" if getattr(p, "is_delta_router", False) else "other"
            if kind == "router":
                router_ids.add(id(p))
            out["model"].setdefault(kind, set()).add(str(p.dtype).replace("torch.", ""))
    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in opts:
        # Megatron's mixed-precision optimizer keeps [model param, main param] pairs: fp32 copies of the
        # bf16 params (fp32_from_float16_groups) and the fp32 params themselves (fp32_from_fp32_groups).
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


def run_modes(root: str, tag: str, layout: list[str], modes: list[str], iters: int, precisions: list[str],
              save_initial: bool = False, save_trained: list[str] = ()) -> dict:
    """For each mode: (optionally) save ROOT/init-MODE (fp32, this layout's first run: `--train-iters 0 --save`),
    then train `iters` iterations from it (`--load --finetune`) under `layout` in each precision; the runs of
    the precisions in `save_trained` save ROOT/ckpt-TAG-PREC-MODE at the end. Returns, on every rank,
    {mode: {prec: {"losses", "dtypes", "seen"}}}."""
    import torch

    _instrument()
    out = {}
    for mode in modes:
        init = os.path.join(root, f"init-{mode}")
        if save_initial:
            _run(COMMON + mode_flags(mode) + ["--train-iters", "0", "--save", init])
        out[mode] = {}
        for prec in precisions:
            metrics = os.path.join(root, f"{tag}-{prec}-{mode}.jsonl")
            if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1 and os.path.exists(metrics):
                os.remove(metrics)
            save = (["--save", os.path.join(root, f"ckpt-{tag}-{prec}-{mode}")] if prec in save_trained else [])
            SEEN.clear()
            extra = [] if mode == "baseline" else ROUTED_EXTRA
            _, model, _ = _run(COMMON + mode_flags(mode) + extra + layout + PRECISIONS[prec] + save +
                               ["--train-iters", str(iters), "--load", init, "--finetune",
                                "--delta-metrics-file", metrics])
            from megatron_delta.trainer import main as trainer

            out[mode][prec] = {"losses": read_losses(metrics), "dtypes": _dtypes(model, trainer.LAST_RUN.optimizer),
                               "seen": {k: sorted(v) for k, v in SEEN.items()}}
            torch.distributed.barrier()
    return out
