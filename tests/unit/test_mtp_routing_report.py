"""The routing report's MTP receivers: in the replacement modes each MTP depth's routers (attention, MLP and the
depth's final router, docs/design.md section 1.7) are recorded while the decoder records routing, reported as
`MTP depth k` beside the decoder's receivers, with their weights the float64 reference's
(tests/helpers/reference_delta.py) and their sources named (the trunk tuple's, then the depth's own). One in-process
tiny model per mode, two depths.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.mtp_models import DEPTHS, SEQ, VOCAB, routed_mtp_model
from tests.helpers.reference_compare import randomise

RECEIVERS = [f"mtp{k}.{r}" for k in range(1, DEPTHS + 1) for r in ("attn", "mlp", "final")]


@pytest.mark.usefixtures("distributed_teardown")
@pytest.mark.parametrize("mode,null", [("attnres", False), ("attnres", True), ("full_attnres", False)],
                         ids=["attnres", "attnres-null", "full_attnres"])
def test_routing_report_has_each_mtp_depths_routers(mode, null):
    from megatron_delta.core.sources import SourcePlan
    from megatron_delta.evaluation.routing_report import annotate, receiver_label
    from megatron_delta.evaluation.routing_stats import RoutingStatsAccumulator
    from tests.helpers.reference_delta import RefConfig, reference_forward, weights_from_megatron_state_dict

    model = routed_mtp_model(mode, null)
    randomise(model)
    model.eval()
    tok = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand_as(tok)
    with torch.no_grad():
        plain = model(tok, positions, None)
        model.decoder.record_routing, model.decoder.routing_records = True, []
        try:
            recorded = model(tok, positions, None)
        finally:
            model.decoder.record_routing = False
    assert torch.equal(recorded, plain)  # recording changes nothing
    acc = RoutingStatsAccumulator()
    for record in model.decoder.routing_records:
        acc.add_buffer(record)
    mtp_records = [r.routing for r in model.decoder.routing_records if any(k in r.routing for k in RECEIVERS)]
    assert len(mtp_records) == 1 and sorted(mtp_records[0]) == sorted(RECEIVERS)

    cfg = RefConfig(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=64, norm_eps=1e-6, share_embeddings_and_output_weights=True)
    want = {}
    reference_forward(weights_from_megatron_state_dict(model.state_dict()), cfg, tok, mode,
                      num_blocks=2 if mode == "attnres" else None, null_source=null, eps=1e-6,
                      mtp_num_layers=DEPTHS, mtp_routing=want)
    assert sorted(want) == sorted(RECEIVERS)
    for key in RECEIVERS:
        got = mtp_records[0][key].transpose(0, 1).double()  # [s, b, N] -> the reference's [b, s, N]
        assert got.shape == want[key].shape, key
        assert (got - want[key]).abs().max().item() < 1e-5, key

    stats = annotate(acc.to_dict(), SourcePlan.from_config(model.config), null)
    decoder_receivers = [str(j) for j in range(8)] + ["final"]
    assert stats["order"] == decoder_receivers + RECEIVERS
    trunk = stats["receivers"]["final"]["source_names"]  # the decoder's final router reads the trunk tuple
    for key in RECEIVERS:
        depth, router = int(key[3]), key.split(".")[1]
        row = stats["receivers"][key]
        if mode == "full_attnres":
            own = {"attn": ["z"], "mlp": ["z", "attn"], "final": ["z", "attn", "mlp"]}[router]
        else:
            own = [{"attn": "z", "mlp": "z+attn", "final": "z+attn+mlp"}[router]]
        assert row["source_names"] == trunk[:len(trunk) - null] + [f"mtp{depth}:{o}" for o in own] + (
            ["null"] if null else [])
        torch.testing.assert_close(torch.tensor(row["mean_weights"], dtype=torch.float64),
                                   want[key].reshape(-1, want[key].shape[-1]).mean(0), rtol=0, atol=1e-5)
        assert receiver_label(key) == f"MTP depth {depth} {router}"
    lines = acc.format_text().splitlines()
    assert [ln.split(":")[0] for ln in lines[-DEPTHS:]] == [f"MTP depth {k}" for k in range(1, DEPTHS + 1)]
    assert all(ln.count(" N=") == 3 for ln in lines[-DEPTHS:])
