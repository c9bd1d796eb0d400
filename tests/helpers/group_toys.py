"""The group router's toy configurations (tests/unit/test_group_router.py, tests/helpers/triton_cases.py): a
toy stack of L layers of width D per (mode, null source, gate, x_from_sources), its input, its pipeline or recompute
cuts, and one forward and backward through them."""
import torch
from torch.utils.checkpoint import checkpoint

from megatron_delta.core.sources import SourceBuffer, SourcePlan
from tests.helpers.toy_stack import EPS, Toy, sublayer

L, D, SEQ, BATCH = 3, 8, 3, 2
# (mode, null source, gate, x_from_sources): x kept as the sources (delta without a gate), x held (with the gate)
CONFIGS = [("delta", False, False, True), ("delta", True, False, True), ("delta", True, True, False),
           ("full_attnres", False, False, False), ("full_attnres", True, False, False)]
CUTS = {"none": (), "chunks": (1, 2), "chunk": (2,), "recompute": "recompute"}  # layer boundaries


def config_id(c):
    mode, null, gate, xs = c
    return f"{mode}{'-null' if null else ''}{'-gate' if gate else ''}{'-xsum' if xs else ''}"


def make_toy(mode, null, gate, xs, size, dtype=torch.float64, kernels="torch"):
    plan = SourcePlan(mode, L, L, x_from_sources=xs, router_group_size=size)
    toy = Toy(plan, D, null=null, gate=gate, seed=5, kernels=kernels)
    toy.weights = [w.detach().to(dtype).requires_grad_() for w in toy.weights]
    for r in toy.routers + ([toy.final] if toy.final else []):
        r.to(dtype)
    return toy


def make_h0(dtype, seq=SEQ, batch=BATCH):
    h0 = torch.randn(seq, batch, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return h0.to(dtype).requires_grad_()


def run_recompute(toy, h0, per):
    """Full recompute of ``per`` layers at a time (as DeltaTransformerBlock._checkpointed_layers): each
    checkpointed chunk rebuilds its buffer from explicit tensors, scoped to its layers' routers."""
    plan = toy.plan
    bounds = tuple(range(per, L, per))
    tensors = [h0]
    for first in range(0, L, per):
        def fn(*ts, first=first):
            buf = SourceBuffer.from_tensors(plan, first, ts, EPS, readers=toy.readers(first, bounds))
            for j in range(2 * first, 2 * min(first + per, L)):
                buf.commit(j, sublayer(buf.routed_input(j, toy.routers[j]), toy.weights[j]))
            return tuple(buf.to_tensors())
        tensors = checkpoint(fn, *tensors, use_reentrant=False)
    return SourceBuffer.from_tensors(plan, L, tensors, EPS, readers=toy.readers(L, bounds)).output(toy.final)


def forward_backward(toy, h0, cut):
    out = run_recompute(toy, h0, 2) if cut == "recompute" else toy.run(h0, cut)[0]
    leaves = toy.params() + [h0]
    go = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    return out, torch.autograd.grad(out, leaves, go, allow_unused=True)


def scope_runs(cut):
    """The sublayer runs of the buffers' scopes (chunks, or recompute chunks of 2 layers)."""
    bounds = [0] + (list(range(2, L, 2)) if cut == "recompute" else list(cut)) + [L]
    return [2 * (b - a) for a, b in zip(bounds, bounds[1:])]
