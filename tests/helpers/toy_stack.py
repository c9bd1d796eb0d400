"""A toy stack of sublayers in plain PyTorch (its own input norm, a linear map, a nonlinearity per sublayer) routed
through SourceBuffer by real DepthRouters: the model of the sources, modes and group-router tests."""
import math

import torch

from megatron_delta.core.payload import pack_stage_payload, payload_seq_length, unpack_stage_payload
from megatron_delta.core.router import DepthRouter
from megatron_delta.core.sources import SourceBuffer

EPS = 1e-6


def _rmsnorm(u):
    return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS)


def sublayer(u, w):
    """f_j: its own input norm, a linear map, a nonlinearity."""
    return torch.tanh(_rmsnorm(u) @ w)


class Toy:
    def __init__(self, plan, d, *, null=False, gate=False, seed=0, random_routers=True, kernels="auto",
                 gate_value=0.7):
        gen = torch.Generator().manual_seed(seed)
        self.plan = plan
        n = plan.num_sublayers
        self.weights = [(torch.randn(d, d, generator=gen) / math.sqrt(d)).requires_grad_()
                        for _ in range(n)]
        self.routers = [DepthRouter(d, null_source=null, gate=gate, eps=EPS, kernels=kernels) for _ in range(n)]
        self.final = None if plan.additive else DepthRouter(d, null_source=null, gate=False, eps=EPS, kernels=kernels)
        if random_routers:
            with torch.no_grad():
                for r in self.routers + ([self.final] if self.final else []):
                    r.query.copy_(torch.randn(d, generator=gen))
                    r.key_norm_weight.add_(0.2 * torch.randn(d, generator=gen))
                    if r.null_source is not None:
                        r.null_source.copy_(torch.randn(d, generator=gen))
                    if r.gate is not None:
                        r.gate.fill_(gate_value)

    def params(self):
        ps = list(self.weights)
        for r in self.routers + ([self.final] if self.final else []):
            ps += list(r.parameters())
        return ps

    def readers(self, first_layer, boundaries):
        """Receiver -> router of the chunk that starts at first_layer (as DeltaTransformerBlock)."""
        end = min([b for b in boundaries if b > first_layer] + [self.plan.num_layers])
        out = {j: self.routers[j] for j in range(2 * first_layer, 2 * end)}
        if end == self.plan.num_layers and self.final is not None:
            out["final"] = self.final
        return out

    def run(self, h0, boundaries=(), check=None, record_routing=False, scoped=True):
        """Run all layers; at every layer index in `boundaries` hand the state over through
        to_tensors -> pack -> unpack -> from_tensors, as a pipeline stage boundary does.
        ``scoped``: buffers know their chunk's routers (one projection per source), else every
        router projects the sources it reads itself."""
        plan = self.plan
        s = h0.shape[0]
        buf = SourceBuffer.start(plan, h0, EPS, record_routing=record_routing,
                                 readers=self.readers(0, boundaries) if scoped else None)
        bufs = [buf]
        for layer in range(plan.num_layers + 1):
            if layer in boundaries:
                ts = buf.to_tensors()
                assert len(ts) == len(plan.payload_names(layer))
                payload = pack_stage_payload(ts)
                assert payload.shape[0] == payload_seq_length(plan, layer, s)
                tensors = unpack_stage_payload(payload, len(ts))
                buf = SourceBuffer.from_tensors(plan, layer, tensors, EPS, record_routing=record_routing,
                                                readers=self.readers(layer, boundaries) if scoped else None)
                bufs.append(buf)
                if check is not None:
                    check(layer, buf)
            if layer == plan.num_layers:
                break
            for j in (2 * layer, 2 * layer + 1):
                u = buf.routed_input(j, self.routers[j])
                buf.commit(j, sublayer(u, self.weights[j]))
        return buf.output(self.final), bufs

