"""The residual modes: their names, and the one check of which residual options go together.

No Megatron import: the argument parsers, DeltaTransformerConfig, SourcePlan, the HF configuration,
conversion and tools all take mode names and rules from here. Messages name the command-line flag, since
that is what most users typed.
"""

RESIDUAL_MODES = ("baseline", "attnres", "full_attnres", "delta", "delta_block")
ROUTED_MODES = RESIDUAL_MODES[1:]
ADDITIVE_MODES = ("delta", "delta_block")
REPLACEMENT_MODES = ("attnres", "full_attnres")
BLOCK_MODES = ("delta_block", "attnres")
GATES = ("none", "scalar")
SOURCE_DEFINITIONS = ("exact", "authors-code")


def default_num_blocks(residual: str, num_layers: int) -> int | None:
    """K = 4 for the block modes (the paper's choice), L for a model with fewer than 4 layers."""
    if residual not in BLOCK_MODES:
        return None
    return 4 if num_layers % 4 == 0 and num_layers >= 4 else num_layers


def check_delta_options(residual: str, num_layers: int, num_blocks: int | None, null_source: bool,
                        gate: str, sources: str, router_lr_mult: float = 1.0,
                        router_kernels: str = "auto") -> int | None:
    """Validate one combination of residual options; returns the resolved number of blocks."""
    if residual not in RESIDUAL_MODES:
        raise ValueError(f"--residual {residual!r} is not one of {', '.join(RESIDUAL_MODES)}")
    if gate not in GATES:
        raise ValueError(f"--delta-gate {gate!r} is not one of {', '.join(GATES)}")
    if sources not in SOURCE_DEFINITIONS:
        raise ValueError(f"--delta-sources {sources!r} is not one of {', '.join(SOURCE_DEFINITIONS)}")
    if residual == "baseline":
        used = [flag for flag, on in [("--delta-num-blocks", num_blocks is not None),
                                      ("--delta-null-source", null_source),
                                      ("--delta-gate scalar", gate != "none"),
                                      ("--delta-sources authors-code", sources != "exact"),
                                      ("--router-lr-mult", router_lr_mult != 1.0),
                                      ("--delta-router-kernels", router_kernels != "auto")] if on]
        if used:
            verb = "needs" if len(used) == 1 else "need"
            raise ValueError(f"{', '.join(used)} {verb} a routed residual mode; --residual baseline has no "
                             f"routers (choose --residual delta_block, delta, attnres or full_attnres)")
        return None
    if gate != "none" and residual in REPLACEMENT_MODES:
        raise ValueError(f"--delta-gate {gate} only applies to the additive modes (delta, delta_block): "
                         f"--residual {residual} replaces the residual stream, so a zero gate would erase it")
    if sources != "exact" and residual not in ADDITIVE_MODES:
        raise ValueError(f"--delta-sources {sources} is defined for --residual delta and delta_block only")
    if residual in BLOCK_MODES:
        if num_blocks is None:
            num_blocks = default_num_blocks(residual, num_layers)
        if num_blocks < 1 or num_layers % num_blocks:
            raise ValueError(f"--delta-num-blocks {num_blocks} must be a positive divisor of --num-layers {num_layers} "
                             f"(each block holds L/K consecutive layers)")
    elif num_blocks is not None:
        raise ValueError(f"--delta-num-blocks applies to --residual delta_block and attnres, "
                         f"not {residual} (every sublayer is its own source there)")
    if router_lr_mult <= 0:
        raise ValueError(f"--router-lr-mult must be positive (got {router_lr_mult})")
    return num_blocks
