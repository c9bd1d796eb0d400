"""Self-checks of the independent float64 reference (tests/helpers/reference_delta.py) from docs/design.md section 1,
plus layout cross-checks against Megatron-Core's own modules (CPU, single rank).

Fast (seconds). Imports nothing from megatron_delta.
"""

import socket

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.reference_delta import (
    ADDITIVE_MODES,
    RefConfig,
    apply_rope,
    attention,
    backbone_param_shapes,
    init_reference_weights,
    mlp,
    reference_forward,
    reference_router_key,
    rms_norm,
    rope_freqs,
    route,
    router_param_names,
    split_qkv,
    weights_from_megatron_state_dict,
)

CFG = RefConfig(vocab_size=50, hidden_size=32, num_layers=4, num_attention_heads=4,
                num_query_groups=2, kv_channels=8, ffn_hidden_size=48)
B, S = 2, 8
K = 2


def _tokens(cfg=CFG, b=B, s=S, seed=0):
    return torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _kw(mode, sources="exact", **extra):
    kw = dict(mode=mode, sources=sources)
    if mode in ("delta_block", "attnres"):
        kw["num_blocks"] = K
    kw.update(extra)
    return kw


ALL_VARIANTS = [("baseline", "exact"), ("delta", "exact"), ("delta", "authors-code"),
                ("delta_block", "exact"), ("delta_block", "authors-code"),
                ("attnres", "exact"), ("full_attnres", "exact")]


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------
def test_router_matches_formula():
    g = torch.Generator().manual_seed(1)
    d, eps = 16, 1e-6
    srcs = [torch.randn(2, 3, d, generator=g, dtype=torch.float64) * (i + 1) for i in range(4)]
    w = torch.randn(d, generator=g, dtype=torch.float64)
    gn = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    r, alpha = route(srcs, w, gn, eps=eps)
    logits = []
    for s_ in srcs:
        rms = torch.sqrt((s_ ** 2).mean(-1) + eps)
        logits.append(((gn * s_ / rms[..., None]) * w).sum(-1))
    a_ref = torch.softmax(torch.stack(logits, -1), -1)
    torch.testing.assert_close(alpha, a_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(r, sum(a_ref[..., i:i + 1] * s_ for i, s_ in enumerate(srcs)),
                               rtol=1e-12, atol=1e-14)


def test_zero_query_gives_uniform_mean():
    g = torch.Generator().manual_seed(2)
    d = 16
    srcs = [torch.randn(2, 3, d, generator=g, dtype=torch.float64) for _ in range(5)]
    r, alpha = route(srcs, torch.zeros(d, dtype=torch.float64),
                     torch.rand(d, generator=g, dtype=torch.float64))
    torch.testing.assert_close(alpha, torch.full_like(alpha, 1 / 5), rtol=0, atol=1e-15)
    torch.testing.assert_close(r, torch.stack(srcs).mean(0), rtol=1e-13, atol=1e-14)


def test_zero_sources_and_null_source():
    d = 8
    like = torch.randn(2, 3, d, dtype=torch.float64)
    w, gn = torch.randn(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64)
    r, alpha = route([], w, gn, like=like)
    assert alpha.shape == (2, 3, 0) and torch.equal(r, torch.zeros_like(like))
    z = torch.randn(d, dtype=torch.float64)
    r, alpha = route([], w, gn, null_source=z, like=like)
    assert alpha.shape == (2, 3, 1) and torch.equal(alpha, torch.ones_like(alpha))
    torch.testing.assert_close(r, z.expand_as(like))
    # the null source is the LAST source and its logit is computed like the others
    s1 = torch.randn(2, 3, d, dtype=torch.float64)
    _, a2 = route([s1], w, gn, null_source=z, eps=1e-5)
    _, a_ref = route([s1, z.expand_as(s1).clone()], w, gn, eps=1e-5)
    torch.testing.assert_close(a2, a_ref, rtol=1e-14, atol=1e-15)


def test_router_names():
    assert reference_router_key(0, "query") == "decoder.layers.0.self_attention_router.query"
    assert reference_router_key(5, "gate") == "decoder.layers.2.mlp_router.gate"
    assert reference_router_key("final", "null_source") == "decoder.final_router.null_source"
    assert router_param_names(CFG, "baseline") == []
    n = router_param_names(CFG, "delta", null_source=True, gate=True)
    assert len(n) == 2 * CFG.num_layers * 4
    n = router_param_names(CFG, "attnres", null_source=True, gate=True)  # no gate in replacement
    assert len(n) == (2 * CFG.num_layers + 1) * 3 and not any(x.endswith(".gate") for x in n)


# ---------------------------------------------------------------------------------------------
# Initialisation facts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,sources", [v for v in ALL_VARIANTS if v[0] in ADDITIVE_MODES])
@pytest.mark.parametrize("null", [False, True])
def test_zero_gate_equals_baseline_exactly(mode, sources, null):
    """With the scalar gate at 0, u = x + 0*r = x: bitwise the baseline (random w, g, z)."""
    w = init_reference_weights(CFG, mode, null_source=null, gate=True, seed=3)
    for j in range(2 * CFG.num_layers):
        w[reference_router_key(j, "gate")] = torch.zeros(1, dtype=torch.float64)
    tok = _tokens()
    base = reference_forward(w, CFG, tok, "baseline")
    out = reference_forward(w, CFG, tok, null_source=null, gate=True, **_kw(mode, sources))
    assert torch.equal(out, base)
    # and the gate is live: a != 0 changes the function
    w[reference_router_key(1, "gate")] = torch.ones(1, dtype=torch.float64)
    out = reference_forward(w, CFG, tok, null_source=null, gate=True, **_kw(mode, sources))
    assert _rel(out, base) > 1e-3


def _design_init(cfg, mode, seed=4, **kw):
    return init_reference_weights(cfg, mode, seed=seed, router_init="design", **kw)


@pytest.mark.parametrize("mode,sources,null", [
    ("delta", "exact", False), ("delta_block", "exact", False),
    ("delta", "exact", True), ("delta_block", "exact", True),
    # authors-code delta: layer 0's attention reads nothing (u = x), later sublayers read
    # [h0, v_0..v_{j-1}] which sum to x -> still scale-only. (DESIGN's "does not hold" is
    # about authors-code delta_block; see the next test.)
    ("delta", "authors-code", False),
])
def test_zero_query_preserves_function_up_to_norm_eps(mode, sources, null):
    """u = (1 + 1/N) x and RMSNorm is scale invariant except through eps.

    RMSNorm(c x) / RMSNorm(x) = c sqrt(m + eps) / sqrt(c^2 m + eps) = 1 + (eps / 2m)(1 - 1/c^2) + O(eps^2)
    (m = mean(x^2)): with eps = 0 the two models agree to float64 round-off, with eps > 0 they
    differ by O(eps / m) relative."""
    tok = _tokens()
    # eps = 0 in every norm (the router's eps does not matter with a zero query): round-off only
    cfg0 = RefConfig(**{**CFG.__dict__, "norm_eps": 0.0})
    w = _design_init(cfg0, mode, null_source=null)
    base = reference_forward(w, cfg0, tok, "baseline")
    out = reference_forward(w, cfg0, tok, null_source=null, eps=1e-6, **_kw(mode, sources))
    assert _rel(out, base) < 1e-12
    # eps = 1e-5 (Megatron's default): only the eps effect, O(1e-6) for these activations
    w = _design_init(CFG, mode, null_source=null)
    base = reference_forward(w, CFG, tok, "baseline")
    out = reference_forward(w, CFG, tok, null_source=null, **_kw(mode, sources))
    rel = _rel(out, base)
    assert 1e-12 < rel < 2e-5, rel


def test_zero_query_authors_code_delta_block_differs():
    tok = _tokens()
    cfg0 = RefConfig(**{**CFG.__dict__, "norm_eps": 0.0})
    w = _design_init(cfg0, "delta_block")
    base = reference_forward(w, cfg0, tok, "baseline")
    out = reference_forward(w, cfg0, tok, **_kw("delta_block", "authors-code"))
    assert _rel(out, base) > 1e-2


@pytest.mark.parametrize("mode,sources", [v for v in ALL_VARIANTS if v[0] != "baseline"])
def test_zero_query_routing_is_uniform(mode, sources):
    w = _design_init(CFG, mode)
    _, alphas, counts = reference_forward(w, CFG, _tokens(), return_routing=True, **_kw(mode, sources))
    for a, n in zip(alphas, counts):
        assert a.shape == (B, S, n)
        if n:
            torch.testing.assert_close(a, torch.full_like(a, 1 / n), rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# Source counts and source structure
# ---------------------------------------------------------------------------------------------
CFG12 = RefConfig(vocab_size=16, hidden_size=16, num_layers=12, num_attention_heads=2,
                  kv_channels=8, ffn_hidden_size=16)


def _counts(mode, sources="exact", num_blocks=None, null=False, cfg=CFG12):
    w = init_reference_weights(cfg, mode, null_source=null, seed=5)
    _, alphas, counts = reference_forward(w, cfg, _tokens(cfg, 1, 3), mode, num_blocks=num_blocks,
                                          sources=sources, null_source=null, return_routing=True)
    assert [a.shape[-1] for a in alphas] == [c + null for c in counts]
    return counts


def test_source_counts_delta():
    L = CFG12.num_layers
    assert _counts("delta") == [j + 1 for j in range(2 * L)]  # max 2L = 24 (h0 + v_0..v_22)
    assert _counts("delta", "authors-code") == [0] + [j + 1 for j in range(1, 2 * L)]


@pytest.mark.parametrize("k", [1, 3, 4, 12])
def test_source_counts_delta_block(k):
    L = CFG12.num_layers
    lpb = L // k
    exact = _counts("delta_block", num_blocks=k)
    assert exact == [1 + (j // 2) // lpb + (0 if j % 2 == 0 and (j // 2) % lpb == 0 else 1)
                     for j in range(2 * L)]
    assert max(exact) == k + 1
    authors = _counts("delta_block", "authors-code", num_blocks=k)
    assert authors == [(j // 2) // lpb + (0 if j % 2 == 0 and (j // 2) % lpb == 0 else 1)
                       for j in range(2 * L)]
    assert authors[0] == 0 and max(authors) == k


@pytest.mark.parametrize("k", [1, 4, 12])
def test_source_counts_replacement(k):
    L = CFG12.num_layers
    lpb = L // k
    # attnres: sources B + [p]; B gains an entry at each block start -> block b reads b+2 sources
    # (its first attention sublayer reads b+1: B before the append plus p)
    c = _counts("attnres", num_blocks=k)
    assert c[:-1] == [(j // 2) // lpb + (1 if j % 2 == 0 and (j // 2) % lpb == 0 else 2)
                      for j in range(2 * L)]
    assert c[-1] == k + 1  # final router: B (h0 + K-1 completed blocks) ... + [p]
    full = _counts("full_attnres")
    assert full == [j + 1 for j in range(2 * L)] + [2 * L + 1]
    assert _counts("full_attnres", null=True) == full


def _collect(mode, sources="exact", cfg=CFG, num_blocks=K, seed=6, **kw):
    w = init_reference_weights(cfg, mode, seed=seed, **kw)
    recs = []
    reference_forward(w, cfg, _tokens(cfg), mode, num_blocks=num_blocks, sources=sources,
                      debug_hook=recs.append, **kw)
    return recs


@pytest.mark.parametrize("mode", ["delta", "delta_block"])
def test_exact_sources_sum_to_residual_stream(mode):
    for rec in _collect(mode):
        torch.testing.assert_close(sum(rec["sources"]), rec["x"], rtol=1e-12, atol=1e-12)


def test_exact_delta_block_source_structure():
    recs = _collect("delta_block")
    h0 = recs[0]["x"]
    lpb = CFG.num_layers // K
    for rec in recs:
        j = rec["receiver"]
        assert torch.equal(rec["sources"][0], h0)
        if j % 2 == 0 and (j // 2) % lpb == 0:
            # first sublayer of a block: h0 + completed block sums, no partial source
            assert len(rec["sources"]) == 1 + (j // 2) // lpb
    # Delta_0 is the difference of the stream at the two block boundaries
    start1 = 2 * lpb
    torch.testing.assert_close(recs[start1]["sources"][1], recs[start1]["x"] - h0, rtol=1e-12,
                               atol=1e-12)


def test_authors_code_delta_block_alternating_sums():
    cfg = RefConfig(**{**CFG.__dict__, "num_layers": 6})
    recs = _collect("delta_block", "authors-code", cfg=cfg, num_blocks=3)
    H = [recs[2 * layer]["x"] for layer in (0, 2, 4)]  # stream before each block's first attention
    assert recs[0]["sources"] == []  # layer 0's attention reads nothing
    last = recs[-1]["sources"]
    assert len(last) == 3
    torch.testing.assert_close(last[0], H[0], rtol=0, atol=0)
    torch.testing.assert_close(last[1], H[1] - H[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last[2], H[2] - H[1] + H[0], rtol=1e-12, atol=1e-12)
    # the first layer of block 1 routes BEFORE appending; its MLP sees the new source
    assert len(recs[4]["sources"]) == 1 and len(recs[5]["sources"]) == 2
    # the sources do not sum to the stream
    assert _rel(sum(recs[-1]["sources"]), recs[-1]["x"]) > 1e-2


def test_authors_code_delta_layer0_reads_nothing_then_h0():
    recs = _collect("delta", "authors-code")
    assert recs[0]["sources"] == [] and torch.equal(recs[0]["u"], recs[0]["x"])
    h0 = recs[0]["x"]
    assert torch.equal(recs[1]["sources"][0], h0) and len(recs[1]["sources"]) == 2
    torch.testing.assert_close(recs[1]["sources"][1], recs[1]["x"] - h0, rtol=1e-12, atol=1e-12)


def test_authors_code_null_source_at_layer0():
    recs = _collect("delta", "authors-code", null_source=True)
    assert recs[0]["alpha"].shape[-1] == 1 and torch.equal(recs[0]["alpha"],
                                                           torch.ones_like(recs[0]["alpha"]))
    # r = z broadcast to every token
    assert torch.allclose(recs[0]["r"], recs[0]["r"][0, 0].expand_as(recs[0]["r"]))


def test_replacement_first_sublayer_reads_h0():
    for mode in ("attnres", "full_attnres"):
        recs = _collect(mode)
        assert len(recs[0]["sources"]) == 1
        torch.testing.assert_close(recs[0]["u"], recs[0]["sources"][0], rtol=0, atol=0)
        assert recs[-1]["receiver"] == "final"


def test_full_attnres_sources_are_previous_outputs():
    recs = _collect("full_attnres")
    for j in range(1, len(recs)):
        prev, cur = recs[j - 1]["sources"], recs[j]["sources"]
        assert len(cur) == len(prev) + 1
        for a, b in zip(prev, cur):  # B.append(p): earlier sources unchanged
            assert torch.equal(a, b)


def test_attnres_partial_block_accumulates():
    recs = _collect("attnres", cfg=RefConfig(**{**CFG.__dict__, "num_layers": 4}), num_blocks=2)
    # block 0 = layers 0,1 (sublayers 0..3), block 1 = sublayers 4..7
    # sublayer 4 (first of block 1): B = [h0], p = v0+v1+v2+v3; afterwards B = [h0, that p]
    p_block0 = recs[4]["sources"][-1]
    assert len(recs[4]["sources"]) == 2
    assert len(recs[5]["sources"]) == 3 and torch.equal(recs[5]["sources"][1], p_block0)


# ---------------------------------------------------------------------------------------------
# Gradients / parameter wiring / misc
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,sources", [v for v in ALL_VARIANTS if v[0] != "baseline"])
def test_every_parameter_gets_a_gradient(mode, sources):
    gate = mode in ADDITIVE_MODES
    w = init_reference_weights(CFG, mode, null_source=True, gate=gate, seed=7)
    w = {k: v.requires_grad_() for k, v in w.items()}
    out = reference_forward(w, CFG, _tokens(), null_source=True, gate=gate, **_kw(mode, sources))
    assert out.dtype == torch.float64 and out.shape == (B, S, CFG.vocab_size)
    out.square().mean().backward()
    # authors-code: receiver 0 reads only the null source (one source: alpha = 1, so its query
    # and key-norm weight get no gradient)
    single = ({reference_router_key(0, f) for f in ("query", "key_norm_weight")}
              if sources == "authors-code" else set())
    for name in router_param_names(CFG, mode, null_source=True, gate=gate):
        if name in single:
            assert w[name].grad is None or w[name].grad.abs().max() == 0, name
            continue
        assert w[name].grad is not None and w[name].grad.abs().max() > 0, name
    for name in backbone_param_shapes(CFG):
        assert w[name].grad is not None, name


def test_tied_output_weights():
    cfg = RefConfig(**{**CFG.__dict__, "share_embeddings_and_output_weights": True})
    w = init_reference_weights(cfg, "baseline", seed=8)
    assert "output_layer.weight" not in w
    tok = _tokens()
    w_untied = dict(w, **{"output_layer.weight": w["embedding.word_embeddings.weight"]})
    torch.testing.assert_close(reference_forward(w, cfg, tok),
                               reference_forward(w_untied, CFG, tok), rtol=0, atol=0)


def test_attention_core_matches_torch_sdpa():
    """Causal GQA attention with scale 1/sqrt(hn), against torch's own SDPA (no RoPE, no qk-norm)."""
    cfg = RefConfig(**{**CFG.__dict__, "qk_layernorm": False})
    w = init_reference_weights(cfg, "baseline", seed=9)
    p = "decoder.layers.0.self_attention."
    x = torch.randn(B, S, cfg.hidden_size, dtype=torch.float64)
    out = attention(x, w, p, cfg, None)
    q, k, v = split_qkv(x @ w[p + "linear_qkv.weight"].T, cfg)
    ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    ref = ctx.transpose(1, 2).reshape(B, S, -1) @ w[p + "linear_proj.weight"].T
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_causality():
    for mode, sources in ALL_VARIANTS:
        w = init_reference_weights(CFG, mode, null_source=True, seed=10)
        tok = _tokens()
        tok2 = tok.clone()
        tok2[:, -1] = (tok2[:, -1] + 1) % CFG.vocab_size
        a = reference_forward(w, CFG, tok, null_source=True, **_kw(mode, sources))
        b = reference_forward(w, CFG, tok2, null_source=True, **_kw(mode, sources))
        assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1]), mode


# ---------------------------------------------------------------------------------------------
# Cross-checks against Megatron-Core (CPU, one rank)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_gpt():
    """A Megatron-Core GPTModel (local spec, RMSNorm, qk-norm, swiglu, no bias, RoPE, GQA) on CPU."""
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    created_pg = created_mp = False
    if not torch.distributed.is_initialized():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)
        created_pg = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        created_mp = True
    torch.manual_seed(11)
    tcfg = TransformerConfig(
        num_layers=CFG.num_layers, hidden_size=CFG.hidden_size,
        num_attention_heads=CFG.num_attention_heads, num_query_groups=CFG.num_query_groups,
        kv_channels=CFG.kv_channels, ffn_hidden_size=CFG.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=CFG.norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        init_method_std=0.2, bias_activation_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        bias_dropout_fusion=False)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(tcfg, spec, vocab_size=CFG.vocab_size, max_sequence_length=64,
                     position_embedding_type="rope", rotary_base=int(CFG.rotary_base),
                     share_embeddings_and_output_weights=False).eval()
    with torch.no_grad():  # non-trivial norm weights so their layout matters
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    yield model, tcfg
    if created_mp:
        parallel_state.destroy_model_parallel()
    if created_pg:
        torch.distributed.destroy_process_group()


def test_megatron_state_dict_names_and_shapes(megatron_gpt):
    model, _ = megatron_gpt
    w = weights_from_megatron_state_dict(model.state_dict())
    assert {k: tuple(v.shape) for k, v in w.items()} == backbone_param_shapes(CFG)


def test_megatron_components_match(megatron_gpt):
    """Piecewise: embedding, norms, fused-QKV split + qk-norm, RoPE, linear_proj, swiglu MLP,
    final norm, output layer - each against Megatron's own module on CPU (fp32 vs float64).
    (The core attention is covered by test_attention_core_matches_torch_sdpa and the full check.)"""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    model, tcfg = megatron_gpt
    w = weights_from_megatron_state_dict(model.state_dict())
    tok = _tokens()
    tol = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        emb = model.embedding(tok, torch.arange(S)[None].expand(B, S))  # [s, b, d]
        h0 = F.embedding(tok, w["embedding.word_embeddings.weight"])
        torch.testing.assert_close(emb.transpose(0, 1).double(), h0, rtol=0, atol=0)
        x = torch.randn(S, B, CFG.hidden_size)  # Megatron layout
        xr = x.transpose(0, 1).double()
        for i, layer in enumerate(model.decoder.layers):
            p = f"decoder.layers.{i}."
            hn = layer.input_layernorm(x)
            hr = rms_norm(xr, w[p + "input_layernorm.weight"], CFG.norm_eps)
            torch.testing.assert_close(hn.transpose(0, 1).double(), hr, **tol)
            q, k, v = layer.self_attention.get_query_key_value_tensors(hn, None)
            qr, kr, vr = split_qkv(hr @ w[p + "self_attention.linear_qkv.weight"].T, CFG)
            qr = rms_norm(qr, w[p + "self_attention.q_layernorm.weight"], CFG.norm_eps)
            kr = rms_norm(kr, w[p + "self_attention.k_layernorm.weight"], CFG.norm_eps)
            for a, b in ((q, qr), (k, kr), (v, vr)):
                torch.testing.assert_close(a.transpose(0, 1).double(), b, **tol)
            # RoPE: Megatron's inv_freq (CPU) and its apply_rotary_pos_emb, non-interleaved
            rope = model.rotary_pos_emb
            freqs = rope.get_freqs_non_repeated(S)  # [s, hn/2], stays on CPU
            emb_m = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
            emb_r = rope_freqs(CFG, S)
            torch.testing.assert_close(emb_m[:, 0, 0].double(), emb_r, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(apply_rotary_pos_emb(q, emb_m, config=tcfg).transpose(0, 1).double(),
                                       apply_rope(qr, emb_r), **tol)
            ctx = torch.randn(S, B, CFG.num_attention_heads * CFG.kv_channels)
            torch.testing.assert_close(
                layer.self_attention.linear_proj(ctx)[0].transpose(0, 1).double(),
                ctx.transpose(0, 1).double() @ w[p + "self_attention.linear_proj.weight"].T, **tol)
            hm = layer.pre_mlp_layernorm(x)
            hmr = rms_norm(xr, w[p + "pre_mlp_layernorm.weight"], CFG.norm_eps)
            torch.testing.assert_close(layer.mlp(hm)[0].transpose(0, 1).double(),
                                       mlp(hmr, w, p + "mlp."), **tol)
        xf = model.decoder.final_layernorm(x)
        xfr = rms_norm(xr, w["decoder.final_layernorm.weight"], CFG.norm_eps)
        torch.testing.assert_close(xf.transpose(0, 1).double(), xfr, **tol)
        torch.testing.assert_close(model.output_layer(xf)[0].transpose(0, 1).double(),
                                   xfr @ w["output_layer.weight"].T, **tol)


def test_megatron_full_forward_matches_baseline(megatron_gpt):
    """Whole GPTModel logits vs the baseline reference. Megatron-Core's DotProductAttention (global
    memory buffer) and RotaryEmbedding.get_emb call torch.cuda.current_device(): without CUDA the
    package's CPU adaptation of Megatron makes that the CPU device."""
    from megatron.core import tensor_parallel

    from megatron_delta.platform.cpu import activate_cpu_platform

    activate_cpu_platform()
    tensor_parallel.model_parallel_cuda_manual_seed(11)  # attention forks the model-parallel RNG
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = megatron_gpt
    w = weights_from_megatron_state_dict(model.state_dict())
    tok = _tokens()
    model = model.to(dev)
    try:
        with torch.no_grad():
            out = model(tok.to(dev), torch.arange(S, device=dev)[None].expand(B, S), None)
    finally:
        model.cpu()
    ref = reference_forward(w, CFG, tok, "baseline")
    assert _rel(out.double().cpu(), ref) < 1e-4
