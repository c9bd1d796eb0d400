"""Test driver: one process group (one launch) runs one parallel layout for several residual modes.

Used by tests/test_parallel_parity.py, tests/test_checkpoints.py and tests/conversion_driver.py
through tests.dist_utils.run_distributed. Each `run_layout` call, on every rank:

  for each mode: (optionally) save the initial model under the current layout with
  `--train-iters 0 --save ROOT/init-MODE`, then train `iters` iterations from `--load ROOT/init-MODE
  --finetune` with the layout's flags, losses going to ROOT/TAG-MODE.jsonl (`--delta-metrics-file`).

Every run is pretrain_gpt.py's own code: megatron_delta.trainer.main.main (Megatron-LM's trainer,
megatron.training.pretrain); the model list of the last run is kept by the trainer (LAST_RUN) so
router parameters and gradients can be returned. Runs follow each other in one process
(torch.distributed is kept, megatron.training's globals are reset after each run).
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.flags import CPU, QWEN3  # noqa: E402

# The tiny model every parity test uses: 4 layers, hidden 64, 4 heads in 2 query groups, seq 32.
# NullTokenizer --vocab-size 256 (EOD = 255): 256 tokens pad to 256 under TP1 and TP2 alike (a checkpoint only
# loads into the same padded vocabulary).
COMMON = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4",
          "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "256", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1",
          "--lr-decay-iters", "20", "--lr-decay-style", "cosine", "--eval-iters", "1", "--eval-interval", "1000",
          "--log-interval", "1000", "--save-interval", "1000"] + QWEN3 + CPU

MODES = ("baseline", "delta", "delta_block", "attnres", "full_attnres")


def mode_flags(mode: str) -> list[str]:
    """K=2 blocks of 2 layers: under PP4 / PP2+VPP2 (one layer per chunk) every block straddles a
    stage boundary; under PP2 the boundary is a block boundary."""
    flags = ["--residual", mode]
    if mode in ("delta_block", "attnres"):
        flags += ["--delta-num-blocks", "2"]
    return flags


PAYLOADS: dict = {}  # {first global layer of a receiving chunk: dim-0 size of the payload it got}


def _record_payloads():
    """Wrap DeltaTransformerBlock.forward (once) to note the size of every received payload."""
    from megatron_delta.core.block import DeltaTransformerBlock

    if getattr(DeltaTransformerBlock.forward, "_records", False):
        return
    inner = DeltaTransformerBlock.forward

    def forward(self, *a, **k):
        if not self.pre_process and self.input_tensor is not None:
            PAYLOADS[self.first_layer] = int(self.input_tensor.shape[0])
        return inner(self, *a, **k)

    forward._records = True
    DeltaTransformerBlock.forward = forward


def _run(argv: list[str]):
    """pretrain_gpt.py's main on these flags; returns (result, model list, args) of the run."""
    import torch

    from megatron_delta.trainer import main as trainer

    _record_payloads()
    code = trainer.main(argv)
    assert code == 0, f"pretrain_gpt.py {' '.join(argv)} exited with {code}"
    run = trainer.LAST_RUN
    # The metrics file is written by the last rank only: no rank reads it before that rank is done.
    torch.distributed.barrier()
    iteration = run.args.consumed_train_samples // run.args.global_batch_size if run.args.train_iters else 0
    return {"iteration": iteration}, run.model, run.args


def read_losses(path: str, split: str | None = None) -> list[float]:
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "lm_loss" in r and r.get("split") == split:
                out.append(r["lm_loss"])
    return out


def router_state(model) -> dict:
    """{global name: [param values], ...} and grads (main_grad) of every router parameter on this rank."""
    from megatron_delta.core.block import DeltaTransformerBlock

    params, grads = {}, {}
    for chunk in model:
        inner = chunk.module if hasattr(chunk, "module") else chunk
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


def run_layout(root: str, tag: str, layout: list[str], modes: list[str], iters: int = 5,
               save_initial: bool = False, collect_routers: bool = False, extra: list[str] | None = None) -> dict:
    """See the module docstring. Returns {mode: {"losses": [...], "routers": {...}}} (losses on every rank)."""
    import torch

    extra = extra or []
    out = {}
    for mode in modes:
        init = os.path.join(root, f"init-{mode}")
        if save_initial:
            _run(COMMON + mode_flags(mode) + ["--train-iters", "0", "--save", init])
        metrics = os.path.join(root, f"{tag}-{mode}.jsonl")
        if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1 and os.path.exists(metrics):
            os.remove(metrics)
        PAYLOADS.clear()
        _, model, _ = _run(COMMON + mode_flags(mode) + layout + extra +
                           ["--train-iters", str(iters), "--load", init, "--finetune", "--delta-metrics-file", metrics])
        entry = {"losses": read_losses(metrics), "valid": read_losses(metrics, "valid"),
                 "payloads": {str(k): v for k, v in PAYLOADS.items()}}
        if collect_routers and mode != "baseline":
            entry["routers"] = router_state(model)
        out[mode] = entry
    return out


