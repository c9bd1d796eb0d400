"""Norms for the local (non-TE) backend that support sequence parallelism.

Megatron-Core's local spec uses WrappedTorchNorm, which refuses `sequence_parallel` (it asserts). These
norms compute the same function and mark their weights `sequence_parallel`, so Megatron's
finalize_model_grads sums their partial gradients over the TP group, exactly as it does for TENorm.
"""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class LocalNorm(torch.nn.Module):
    """RMSNorm or LayerNorm over the last dimension, computed in fp32, with an SP-aware weight."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        else:
            y = torch.nn.functional.layer_norm(xf, xf.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)
