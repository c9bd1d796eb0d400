"""The bytes the Triton kernels' deferred block passes really stash in backward (triton_router.BlockDeferral), for
tests/unit/test_memory_plan.py. Run in a fresh process with TRITON_INTERPRET=1 (Triton reads it at import; see
tests/integration/test_triton_router.py), on CPU in fp32:

    TRITON_INTERPRET=1 python tests/helpers/triton_stash_count.py MODE LAYERS BLOCKS STAGES HIDDEN SEQ BATCH

One micro-batch through SourceBuffer over stand-in sublayers (a learnable scale per sublayer), the layers split
evenly into STAGES pipeline stages as the schedule runs them (each stage its own buffer scope; the later stage's
backward first, the payload's gradients handed back). Prints JSON: per stage, in the order the passes ran, one
entry per block pass: [routers, completed sources, bytes held] - the unique storages of the stash (each router's
output gradient, its [3, C, T] coefficients and its query) when the pass starts.
"""
import json
import sys

import torch

from megatron_delta.core import triton_router
from megatron_delta.core.router import DepthRouter
from megatron_delta.core.sources import SourceBuffer, SourcePlan

EPS = 1e-6


def stash_bytes(stash):
    storages = {}
    for tensors in stash:
        for t in tensors:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def main(mode, L, K, stages, d, s, b):
    if not triton_router.interpreting():
        raise SystemExit("triton_stash_count.py: run with TRITON_INTERPRET=1")
    passes, current = {}, [None]
    flush = triton_router.BlockDeferral.flush

    def counted(self):
        if self.stash:
            passes.setdefault(current[0], []).append(
                [len(self.stash), self.stash[0][1].shape[1], stash_bytes(self.stash)])
        flush(self)

    triton_router.BlockDeferral.flush = counted
    g = torch.Generator().manual_seed(5)
    plan = SourcePlan(mode=mode, num_layers=L, num_blocks=K, x_from_sources=mode == "delta_block")
    keys = [*range(2 * L)] + (["final"] if plan.final_reads() else [])
    routers = {k: DepthRouter(d, null_source=False, gate=False, eps=EPS, kernels="triton") for k in keys}
    with torch.no_grad():
        for r in routers.values():
            r.query.copy_(torch.randn(d, generator=g))
    h0 = torch.randn(s, b, d, generator=g).requires_grad_()
    scales = [(1 + 0.3 * torch.randn(d, generator=g)).requires_grad_() for _ in range(2 * L)]
    bounds = [L * i // stages for i in range(stages + 1)]
    payload, ends = [h0 * 1.0], []
    for first, end in zip(bounds, bounds[1:]):
        scope = {k: routers[k] for k in keys if k == "final" and end == L or k != "final" and first <= k // 2 < end}
        inputs = [t.detach().requires_grad_() for t in payload] if first else payload
        buf = (SourceBuffer.from_tensors(plan, first, inputs, EPS, readers=scope) if first
               else SourceBuffer.start(plan, inputs[0], EPS, readers=scope))
        for j in range(2 * first, 2 * end):
            buf.commit(j, buf.routed_input(j, routers[j]) * scales[j])
        out = buf.to_tensors() if end < L else [buf.output(routers.get("final"))]
        ends.append((inputs, out))
        payload = out
    for stage in reversed(range(stages)):  # the schedule's order: the last stage's backward first
        current[0] = stage
        inputs, out = ends[stage]
        if stage == stages - 1:
            out[0].square().sum().backward()
        else:
            later = ends[stage + 1][0]
            pairs = [(t, i.grad) for t, i in zip(out, later) if i.grad is not None]
            torch.autograd.backward([t for t, _ in pairs], [gr for _, gr in pairs])
    print(json.dumps({str(k): v for k, v in sorted(passes.items())}))


if __name__ == "__main__":
    mode, *ints = sys.argv[1:]
    main(mode, *map(int, ints))
