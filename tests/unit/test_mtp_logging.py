"""The trainer's teardown between in-process runs (trainer.main.reset_global_state) empties Megatron's MTP loss
tracker: MTPLossLoggingHelper keeps its loss tensor (one entry per MTP depth) across runs, sized by the first run that
logged, so a next run with fewer depths would log the earlier run's extra depths with their unlogged losses.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.mtp_models import SEQ, VOCAB, mtp_batch, mtp_model


def _logged_mtp_losses(model, batch):
    """One training-mode forward of the trainer's model call, then Megatron-LM's logging of the MTP tracker (as
    training_log does): {name: value} of the `mtp_k loss` entries."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_delta.trainer.provider import model_output

    model.train()
    with torch.no_grad():
        model_output(model, batch)
    logged = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0, 1, None, total_loss_dict=logged)
    return {name: float(v) for name, v in logged.items() if name.endswith(" loss")}


@pytest.mark.usefixtures("distributed_teardown")
def test_reset_global_state_empties_the_mtp_loss_tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_delta.trainer.main import reset_global_state

    torch.manual_seed(0)
    batch = mtp_batch(torch.randint(0, VOCAB, (2, SEQ)))
    MTPLossLoggingHelper.tracker.clear()  # (set-up: earlier tests in this process logged MTP losses)
    first = mtp_model(2)  # an earlier run with two depths: the tracker's tensors get two entries
    assert list(_logged_mtp_losses(first, batch)) == ["mtp_1 loss", "mtp_2 loss"]
    MTPLossLoggingHelper.save_metrics_to_tracker(torch.tensor(5.0), torch.tensor(1.0), torch.tensor(2.0), 1, 2)
    reset_global_state()  # (that run ended with depth 2's loss saved but not yet logged)
    again = mtp_model(1)
    got = _logged_mtp_losses(again, batch)
    MTPLossLoggingHelper.tracker.clear()
    alone = _logged_mtp_losses(again, batch)  # the same forward from an empty tracker
    assert list(alone) == ["mtp_1 loss"] and alone["mtp_1 loss"] > 0
    assert got == alone
