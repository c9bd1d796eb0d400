"""One counted training step for the traffic tests (megatron_delta.core.traffic against
megatron_delta.perf.cost_model): the 4-layer model's options, the stand-in sublayers' routed stream, and the group
router's counts - also run in fresh processes under Triton's interpreter (tests/helpers/triton_cases.py and the
Triton cases of tests/unit/test_traffic.py)."""
import argparse

import torch

from megatron_delta.core import traffic
from megatron_delta.core.modes import BLOCK_MODES
from megatron_delta.perf import benchmark, cost_model


def model_opts(mode, backend, recompute, extras):
    # hidden 64 > 2 x the most sources any router reads here (9): the [sources, tokens] tables stay below
    # one [tokens, hidden] row, so only the rows the model prices are counted as such
    return argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=None,
                              ffn_hidden_size=None, seq_length=8, micro_batch_size=2, vocab_size=64,
                              delta_num_blocks=2 if mode in BLOCK_MODES else None,
                              delta_gate="scalar" if extras and mode in ("delta", "delta_block") else "none",
                              delta_null_source=extras, delta_router_kernels=backend, recompute=recompute, seed=1)


STAND_IN_TOKENS, STAND_IN_HIDDEN = 16, 64


def stand_in_step(mode, backend, dtype, null, gate, sources="exact", group_size="auto", with_count=False):
    """The routed residual stream of a 4-layer model over stand-in sublayers (v = u * s), one forward and
    backward, counted: {(kernel, phase): u} with u in ``dtype``'s bytes (and the count, ``with_count``)."""
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer

    L, d, tokens = 4, 64, (8, 2)
    plan = cost_model.make_plan(mode, L, backend, num_blocks=2 if mode in BLOCK_MODES else None, gate=gate,
                                sources=sources, group_size=group_size)
    g = torch.Generator().manual_seed(0)
    keys = [*range(2 * L)] + (["final"] if plan.final_reads() else [])
    routers = {k: DepthRouter(d, null_source=null, gate=gate, eps=1e-6, kernels=backend) for k in keys}
    for r in routers.values():
        with torch.no_grad():
            r.query.copy_(0.3 * torch.randn(d, generator=g))
    h0 = torch.randn(*tokens, d, generator=g).to(dtype).requires_grad_(True)
    scales = [torch.full((d,), 0.5, dtype=dtype, requires_grad=True) for _ in range(2 * L)]
    with benchmark.router_backend(backend), traffic.counting() as count:
        buf = SourceBuffer.start(plan, h0 * 1.0, 1e-6, readers=routers)
        for j in range(2 * L):
            buf.commit(j, buf.routed_input(j, routers[j]) * scales[j])
        out = buf.output(routers.get("final")).float()
        out.backward(torch.ones_like(out))  # a contiguous gradient, as the final norm's backward hands x
    assert tokens[0] * tokens[1] == STAND_IN_TOKENS and d == STAND_IN_HIDDEN
    rows = count.rows(tokens[0] * tokens[1] * d, torch.tensor([], dtype=dtype).element_size())
    return (rows, count) if with_count else rows


def group_counts(mode, backend, size, recompute=None, extras=False):
    """(counted, closed form) {(kernel, phase): u} of one step of the 4-layer model of a fine-grained mode with
    --delta-router-group-size ``size`` on ``backend`` (fp32)."""
    o = model_opts(mode, backend, recompute, extras)
    o.delta_router_group_size = size
    with benchmark.router_backend(backend):
        model, config = benchmark.build_model(o, mode)
        counted = benchmark.counted_step(model, benchmark.mock_batch(o, o.vocab_size), 4)
    predicted = cost_model.step_traffic(mode, 4, backend, act_bytes=4, group_size=size, recompute=recompute,
                                        null_source=config.delta_null_source, gate=config.delta_gate == "scalar")
    return counted, predicted


def triton_group_counts():
    """group_counts of the Triton kernels, in a process running Triton's interpreter (printed as JSON)."""
    import json

    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, None, 1, seed=1234)
    out = []
    for mode in ("delta", "full_attnres"):
        for size, recompute, extras in ((1, None, False), ("auto", None, False), ("auto", ("uniform", 1), False),
                                        ("auto", None, True)):
            counted, predicted = group_counts(mode, "triton", size, recompute, extras)
            out.append([mode, size, recompute, extras, sorted([*k, v] for k, v in counted.items()),
                        sorted([*k, v] for k, v in predicted.items())])
    print(json.dumps(out))
