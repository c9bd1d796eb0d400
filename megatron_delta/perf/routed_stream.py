"""A mode's routed stream alone: the project's SourceBuffer and routers over identity sublayers (each sublayer's
output is its routed input, so no GEMM runs), one [seq, 1, hidden] micro-batch, forward + backward. What the
router measurements run (perf/host_work.py's host time per call, perf/kernel_rates.py's rates and kernel times,
perf/kernel_resources.py's launches) and what the CUDA tests capture and replay (tests/gpu/)."""

NUM_BLOCKS = 4  # K of the block modes where it divides the layers: the targets' K (perf/gpu_check.NUM_BLOCKS)


def routed_stream(mode, layers, kernels, group_size, seq, hidden, device, dtype=None, seed=8, every_gradient=False,
                  sublayer=None):
    """``mode``'s routed stream over ``layers`` layers (x the sum of the sources in the additive modes; K = 4 blocks
    where 4 divides ``layers`` in the block modes; the replacement modes' final router routes after the last
    layer), routers on ``kernels`` with --delta-router-group-size ``group_size``: a function running one forward +
    backward, and what it holds, (routers, h0, grad): the stream's input and its output's gradient.

    The function returns the gradients of h0 and of every router's query; with ``every_gradient`` it returns
    (output, the gradients of h0 and of every router parameter) instead. ``sublayer(j, u)``: sublayer j's output
    in place of u itself (the identity's sources are so alike that the routers' gradients are round-off)."""
    import torch

    from megatron_delta.core.modes import ADDITIVE_MODES, BLOCK_MODES
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer, SourcePlan

    blocks = NUM_BLOCKS if mode in BLOCK_MODES and layers % NUM_BLOCKS == 0 else layers
    plan = SourcePlan(mode, layers, blocks, x_from_sources=mode in ADDITIVE_MODES, router_group_size=group_size)
    g = torch.Generator(device="cpu").manual_seed(seed)
    keys = [*range(2 * layers)] + (["final"] if plan.final_reads() else [])
    routers = [DepthRouter(hidden, null_source=False, gate=False, eps=1e-6, kernels=kernels).to(device)
               for _ in keys]
    readers = dict(zip(keys, routers))
    with torch.no_grad():
        for r in routers:
            r.query.copy_(0.1 * torch.randn(hidden, generator=g).to(device))
    h0 = torch.randn(seq, 1, hidden, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(seq, 1, hidden, generator=g).to(device, dtype)
    wrt = [h0, *(p for r in routers for p in r.parameters())] if every_gradient else [h0, *(r.query for r in routers)]

    def call():
        buf = SourceBuffer.start(plan, h0, 1e-6, readers=readers)
        for j in range(2 * layers):
            u = buf.routed_input(j, routers[j])
            buf.commit(j, u if sublayer is None else sublayer(j, u))
        out = buf.output(readers.get("final"))
        grads = torch.autograd.grad(out, wrt, grad)
        return (out.detach(), *grads) if every_gradient else grads

    return call, (routers, h0, grad)
