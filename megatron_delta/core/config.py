"""DeltaTransformerConfig: Megatron's TransformerConfig plus the residual-routing fields (`delta_*`).

The rules about which residual options go together live in `modes.check_delta_options`, used both by the
dataclass's `__post_init__` (library users) and by the argument parser (so pretrain_gpt.py fails before
any Megatron code runs). Messages name the command-line flag, since that is what most users typed.
"""

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_delta.core.cpu_kernels import KERNEL_CHOICES
from megatron_delta.core.modes import check_delta_options

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
        if self.delta_router_kernels not in KERNEL_CHOICES:
            raise ValueError(f"--delta-router-kernels {self.delta_router_kernels!r} is not one of "
                             f"{', '.join(KERNEL_CHOICES)}")
        self.delta_num_blocks = check_delta_options(
            self.residual, self.num_layers, self.delta_num_blocks, self.delta_null_source,
            self.delta_gate, self.delta_sources, router_kernels=self.delta_router_kernels)
        check_residual_fusions(self.residual, **{f: getattr(self, f, False) for f in RESIDUAL_FUSIONS})

    @property
    def routed(self) -> bool:
        return self.residual != "baseline"
