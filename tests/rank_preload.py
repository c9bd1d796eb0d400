"""What the fork server of tests/dist_utils.py imports before it forks ranks: what every rank of the suite
imports first (torch, Megatron-Core, Megatron-LM through megatron_delta.platform.patches.import_megatron, which
quiets their import-time notices as the trainer does, and the rank-side test code). Nothing here runs torch
ops or starts a thread: the server must stay single-threaded to fork safely."""
from megatron_delta.platform.patches import import_megatron

import_megatron(training=True)

import megatron.core.transformer.moe.moe_layer  # noqa: E402,F401

import megatron_delta.trainer.main  # noqa: E402,F401
import tests.dist_utils  # noqa: E402,F401
import tests.rank_runner  # noqa: E402,F401
