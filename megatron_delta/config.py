"""DeltaTransformerConfig: Megatron's TransformerConfig plus the residual-routing fields (`delta_*`).

The rules about which residual options go together live in `check_delta_options`, used both by the
dataclass's `__post_init__` (library users) and by the argument parser (so pretrain_gpt.py fails before
any Megatron code runs). Messages name the command-line flag, since that is what most users typed.
"""

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_delta import cpu_kernels

RESIDUAL_MODES = ("baseline", "attnres", "full_attnres", "delta", "delta_block")
ADDITIVE_MODES = ("delta", "delta_block")
REPLACEMENT_MODES = ("attnres", "full_attnres")
BLOCK_MODES = ("delta_block", "attnres")


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
    if gate not in ("none", "scalar"):
        raise ValueError(f"--delta-gate {gate!r} is not one of none, scalar")
    if sources not in ("exact", "authors-code"):
        raise ValueError(f"--delta-sources {sources!r} is not one of exact, authors-code")
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
    cpu_kernels.check(router_kernels)  # `c` must build here: fail at start-up, not at the first step
    return num_blocks


# Megatron-Core fusions that fold the residual add into another kernel. A routed layer
# (DeltaTransformerLayer.forward) adds nothing to a residual inside Megatron's modules: its norms get the
# routed input u and its addend v = dropout(out + bias) goes to the SourceBuffer (x <- x + v), so a fusion
# that hands the norm's input on as "the residual", or adds the residual in a linear, would compute
# something else. These are refused for the routed modes. `bias_dropout_fusion` is allowed: the routed
# layer never calls the bias-dropout-add module (it forms v itself, exactly; tests/test_fla_router.py).
RESIDUAL_FUSIONS = {
    "fused_residual_rmsnorm": ("--fused-residual-rmsnorm", "TE's fused RMSNorm returns its input as the "
                               "residual (x), but a routed sublayer's norm input is u = x + G(r)"),
    "fp32_residual_connection": ("--fp32-residual-connection", "the routed modes' residual stream is their "
                                 "sources, kept in the activation dtype; an fp32 copy would not be used"),
    "inference_fuse_tp_communication": ("--inference-fuse-tp-communication", "linear_proj would add the "
                                        "residual x inside its reduce-scatter, where a routed layer adds v "
                                        "to its sources"),
}


def check_residual_fusions(residual: str, **fusions: bool) -> None:
    """Refuse, for a routed mode, each fusion in RESIDUAL_FUSIONS that is switched on (ValueError naming the
    flag). Unknown names are ignored, so callers may pass whatever their config or args have."""
    if residual == "baseline":
        return
    for field, (flag, why) in RESIDUAL_FUSIONS.items():
        if fusions.get(field):
            raise ValueError(f"{flag} folds the residual add into a fused kernel and cannot be used with "
                             f"--residual {residual}: {why}. Leave {flag} off (the routed layer computes "
                             f"u = x + G(r) and x <- x + v itself)")


def validate_delta_flags(args) -> None:
    """Argument-parser hook: resolve `--delta-num-blocks` and reject bad combinations early."""
    from megatron_delta.arguments import ArgumentError

    try:
        args.delta_num_blocks = check_delta_options(
            args.residual, args.num_layers, args.delta_num_blocks, args.delta_null_source,
            args.delta_gate, args.delta_sources, args.router_lr_mult, args.delta_router_kernels)
        check_residual_fusions(args.residual, **{f: getattr(args, f, False) for f in RESIDUAL_FUSIONS})
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if args.delta_router_eps is None:
        args.delta_router_eps = args.norm_epsilon


@dataclass
class DeltaTransformerConfig(TransformerConfig):
    """TransformerConfig + residual routing. `residual='baseline'` is plain Megatron."""

    residual: str = "baseline"
    """One of baseline, attnres, full_attnres, delta, delta_block (see DESIGN.md section 1)."""
    delta_num_blocks: int | None = None
    """K for delta_block / attnres; None picks the default (4)."""
    delta_null_source: bool = False
    """Each router also reads a learnable, zero-initialised null source."""
    delta_gate: str = "none"
    """'scalar': u = x + a*r with a = 0 at init (the model starts as the baseline)."""
    delta_sources: str = "exact"
    """'exact' (DESIGN.md) or 'authors-code' (the public code's block sources)."""
    delta_router_eps: float = 1e-6
    """eps of the routers' key RMS norm."""
    delta_router_kernels: str = "auto"
    """'auto' / 'c': fused C kernels for fp32 CPU tensors (cpu_kernels.py); 'torch': PyTorch ops;
    'fla' (and 'auto' for CUDA tensors): fla-core's fused GPU kernel (fla_router.py)."""

    def __post_init__(self):
        super().__post_init__()
        self.delta_num_blocks = check_delta_options(
            self.residual, self.num_layers, self.delta_num_blocks, self.delta_null_source,
            self.delta_gate, self.delta_sources, router_kernels=self.delta_router_kernels)
        check_residual_fusions(self.residual, **{f: getattr(self, f, False) for f in RESIDUAL_FUSIONS})

    @property
    def routed(self) -> bool:
        return self.residual != "baseline"
