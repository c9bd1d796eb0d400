"""Test driver for the pipeline source cache (tests/test_source_cache.py): one launch trains every routed mode
under one interleaved layout with --delta-pp-source-cache off and on (and variants), from one initial model
per mode, and returns losses, every gradient of the last iteration, and the bytes each boundary received.

Every run is pretrain_gpt.py's own code (tests/parity_driver.py's _run); the received payload sizes come from
parity_driver's record of DeltaTransformerBlock.forward.
"""
from __future__ import annotations

import os

from tests import parity_driver as driver

VARIANTS = {
    "default": [],
    "off": ["--delta-pp-source-cache", "off"],
    "on": ["--delta-pp-source-cache", "on"],
    "on_recompute": ["--delta-pp-source-cache", "on", "--recompute-granularity", "full", "--recompute-method",
                     "uniform", "--recompute-num-layers", "1"],
}


def mode_flags(mode: str) -> list[str]:
    """parity_driver's flags of a mode; ``mode/authors-code`` and ``mode/gate`` add --delta-sources authors-code
    or --delta-gate scalar (the gate keeps x, which always travels)."""
    name, _, variant = mode.partition("/")
    extra = {"": [], "authors-code": ["--delta-sources", "authors-code"], "gate": ["--delta-gate", "scalar"]}[variant]
    return driver.mode_flags(name) + extra


def _grads(model) -> dict:
    """{global parameter name: main_grad values} of this rank's chunks (name: chunk's decoder layer numbers)."""
    out = {}
    for inner in _inner(model):
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


def compare(root: str, tag: str, layout: list[str], modes: list[str], variants: list[str], iters: int = 3,
            extra: list[str] | None = None, init_tag: str | None = None) -> dict:
    """Per mode and variant: losses, last-iteration gradients, {first layer of a receiving chunk: payload
    dim-0 size received}, and the number of micro-batches the rank's cache still held at the end. Every run
    starts from ROOT/init-INIT_TAG-MODE (saved here under the launch's default layout when init_tag is None)."""
    extra = extra or []
    out = {}
    for mode in modes:
        init = os.path.join(root, f"init-{init_tag or tag}-{mode.replace('/', '-')}")
        if init_tag is None:
            driver._run(driver.COMMON + extra + mode_flags(mode) + ["--train-iters", "0", "--save", init])
        out[mode] = {}
        for v in variants:
            metrics = os.path.join(root, f"{tag}-{mode.replace('/', '-')}-{v}.jsonl")
            if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1 and \
                    os.path.exists(metrics):
                os.remove(metrics)
            driver.PAYLOADS.clear()
            _, model, _ = driver._run(driver.COMMON + extra + mode_flags(mode) + layout + VARIANTS[v] +
                                      ["--train-iters", str(iters), "--load", init, "--finetune",
                                       "--delta-metrics-file", metrics])
            caches = {id(c.decoder.source_cache): c.decoder.source_cache for c in _inner(model)
                      if getattr(c.decoder, "source_cache", None) is not None}
            out[mode][v] = {"losses": driver.read_losses(metrics), "valid": driver.read_losses(metrics, "valid"),
                            "grads": _grads(model),
                            "payloads": {str(k): n for k, n in driver.PAYLOADS.items()},
                            "linked": len(caches), "in_flight": sum(c.in_flight for c in caches.values())}
    return out


def _inner(model):
    """The GPT models of the rank's chunks, DDP and Float16Module wrappers off."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model))


def checkpoint_swap(root: str, layout: list[str], mode: str, iters: int = 4) -> dict:
    """For (a, b) = (on, off) and (off, on): `iters` iterations straight with the cache `a`, saving half-way;
    then a run with the cache `b` that resumes from the half-way checkpoint. Both loss lists of each."""
    out = {}
    half = iters // 2
    for first, second in (("on", "off"), ("off", "on")):
        ckpt = os.path.join(root, f"swap-{mode}-{first}")
        straight = os.path.join(root, f"swap-{mode}-{first}.jsonl")
        driver._run(driver.COMMON + driver.mode_flags(mode) + layout + VARIANTS[first] +
                    ["--train-iters", str(iters), "--save", ckpt, "--save-interval", str(half),
                     "--delta-metrics-file", straight])
        resumed = os.path.join(root, f"swap-{mode}-{first}-{second}.jsonl")
        driver._run(driver.COMMON + driver.mode_flags(mode) + layout + VARIANTS[second] +
                    ["--train-iters", str(iters), "--load", ckpt, "--ckpt-step", str(half),
                     "--delta-metrics-file", resumed])
        out[f"{first}->{second}"] = {"straight": driver.read_losses(straight), "resumed": driver.read_losses(resumed)}
    return out
