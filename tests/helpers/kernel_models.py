"""The model side shared by the fused-kernel tests (tests/helpers/triton_cases.py: the project's Triton kernels;
tests/unit/test_fla_router.py: fla-core's kernel): a 4-layer model of a mode with its routers on a chosen backend
and random router parameters (tests/helpers/reference_compare.randomise), and the comparison of a kernel model's
logits and gradients with the PyTorch-path model's and the float64 reference's (tests/helpers/reference_delta)."""
from types import SimpleNamespace

import torch

from tests.helpers import reference_delta as R
from tests.helpers.reference_compare import randomise

B, S, V, HIDDEN = 2, 8, 64, 32


def build(mode, null, gate, kernels, recompute=False, num_layers=4, num_blocks=2, group_size=None):
    """(model, fields): ``num_layers`` layers, K = ``num_blocks`` for the block modes, ``kernels`` the routers'
    backend; ``recompute``: full recompute (train mode) of every layer (True) or by (method, n), else eval mode;
    ``group_size``: --delta-router-group-size (default auto)."""
    from megatron.core import tensor_parallel

    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.core.modes import BLOCK_MODES

    method, step = recompute if isinstance(recompute, tuple) else ("uniform", 1)
    fields = resolve_model_fields(dict(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4,
                  num_query_groups=2, seq_length=S, vocab_size=V, norm_epsilon=1e-6, residual=mode,
                  delta_null_source=null, delta_gate="scalar" if gate else "none",
                  delta_num_blocks=num_blocks if mode in BLOCK_MODES else None,
                  **(dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=step)
                     if recompute else {})))
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    extra = {} if group_size is None else dict(delta_router_group_size=group_size)
    config, options = model_config(fields, delta_router_kernels=kernels, **extra)
    model = build_model_chunks(config, V, **options)[0]
    randomise(model)
    return (model.train() if recompute else model.eval()), SimpleNamespace(**fields)


def batch():
    """(tokens, positions, W): the inputs and the weights of the loss (logits * W).sum()."""
    tok = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(S)[None].expand(B, S)
    W = torch.randn(B, S, V, generator=torch.Generator().manual_seed(3))
    return tok, pos, W


def assert_matches_torch(kernel, torch_path):
    """``kernel`` and ``torch_path``: (logits, {name: grad}): the logits and every parameter's gradient agree."""
    (lf, gf), (lt, gt) = kernel, torch_path
    torch.testing.assert_close(lf, lt, rtol=1e-5, atol=1e-5 * lt.abs().max().item())
    for n in gt:
        assert (gf[n] is None) == (gt[n] is None), n
        if gt[n] is not None:
            torch.testing.assert_close(gf[n], gt[n], rtol=1e-4, atol=1e-4 * gt[n].abs().max().item(), msg=n)


def assert_matches_reference(model, fields, logits, grads, tok, W, mode, null, gate):
    """The kernel model's ``logits`` and its routers' ``grads`` equal the float64 reference model's (the same
    weights, tests/helpers/reference_delta.reference_forward)."""
    w = R.weights_from_megatron_state_dict(model.state_dict())
    routers = [k for k in w if "router" in k]
    for k in routers:
        w[k].requires_grad_(True)
    cfg = R.RefConfig(vocab_size=V, hidden_size=HIDDEN, num_layers=fields.num_layers, num_attention_heads=4,
                      num_query_groups=2,
                      kv_channels=fields.kv_channels, ffn_hidden_size=fields.ffn_hidden_size, norm_eps=1e-6,
                      rotary_base=float(fields.rotary_base),
                      share_embeddings_and_output_weights=not fields.untie_embeddings_and_output_weights)
    ref = R.reference_forward(w, cfg, tok, mode=mode, num_blocks=fields.delta_num_blocks, null_source=null,
                              gate=gate, eps=fields.delta_router_eps)
    assert ((logits.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    (ref * W.double()).sum().backward()
    for kind in {k.rsplit(".", 1)[1] for k in routers}:
        names = [k for k in routers if k.endswith("." + kind)]
        scale = max(w[k].grad.abs().max().item() for k in names if w[k].grad is not None)
        for k in names:
            want = torch.zeros_like(w[k]) if w[k].grad is None else w[k].grad
            assert (grads[k].double() - want).abs().max().item() / scale < 1e-4, k
