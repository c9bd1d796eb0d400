"""Where the routing time goes: stand-ins for the router's kernels, and the passes a router touching
each [tokens, hidden] tensor once would make.

stand_ins(route, project) swaps router._RouteFunction and the group router's group_router._OldPass and
group_router._Merge (the routers' fused passes: per router, or per group of routers in delta / full_attnres)
and/or router._ProjectSource (the shared source projections) for RouteStandIn, OldPassStandIn / MergeStandIn
and ProjectStandIn while a block runs:
the benchmark's --routing-breakdown and --model-breakdown attribute time by the difference of runs with and
without them (STAND_INS names the two variants). fused_router_passes counts the passes over memory a
touch-once router would add to what the stand-in loop already does: the benchmark's floor."""
import contextlib

import torch

from megatron_delta.core import group_plan, group_router

# The stand-in variants of the breakdowns (stand_ins arguments): the routers' fused passes stood in,
# and the shared source projections as well.
STAND_INS = {"route": (True, False), "both": (True, True)}


class RouteStandIn(torch.autograd.Function):
    """In place of router._RouteFunction (--routing-breakdown): no weighted sum, no projection of the
    local sources, only a copy of the base (the first value in the replacement modes) so the buffer's
    bookkeeping runs unchanged; its backward hands the gradient to that input and zero logit
    gradients to the projections (which then do their full backward work, but receive nothing in
    their gradient sinks)."""

    @staticmethod
    def forward(ctx, n, out_dtype, lib, sinks, base_sums, eps, base, gate, null_logit, null_value, query,
                *tensors):
        ref = base if base is not None else tensors[0]
        rows = ref.numel() // ref.shape[-1]
        ctx.n, ctx.has_base = n, base is not None
        ctx.local = [c is None for c in tensors[n:]]
        alpha = torch.softmax(torch.stack([torch.zeros(rows) if c is None else c for c in tensors[n:]]), dim=0)
        ctx.zero = alpha.new_zeros(rows)
        ctx.mark_non_differentiable(alpha)
        return ref.to(out_dtype or ref.dtype, copy=True), alpha

    @staticmethod
    def backward(ctx, grad, _grad_alpha):
        n = ctx.n
        first = [None] * n
        if not ctx.has_base:
            first[0] = grad
        return (None, None, None, None, None, None, grad if ctx.has_base else None, None, None, None, None, *first,
                *[None if local else ctx.zero for local in ctx.local])


class OldPassStandIn(torch.autograd.Function):
    """In place of group_router._OldPass (--routing-breakdown): no pass over the older sources. Its partial mixes
    and the older part of x are one zero row broadcast over the tokens (no [tokens, hidden] memory), its
    log-sum-exps zero; the first router's u (first_u) a zero [tokens, hidden] tensor, written as MergeStandIn writes
    its copy; its backward hands nothing back (the older sources' sinks get nothing from it)."""

    @staticmethod
    def forward(ctx, n, S, eps, unit, first_u, lib, sinks, stash, *tensors):
        v0 = tensors[0]
        d = v0.shape[-1]
        rows = v0.numel() // d
        ctx.count = len(tensors)
        m = n + (len(tensors) - n - S) // 2  # the null source last, as the old pass's weights
        p = torch.full((S, m, rows), 1.0 / m, dtype=v0.dtype, device=v0.device)
        ctx.mark_non_differentiable(p)
        r = [v0.new_zeros(1, d).expand(rows, d) for _ in range(S)]
        if first_u:
            r[0] = v0.new_zeros(rows, d)
        x = v0.new_zeros(1, d).expand(rows, d) if unit else None
        return (*r, *v0.new_zeros(S, rows).unbind(0), x, p)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * (8 + ctx.count)


class MergeStandIn(torch.autograd.Function):
    """In place of group_router._Merge (--routing-breakdown): no merge, only a copy of the base (the held x; else
    the older part of x, or the last in-group source, or the partial mix) as RouteStandIn copies its base, so the
    buffer's bookkeeping runs unchanged; its backward hands the gradient to that input and nothing to the
    stash (the old pass's stand-in reads none)."""

    @staticmethod
    def forward(ctx, k, out_dtype, eps, unit, lib, sinks, stash, slot, r, lse, x, base, gate, query, *values):
        if base is not None:
            ctx.which, ref = 11, base
        elif x is not None:
            ctx.which, ref = 10, x
        elif values:
            ctx.which, ref = 14 + k - 1, values[-1]
        else:
            ctx.which, ref = 8, r
        rows, d = r.shape
        ctx.k, ctx.shape = k, ref.shape
        a = torch.full((1 + k, rows), 1.0 / (1 + k), dtype=r.dtype, device=r.device)
        ctx.mark_non_differentiable(a)
        return ref.reshape(rows, d).to(out_dtype, copy=True), a

    @staticmethod
    def backward(ctx, grad, _grad_a):
        out = [None] * (14 + ctx.k)
        if grad is not None:
            out[ctx.which] = grad.reshape(ctx.shape)
        return tuple(out)


