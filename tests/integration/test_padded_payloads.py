"""Pipeline payloads padded to one length (core/payload.py payload_padding: full-iteration CUDA graphs with several
chunks per rank): the padding round-trips and carries no gradient; a routed stream handed over padded payloads at
its chunk boundaries gives the unpadded stream's output and every gradient, bitwise, in every routed mode; which
configs pad, to what, and that their shapes then stay off the host."""
import pytest
import torch

from megatron_delta.core.config import DeltaTransformerConfig
from megatron_delta.core.modes import BLOCK_MODES, ROUTED_MODES
from megatron_delta.core.payload import (
    describe_stage_payloads,
    pack_stage_payload,
    payload_padding,
    payload_shapes_travel,
    unpack_stage_payload,
)
from megatron_delta.core.router import DepthRouter
from megatron_delta.core.sources import SourceBuffer, SourcePlan

EPS = 1e-6
LAYERS = 4


def test_padded_pack_round_trip_and_gradients():
    """Padded to 5 tensors: the payload is 5 tensors long, its tail zeros; unpacking gives the 3 tensors back, and
    their gradients are exactly what reached their rows. Too few slots, or a length the padding does not divide, is
    a ValueError."""
    ts = [torch.randn(3, 2, 4, requires_grad=True) for _ in range(3)]
    payload = pack_stage_payload(ts, pad_to=5)
    assert payload.shape == (15, 2, 4) and torch.equal(payload[9:], torch.zeros(6, 2, 4))
    parts = unpack_stage_payload(payload, 3, pad_to=5)
    assert all(torch.equal(p, t) for p, t in zip(parts, ts, strict=True))
    sum((i + 1) * p.sum() for i, p in enumerate(parts)).backward()
    for i, t in enumerate(ts):
        assert torch.equal(t.grad, torch.full_like(t, i + 1.0))
    assert pack_stage_payload(ts, pad_to=3).shape == (9, 2, 4)
    with pytest.raises(ValueError, match="do not fit a payload padded to 2"):
        pack_stage_payload(ts, pad_to=2)
    with pytest.raises(ValueError, match="cannot hold 3"):
        unpack_stage_payload(payload[:14], 3, pad_to=5)


def _stream(mode, h0, pad_to, cuts=(1, 3)):
    """``mode``'s routed stream (linear sublayers, seed-fixed routers) over LAYERS layers with a chunk boundary at
    each layer of ``cuts``: the buffer's tensors packed (padded to ``pad_to``), then unpacked into new leaves as the
    next chunk receives them, their gradients handed back; the output, and the gradients of h0 and every router
    parameter and sublayer weight."""
    blocks = 2 if mode in BLOCK_MODES else LAYERS
    plan = SourcePlan(mode, LAYERS, blocks)
    g = torch.Generator().manual_seed(3)
    d = h0.shape[-1]
    routers = {k: DepthRouter(d, null_source=False, gate=False, eps=EPS, kernels="torch")
               for k in [*range(2 * LAYERS), "final"]}
    with torch.no_grad():
        for r in routers.values():
            r.query.copy_(0.3 * torch.randn(d, generator=g))
    weights = [(0.2 * torch.randn(d, d, generator=g)).requires_grad_() for _ in range(2 * LAYERS)]
    h0 = h0.detach().requires_grad_()
    buf = SourceBuffer.start(plan, h0, EPS)
    handed = []
    for layer in range(LAYERS):
        if layer in cuts:
            sent = buf.to_tensors()
            payload = pack_stage_payload(sent, pad_to)
            received = payload.detach().requires_grad_()
            handed.append((payload, received))
            buf = SourceBuffer.from_tensors(plan, layer, unpack_stage_payload(received, len(sent), pad_to), EPS)
        for j in (2 * layer, 2 * layer + 1):
            buf.commit(j, torch.tanh(buf.routed_input(j, routers[j]) @ weights[j]))
    out = buf.output(routers["final"] if plan.final_reads() else None)
    out.backward(torch.ones_like(out))
    for payload, received in reversed(handed):  # each earlier chunk's backward, from the next one's gradient
        payload.backward(received.grad)
    params = [p.grad for r in routers.values() for p in r.parameters() if p.grad is not None]
    return out, [h0.grad, *params, *[w.grad for w in weights]]


@pytest.mark.parametrize("mode", ROUTED_MODES)
def test_padded_boundaries_give_the_unpadded_stream(mode):
    """A routed stream whose chunk boundaries carry payloads padded to 9 tensors equals the unpadded stream's
    output and every gradient bitwise (the padding is zeros that nothing reads)."""
    h0 = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(1))
    out, grads = _stream(mode, h0, None)
    padded_out, padded_grads = _stream(mode, h0, 9)
    assert torch.equal(out, padded_out)
    assert len(grads) == len(padded_grads) > 2 * LAYERS
    for a, b in zip(grads, padded_grads, strict=True):
        assert torch.equal(a, b)


SMALL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2,
             pipeline_dtype=torch.float32)