def train_and_save(root: str, tag: str, layout: list[str], modes: list[str], iters: int = 3) -> dict:
    """Train `iters` iterations from this layout's own initial model and save ROOT/ckpt-TAG-MODE;
    returns {mode: final validation loss}."""
    out = {}
    for mode in modes:
        metrics = os.path.join(root, f"save-{tag}-{mode}.jsonl")
        _run(COMMON + mode_flags(mode) + layout + ["--train-iters", str(iters), "--save",
                                                   os.path.join(root, f"ckpt-{tag}-{mode}"), "--delta-metrics-file", metrics])
        out[mode] = read_losses(metrics, "valid")[-1]
    return out


def load_and_evaluate(root: str, src_tag: str, tag: str, layout: list[str], modes: list[str]) -> dict:
    """Load ROOT/ckpt-SRC_TAG-MODE into this layout (weights only) and evaluate; {mode: valid loss}."""
    out = {}
    for mode in modes:
        metrics = os.path.join(root, f"eval-{src_tag}-in-{tag}-{mode}.jsonl")
        _run(COMMON + mode_flags(mode) + layout + ["--train-iters", "0", "--finetune", "--load",
                                                   os.path.join(root, f"ckpt-{src_tag}-{mode}"), "--delta-metrics-file", metrics])
        out[mode] = read_losses(metrics, "valid")[-1]
    return out


def resume_run(root: str, mode: str, iters: int = 20, split_at: int = 10) -> dict:
    """`iters` iterations straight (saving at `split_at`), then a second run that resumes from the
    iteration-`split_at` checkpoint with plain `--load`: returns both loss lists."""
    straight = os.path.join(root, f"straight-{mode}.jsonl")
    ckpt = os.path.join(root, f"resume-{mode}")
    _run(COMMON + mode_flags(mode) + ["--train-iters", str(iters), "--save", ckpt, "--save-interval",
                                      str(split_at), "--delta-metrics-file", straight])
    resumed = os.path.join(root, f"resumed-{mode}.jsonl")
    _, _, args = _run(COMMON + mode_flags(mode) + ["--train-iters", str(iters), "--load", ckpt,
                                                   "--ckpt-step", str(split_at), "--delta-metrics-file", resumed])
    return {"straight": read_losses(straight), "resumed": read_losses(resumed),
            "resumed_iterations": [json.loads(l)["iteration"] for l in open(resumed)
                                   if "lm_loss" in json.loads(l) and "split" not in json.loads(l)],
            "straight_lr": [json.loads(l)["lr"] for l in open(straight) if "lr" in json.loads(l)],
            "resumed_lr": [json.loads(l)["lr"] for l in open(resumed) if "lr" in json.loads(l)]}


RECOMPUTE_VARIANTS = {
    "none": [],
    "full_uniform_2": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    "full_uniform_1": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "full_block_3": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
    "selective": ["--recompute-granularity", "selective"],
}


def _grads(model) -> dict:
    out = {}
    for i, chunk in enumerate(model):
        for n, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            if g is not None:
                out[f"{i}.{n}"] = g.detach().double().reshape(-1).tolist()
    return out


def recompute_compare(root: str, modes: list[str], variants: list[str], iters: int = 3) -> dict:
    """Train `iters` iterations from the same seed with each recompute variant; return, per mode and
    variant, the losses and the largest |grad difference| to the variant 'none' (last iteration)."""
    out = {}
    for mode in modes:
        ref_grads = None
        out[mode] = {}
        for v in variants:
            metrics = os.path.join(root, f"recompute-{mode}-{v}.jsonl")
            if os.path.exists(metrics):
                os.remove(metrics)
            _, model, _ = _run(COMMON + mode_flags(mode) + RECOMPUTE_VARIANTS[v] +
                               ["--train-iters", str(iters), "--delta-metrics-file", metrics])
            grads = _grads(model)
            if ref_grads is None:
                ref_grads = grads
                gdiff = 0.0
            else:
                assert set(grads) == set(ref_grads)
                gdiff = max(max(abs(a - b) for a, b in zip(grads[k], ref_grads[k])) for k in grads)
            out[mode][v] = {"losses": read_losses(metrics), "max_grad_diff": gdiff}
    return out