class ProjectStandIn(torch.autograd.Function):
    """In place of router._ProjectSource (--routing-breakdown): no norm, no GEMM (1/rms = 1, zero
    logits); its backward passes on what the routers left in the source's gradient sink."""

    @staticmethod
    def forward(ctx, value, eps, sink, *queries):
        rows = value.numel() // value.shape[-1]
        ctx.sink, ctx.shape, ctx.nq = sink, value.shape, len(queries)
        inv = torch.ones(rows, dtype=torch.float32, device=value.device)
        ctx.mark_non_differentiable(inv)
        return (inv, *torch.zeros(len(queries), rows, dtype=torch.float32, device=value.device).unbind(0))

    @staticmethod
    def backward(ctx, _grad_inv, *_grad_z):
        acc, ctx.sink.grad = ctx.sink.grad, None
        return (None if acc is None else acc.view(ctx.shape), None, None, *([None] * ctx.nq))


@contextlib.contextmanager
def stand_ins(route, project):
    """Swap the router's kernels for the stand-ins above while the block runs: routing alone with
    both kernels minus routing alone without the fused passes is what the fused passes cost, and
    so on. Attribution is by difference and approximate (the parts share caches; with the weighted
    sums gone the projections' backward gets no sink to add to). Always restored on exit."""
    from megatron_delta.core import group_router, router

    saved = router._RouteFunction, router._ProjectSource, group_router._OldPass, group_router._Merge
    try:
        if route:
            router._RouteFunction = RouteStandIn
            group_router._OldPass, group_router._Merge = OldPassStandIn, MergeStandIn
        if project:
            router._ProjectSource = ProjectStandIn
        yield
    finally:
        router._RouteFunction, router._ProjectSource, group_router._OldPass, group_router._Merge = saved


def fused_router_passes(mode, config):
    """Passes over a [tokens, hidden] tensor per step that a router touching each tensor once would
    make BEYOND what the stand-in loop (the "rest" of --routing-breakdown) already does. Per router
    with N sources: forward N + 2 (read the sources and the base x, write u) or N + 1 in the
    replacement modes and where x is the sum of the sources (no base), of which the stand-in's copy
    already does 2; backward 3N + 1 (read
    the output gradient and each source, read and write each source's gradient). Per source with
    several readers (projected once for all of them, make_source): 1 forward (its norm and logit
    columns in one read), 3 backward (read it, read and write its gradient); a source with one
    reader is projected inside that router's passes (a local source), at no extra pass.

    Where the sublayer routers route in groups (delta / full_attnres, the group size not resolving to 1, as
    GroupRouting.resolve does for the config's kernels on fp32 CPU tensors): the passes the group router makes
    over the scope (group_plan.passes: per group one old pass over the older sources and one merge per router but
    the group's first where no router reads x (its u is the old pass's), forward and backward), less the stand-in
    merge's copy (2 per router), plus the final router of full_attnres
    per router (its sources have one reader there: no shared projection)."""
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer, SourcePlan

    plan = SourcePlan.from_config(config, mode)
    base = 1 if plan.additive and not plan.x_from_sources else 0  # a router that reads x
    size = group_size(plan, config)
    if size != 1:
        n = plan.num_sublayers
        grouped = group_plan.passes(n, plan.num_sources_read(0), size, unit=plan.x_from_sources, base=bool(base),
                                      null=bool(getattr(config, "delta_null_source", False)))
        nf = len(plan.final_reads())
        return grouped - 2 * n + ((nf - 1) + (3 * nf + 1) if nf else 0)
    counts = [plan.num_sources_read(j) for j in range(plan.num_sublayers)] + [len(plan.final_reads())]
    route = sum((nj + base - 1) + (3 * nj + 1) for nj in counts if nj)
    # The sources made, as SourceBuffer makes them (tiny tensors): which are projected for several readers.
    readers = {j: DepthRouter(1, null_source=False, gate=False, eps=1e-6)
               for j in [*range(plan.num_sublayers), "final"]}
    buf = SourceBuffer.start(_per_router(plan), torch.zeros(1, 1, 1), 1e-6, readers=readers)
    shared = {}
    with torch.no_grad():
        for j in range(plan.num_sublayers):
            for src in buf.read(j):
                shared[id(src)] = (src, len(src.logits) > 1)  # keep src alive: ids stay unique
            buf.routed_input(j, readers[j])
            buf.commit(j, torch.ones(1, 1, 1))
        if not plan.additive:
            for name in plan.final_reads():
                src = buf._source(name, "final")
                shared[id(src)] = (src, len(src.logits) > 1)
    return route + 4 * sum(multi for _, multi in shared.values())


def group_size(plan, config) -> group_plan.Sizes:
    """The group size (S, or the groups' sizes under auto) the sublayer routers of the benchmark's one scope (every
    layer) resolve to on fp32 CPU tensors (GroupRouting.resolve): 1 where they route one router per pass."""
    if not plan.groups_routers:
        return 1
    from megatron_delta.core.router import DepthRouter

    kernels = getattr(config, "delta_router_kernels", "auto")
    routers = [DepthRouter(4, null_source=False, gate=False, eps=1e-6, kernels=kernels)]
    routing = group_router.GroupRouting(plan.router_group_size, range(plan.num_sublayers))
    reads_x = plan.additive and not plan.x_from_sources  # the merges read the held x: no u from the old pass
    return routing.resolve(routers, torch.zeros(2, 4), plan.num_sources_read(0), first_u=not reads_x)


def _per_router(plan):
    """The plan with one router per pass (the sources it projects for several readers are the per-router path's)."""
    import dataclasses

    return dataclasses.replace(plan, router_group_size=1)
