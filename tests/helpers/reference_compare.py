"""What a comparison of a Megatron model with the float64 reference (tests/helpers/reference_delta.py) needs: random
router and norm parameters, so that every routing path matters, and the relative error of the result."""
import torch


def rel_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def randomise(model, seed=7):
    """Random router parameters (query, key norm, null source, non-zero gate) and perturbed backbone
    norm weights, so that every routing path and every parameter layout matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith(".query"):
                p.copy_(0.3 * r)
            elif name.endswith(".key_norm_weight"):
                p.copy_(1 + 0.2 * r)
            elif name.endswith(".null_source"):
                p.copy_(0.05 * r)
            elif name.endswith(".gate"):
                p.copy_(0.5 + 0.5 * torch.rand(p.shape, generator=g))  # in [0.5, 1): non-zero
            elif p.dim() == 1:  # backbone norm weights
                p.add_(0.1 * r)