@pytest.mark.parametrize("mode", ROUTED_MODES)
def test_which_pipelines_pad(mode):
    """Full-iteration graphs with virtual pipeline stages pad every payload to the most tensors any boundary of the
    plan carries, and then no shape travels; without graphs the shapes travel instead; one chunk per rank neither
    pads nor sends shapes; the baseline never. The start-up lines give the padded size."""
    vpp = dict(SMALL, virtual_pipeline_model_parallel_size=2)
    graphs = DeltaTransformerConfig(**vpp, residual=mode, cuda_graph_impl="full_iteration")
    plan = SourcePlan.from_config(graphs)
    most = max(len(plan.payload_names(f)) for f in range(1, 4))
    assert payload_padding(graphs) == most and not payload_shapes_travel(graphs)
    eager = DeltaTransformerConfig(**vpp, residual=mode)
    assert payload_padding(eager) is None and payload_shapes_travel(eager)
    one_chunk = DeltaTransformerConfig(**SMALL, residual=mode, cuda_graph_impl="full_iteration")
    assert payload_padding(one_chunk) is None and not payload_shapes_travel(one_chunk)
    baseline = DeltaTransformerConfig(**vpp, residual="baseline", cuda_graph_impl="full_iteration")
    assert payload_padding(baseline) is None and not payload_shapes_travel(baseline)
    lines = describe_stage_payloads(graphs, seq_length=16, micro_batch_size=1)
    short = [line for line in lines if f"{most} tensors [" not in line]
    assert all(f"; padded to {most} tensors = " in line for line in short), lines


# ------------------------------------------------------------------------------ Megatron's interleaved schedule
def rank_interleaved_step(mode, graphs, cached):
    """One forward-backward of Megatron's interleaved schedule (PP2 x VPP2, one layer per chunk, 4 micro-batches)
    over a routed model on CPU with the schedule arguments of core/payload.py; ``graphs``: the config says
    --cuda-graph-impl full_iteration (nothing is captured on CPU: the payloads are padded and no shape travels);
    ``cached``: the source cache on (a boundary sends what the receiving rank lacks) or off.
    Returns the losses (last stage) and every parameter's gradient, by name."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_delta.checkpoint.model_config import model_config
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.core.payload import payload_padding, schedule_communication_kwargs
    from megatron_delta.platform.cpu import activate_cpu_platform
    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed

    activate_cpu_platform()
    initialize_distributed(1, 2, 2, seed=1234)
    fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=8,
                  vocab_size=64, residual=mode, delta_num_blocks=2 if mode in BLOCK_MODES else None,
                  pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, delta_router_kernels="torch")
    config, options = model_config(fields, delta_pp_source_cache=cached,
                                   **({"cuda_graph_impl": "full_iteration"} if graphs else {}))
    assert (payload_padding(config) is not None) == graphs and config.variable_seq_lengths == (not graphs)
    chunks = build_model_chunks(config, 128, **options)
    config.no_sync_func = None
    config.grad_scale_func = None
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 64, (2, 9), generator=g) for _ in range(4)]

    def step(data_iterator, model):
        seq = next(data_iterator)
        pos = torch.arange(8).unsqueeze(0).expand(2, 8)
        out = model(seq[:, :-1], pos, None, labels=seq[:, 1:])

        def loss(output):
            value = output.float().mean()
            return value, {"loss": value.detach().clone()}
        return out, loss

    out = get_forward_backward_func()(
        forward_step_func=step, data_iterator=[iter(batches) for _ in chunks], model=chunks, num_microbatches=4,
        seq_length=8, micro_batch_size=2, forward_only=False, **schedule_communication_kwargs(config))
    grads = {f"{k}.{n}": p.grad.tolist() for k, c in enumerate(chunks) for n, p in c.named_parameters()
             if p.grad is not None}
    losses = [o["loss"].item() for o in out] if ps.is_pipeline_last_stage(ignore_virtual=True) else None
    destroy_distributed()
    return dict(losses=losses, grads=grads)


@pytest.mark.slow
@pytest.mark.parametrize("mode, cached", [("delta_block", True), ("full_attnres", False)])
def test_interleaved_schedule_with_padded_payloads(mode, cached):
    """Megatron's interleaved schedule on 2 ranks (PP2 x VPP2, every boundary carrying a payload of a different
    length, with and without the source cache): with the config of full-iteration graphs the payloads travel
    padded, without shape messages, and the losses and every parameter's gradient equal the run whose shapes
    travel, bitwise."""
    from tests.helpers.dist_utils import run_distributed

    padded = run_distributed(rank_interleaved_step, 2, mode, True, cached, timeout=600)
    travelling = run_distributed(rank_interleaved_step, 2, mode, False, cached, timeout=600)
    for rank in range(2):
        assert padded[rank]["losses"] == travelling[rank]["losses"]
        assert padded[rank]["grads"].keys() == travelling[rank]["grads"].keys() and padded[rank]["grads"]
        for name, grad in padded[rank]["grads"].items():
            assert grad == travelling[rank]["grads"][name], name
    assert padded[1]["losses"] and len(padded[1]["losses"]) == 4
