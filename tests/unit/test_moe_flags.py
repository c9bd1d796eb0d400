"""Every MoE and MTP flag of megatron-core 0.19.2's parser, as the routed modes take it (docs/usage.md's MoE table).

The GPU-only MoE options (DeepEP / HybridEP / NCCL EP dispatch, Transformer Engine's fused permutation, router and
grouped GEMM, CUDA-stream overlaps, paged stash) live inside Megatron's MoE layer: the sublayer output v the routed
modes read is the same with or without them, so the project's start-up checks (trainer.arguments
check_routed_features and core.specs.check_moe_backend, the ones pretrain_gpt.py runs before the distributed
start-up; DeltaTransformerConfig runs the same tables) accept them in every routed mode. Megatron's own checks of
them (Transformer Engine or DeepEP installed) run in baseline mode too and are not the project's. What the routed
modes refuse is refused by name, with the message the user sees. docs/usage.md's table names every flag.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import pytest

from tests.helpers import REPO_ROOT as REPO
from tests.helpers.flags import tiny

ROUTED = ["delta", "delta_block", "attnres", "full_attnres"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]

# Inside the MoE layer's forward, CUDA only (Transformer Engine, DeepEP, HybridEP, NCCL EP, CUDA streams)
GPU_ONLY_MOE = {
    "flex_deepep": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep",
                    "--moe-enable-deepep", "--moe-deepep-num-sms", "20", "--moe-flex-dispatcher-num-sms", "20"],
    "flex_hybridep": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
                      "--moe-permute-fusion-into-hybridep", "--moe-hybridep-pad-uneven-dispatch-inputs",
                      "--moe-hybridep-num-sms", "16", "--moe-hybridep-num-blocks-permute", "8",
                      "--moe-hybridep-num-blocks-unpermute", "8", "--moe-hybridep-num-sms-preprocessing", "8",
                      "--moe-expert-rank-capacity-factor", "1.5"],
    "flex_ncclep": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "ncclep",
                    "--moe-ncclep-static-shape", "--moe-ncclep-zero-copy"],
    "permute_router_fusion": ["--moe-permute-fusion", "--moe-router-fusion"],
    "grouped_gemm": ["--moe-grouped-gemm", "--moe-single-grouped-weight", "--moe-single-grouped-bias",
                     "--moe-shared-expert-intermediate-size", "32", "--use-grouped-gemm-for-shared-expert",
                     "--moe-mlp-glu-interleave-size", "32", "--moe-shared-expert-glu-interleave-size", "32",
                     "--moe-latent-size", "16"],
    "overlaps": ["--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size", "32",
                 "--moe-shared-expert-overlap", "--overlap-dispatch-backward-with-experts-wgrad"],
    "paged_stash_fp8_padding": ["--moe-paged-stash", "--moe-paged-stash-page-size", "32",
                                "--moe-paged-stash-buffer-size-factor-cuda", "1.2",
                                "--moe-paged-stash-buffer-size-factor-cpu", "0.5",
                                "--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8"],
}


def _args(flags):
    """Megatron-LM's parser with the project's flags, as pretrain_gpt.py parses a job script (Megatron's
    validate_args, whose Transformer Engine / DeepEP checks are the same in baseline mode, not run)."""
    from megatron.training.arguments import parse_args

    from megatron_delta.trainer.arguments import add_delta_args

    argv = sys.argv
    sys.argv = ["pretrain_gpt.py"] + flags
    try:
        return parse_args(extra_args_provider=add_delta_args)
    finally:
        sys.argv = argv


def _startup_checks(args):
    from megatron_delta.core.specs import check_moe_backend
    from megatron_delta.trainer.arguments import check_routed_features

    check_routed_features(args)
    check_moe_backend(args.transformer_impl, args.num_experts, args.moe_grouped_gemm)


def _on_gpu(flags):
    """The CPU switches of tests.helpers.flags.tiny, with Transformer Engine as a GPU job script has it."""
    flags = list(flags)
    i = flags.index("--transformer-impl")
    flags[i + 1] = "transformer_engine"
    return flags


@pytest.mark.parametrize("residual", ["delta_block", "attnres"])  # an additive and a replacement mode
@pytest.mark.parametrize("option", list(GPU_ONLY_MOE))
def test_routed_modes_accept_the_gpu_only_moe_options(option, residual):
    args = _args(_on_gpu(tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=1)) + MOE
                 + GPU_ONLY_MOE[option] + ["--residual", residual])
    for flag in GPU_ONLY_MOE[option]:  # each flag reached args (a misspelt one would have failed to parse)
        if flag.startswith("--"):
            value = getattr(args, flag[2:].replace("-", "_"))
            assert value not in (None, False), flag
    _startup_checks(args)


@pytest.mark.parametrize("residual", ROUTED)
@pytest.mark.parametrize("flags, message", [
    (["--overlap-moe-expert-parallel-comm"],
     "--overlap-moe-expert-parallel-comm is not supported with --residual {r}: its combined 1F1B schedule runs "
     "Megatron's TransformerLayer piece by piece (attention, dispatch, experts, combine) on one hidden-states "
     "tensor, bypassing the routed block and its SourceBuffer. Drop --overlap-moe-expert-parallel-comm, or use "
     "--residual baseline (Megatron-Core's own layers support it)"),
    (["--mtp-num-layers", "1", "--mtp-standalone"],
     "--mtp-standalone cannot be used with --mtp-num-layers and --residual {r}: it puts the MTP block on a "
     "pipeline stage of its own, while the routed depths read the decoder's sources, which stay on the stage of "
     "the decoder's last layer. Drop --mtp-standalone")], ids=["overlap_moe_ep_comm", "mtp_standalone"])
def test_routed_modes_refuse_by_name(flags, message, residual):
    """The refused options: the routed modes' message; baseline (and for MTP options the additive modes, whose
    depths are Megatron's own MTP layers) passes the same checks."""
    flags = tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=1) + MOE + flags
    replaces = residual in ("attnres", "full_attnres")
    if "--mtp-standalone" in flags and not replaces:
        _startup_checks(_args(flags + ["--residual", residual]))
    else:
        with pytest.raises(ValueError) as e:
            _startup_checks(_args(flags + ["--residual", residual]))
        assert str(e.value) == message.format(r=residual)
    _startup_checks(_args(flags + ["--residual", "baseline"]))


def _docs_table_flags():
    """The flags docs/usage.md's MoE table names (first column)."""
    with open(os.path.join(REPO, "docs", "usage.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("| Megatron-LM flag | routed modes |")
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    return {flag for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row.split(" | ")[0])}


def test_docs_table_names_every_moe_and_mtp_flag():
    """Every MoE, expert and MTP flag of Megatron-LM's parser has a row in docs/usage.md's table (trained,
    accepted and untested, GPU only, refused or not used in training, each with its reason)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    upstream = {flag for action in parser._actions for flag in action.option_strings
                if flag.startswith("--") and re.search(r"moe|mtp|expert", flag)}
    documented = _docs_table_flags()
    assert len(upstream) > 70  # the parser's MoE group was found
    assert upstream - documented == set()
    assert documented - upstream <= {"--recompute-granularity", "--recompute-modules", "--delay-wgrad-compute"}
