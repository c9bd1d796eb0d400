"""Independent float64 reference for Delta Attention Residuals (docs/design.md section 1).

Written from docs/design.md section 1 alone. It imports nothing from ``megatron_delta``
(and nothing from Megatron either): it is the yardstick the Megatron implementation is tested
against. Plain PyTorch, float64 everywhere, written the obvious way (sources are ``torch.stack``-ed).

Backbone
--------
A small GPT / Qwen3-style pre-norm decoder with the semantics of Megatron-Core's ``GPTModel`` built
from ``get_gpt_layer_local_spec(qk_layernorm=True, normalization='RMSNorm')`` with swiglu, no biases,
RoPE, GQA:

* RMSNorm: ``x * rsqrt(mean(x^2) + eps) * weight`` (torch.nn.RMSNorm, what Megatron's local spec uses).
* Attention: fused QKV projection in Megatron's per-group interleaved layout (see ``split_qkv``),
  optional RMSNorm of q and k per head (over head_dim), then RoPE (non-interleaved rotate-half,
  rotary_percent 1.0), causal softmax with scale 1/sqrt(head_dim), output projection ``linear_proj``.
* MLP: ``fc2(silu(gate) * up)`` with ``[gate; up] = chunk(fc1(x), 2)``.
* Final RMSNorm, output layer (untied, or tied to the word embeddings).

Layout: tokens are ``[b, s]``; INTERNALLY this reference uses ``[b, s, d]`` (Megatron uses
``[s, b, d]``); logits come out as ``[b, s, vocab]`` (as Megatron's GPTModel returns them).
Routing weights returned by ``reference_forward(..., return_routing=True)`` are ``[b, s, N]``.

Weights
-------
A plain dict ``name -> tensor`` whose names mirror Megatron-Core's GPTModel state_dict (local spec)::

    embedding.word_embeddings.weight                       [V, d]
    decoder.layers.{i}.input_layernorm.weight              [d]
    decoder.layers.{i}.self_attention.linear_qkv.weight    [ng*(np/ng+2)*hn, d]
    decoder.layers.{i}.self_attention.q_layernorm.weight   [hn]      (qk_layernorm only)
    decoder.layers.{i}.self_attention.k_layernorm.weight   [hn]      (qk_layernorm only)
    decoder.layers.{i}.self_attention.linear_proj.weight   [d, np*hn]
    decoder.layers.{i}.pre_mlp_layernorm.weight            [d]
    decoder.layers.{i}.mlp.linear_fc1.weight               [2*ffn, d]  ([gate; up])
    decoder.layers.{i}.mlp.linear_fc2.weight               [d, ffn]
    decoder.final_layernorm.weight                         [d]
    output_layer.weight                                    [V, d]    (absent when tied)

Multi-latent attention (``cfg.kv_lora_rank`` set; DeepSeek-V2/V3's attention, Megatron-Core's local MLA spec
names, see ``mla_attention``) replaces linear_qkv / q_layernorm / k_layernorm by::

    decoder.layers.{i}.self_attention.linear_q_down_proj.weight  [q_lora_rank, d]      (q_lora_rank set)
    decoder.layers.{i}.self_attention.q_layernorm.weight         [q_lora_rank]         (q_lora_rank set)
    decoder.layers.{i}.self_attention.linear_q_up_proj.weight    [np*(dn+dr), q_lora_rank]
    decoder.layers.{i}.self_attention.linear_q_proj.weight       [np*(dn+dr), d]       (q_lora_rank None)
    decoder.layers.{i}.self_attention.linear_kv_down_proj.weight [kv_lora_rank+dr, d]
    decoder.layers.{i}.self_attention.kv_layernorm.weight        [kv_lora_rank]
    decoder.layers.{i}.self_attention.linear_kv_up_proj.weight   [np*(dn+dv), kv_lora_rank]
    decoder.layers.{i}.self_attention.linear_proj.weight         [d, np*dv]

(dn = qk_head_dim, dr = qk_pos_emb_head_dim, dv = v_head_dim; the latent norms with ``qk_layernorm``, as
Megatron's --qk-layernorm; DeepSeek's models have them.)

Router parameters (names chosen here; map them with ``reference_router_key``)::

    receiving sublayer j = 2i   (attention of layer i): decoder.layers.{i}.self_attention_router.{which}
    receiving sublayer j = 2i+1 (MLP of layer i):       decoder.layers.{i}.mlp_router.{which}
    final router (replacement modes only):              decoder.final_router.{which}

    which: query [d] (w), key_norm_weight [d] (g), null_source [d] (z, optional),
           gate [1] (a, optional, additive modes only; any shape broadcastable to a scalar).

Multi-token prediction (``mtp_num_layers`` D > 0; docs/design.md section 1.7), depth k = 0..D-1, named as
Megatron's MultiTokenPredictionLayer state_dict::

    mtp.layers.{k}.enorm.weight, hnorm.weight, final_layernorm.weight    [d]
    mtp.layers.{k}.eh_proj.weight                                        [d, 2d]  (input [enorm(e); hnorm(h)])
    mtp.layers.{k}.mtp_model_layer.<a decoder layer's names>             (its one transformer layer)
    mtp.layers.{k}.mtp_model_layer.{self_attention,mlp}_router.{which}   (replacement modes)
    mtp.layers.{k}.final_router.{which}                                  (replacement modes)

Conventions (decided here where docs/design.md is silent)
----------------------------------------------------
* Router rms eps: ``eps`` argument of ``reference_forward``; default ``cfg.norm_eps``.
* Zero sources (authors-code: layer 0's attention in ``delta`` and ``delta_block``): routing over
  zero sources gives ``r = 0`` and an empty weight vector ``alpha`` of shape ``[b, s, 0]``; so
  ``u = x``. With the null source present, such a receiver reads only the null source:
  ``alpha = 1`` on it and ``r = z``.
* Null source: appended as the LAST source of every router (also the final router); its value
  is ``z`` broadcast to every token and its logit is computed exactly like the others, from ``z``.
  ``num_sources`` counts the real sources only; ``alpha.shape[-1] == num_sources + 1`` then.
  (A zero ``z`` needs a router eps > 0: its key is 0 / sqrt(0 + eps) = 0, logit 0.)
* Gate (``gate=True``): ``G(r) = a * r``, additive modes (``delta``, ``delta_block``) only.
* ``num_blocks`` must divide ``num_layers``; block of layer i is ``i // (L // K)``.
* Order of sources (order only matters for the returned ``alpha``):
  - delta/exact:        [h0, v_0, ..., v_{j-1}]
  - delta/authors-code: []  for j = 0, then [h0, v_0, ..., v_{j-1}]
  - delta_block/exact:  [h0, Delta_0, ..., Delta_{b-1}, P_b (if non-empty)]
  - delta_block/authors-code: [H_0, H_1 - H_0, H_2 - (H_1 - H_0), ...] (blocks list of the
    public code; H_c = residual stream before the attention of the first layer of block c)
  - attnres / full_attnres: B + [p]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

DTYPE = torch.float64
MODES = ("baseline", "delta", "delta_block", "attnres", "full_attnres")
ADDITIVE_MODES = ("delta", "delta_block")
REPLACEMENT_MODES = ("attnres", "full_attnres")
SOURCE_DEFS = ("exact", "authors-code")
ROUTER_FIELDS = ("query", "key_norm_weight", "null_source", "gate")


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------
@dataclass
class RefConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # GQA; None -> num_attention_heads (MHA)
    kv_channels: Optional[int] = None  # head dim; None -> hidden_size // num_attention_heads
    ffn_hidden_size: int = 64
    qk_layernorm: bool = True
    norm_eps: float = 1e-5  # Megatron's default layernorm_epsilon
    rotary_base: float = 10000.0
    position_embedding_type: str = "rope"  # 'rope' or 'none'
    share_embeddings_and_output_weights: bool = False
    # multi-latent attention (DeepSeek-V2/V3) when kv_lora_rank is set; plain RoPE on the dr dimensions
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None  # None: one query projection (linear_q_proj)
    qk_head_dim: int = 16
    qk_pos_emb_head_dim: int = 8
    v_head_dim: int = 16

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        assert self.num_attention_heads % self.num_query_groups == 0
        assert self.kv_channels % 2 == 0
        assert self.position_embedding_type in ("rope", "none")


# ----------------------------------------------------------------------------------------------
# Router naming
# ----------------------------------------------------------------------------------------------
def reference_router_key(sublayer_j, which: str) -> str:
    """Name of a router parameter. ``sublayer_j``: 0..2L-1, or ``'final'`` for the final router.
    ``which``: 'query' (w), 'key_norm_weight' (g), 'null_source' (z) or 'gate' (a)."""
    assert which in ROUTER_FIELDS, which
    if sublayer_j == "final":
        assert which != "gate", "the final router has no gate"
        return f"decoder.final_router.{which}"
    j = int(sublayer_j)
    layer, kind = j // 2, ("self_attention_router" if j % 2 == 0 else "mlp_router")
    return f"decoder.layers.{layer}.{kind}.{which}"


def router_receivers(cfg: RefConfig, mode: str) -> list:
    """The receivers that own a router in ``mode``: 0..2L-1, plus 'final' for replacement modes."""
    if mode == "baseline":
        return []
    recv = list(range(2 * cfg.num_layers))
    if mode in REPLACEMENT_MODES:
        recv.append("final")
    return recv


def router_param_names(cfg: RefConfig, mode: str, null_source: bool = False, gate: bool = False):
    """All router parameter names used by ``mode`` (in receiver order)."""
    assert mode in MODES, mode
    gate = gate and mode in ADDITIVE_MODES
    names = []
    for j in router_receivers(cfg, mode):
        names.append(reference_router_key(j, "query"))
        names.append(reference_router_key(j, "key_norm_weight"))
        if null_source:
            names.append(reference_router_key(j, "null_source"))
        if gate and j != "final":
            names.append(reference_router_key(j, "gate"))
    return names


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------
def backbone_param_shapes(cfg: RefConfig) -> Dict[str, Tuple[int, ...]]:
    d, hn, nh, ng, V = (cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads,
                        cfg.num_query_groups, cfg.vocab_size)
    shapes = {"embedding.word_embeddings.weight": (V, d)}
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attention.linear_qkv.weight"] = ((nh + 2 * ng) * hn, d)
        if cfg.qk_layernorm:
            shapes[p + "self_attention.q_layernorm.weight"] = (hn,)
            shapes[p + "self_attention.k_layernorm.weight"] = (hn,)
        shapes[p + "self_attention.linear_proj.weight"] = (d, nh * hn)
        shapes[p + "pre_mlp_layernorm.weight"] = (d,)
        shapes[p + "mlp.linear_fc1.weight"] = (2 * cfg.ffn_hidden_size, d)
        shapes[p + "mlp.linear_fc2.weight"] = (d, cfg.ffn_hidden_size)
    shapes["decoder.final_layernorm.weight"] = (d,)
    if not cfg.share_embeddings_and_output_weights:
        shapes["output_layer.weight"] = (V, d)
    return shapes


def layer_param_shapes(cfg: RefConfig, prefix: str) -> Dict[str, Tuple[int, ...]]:
    """One transformer layer's weights under ``prefix`` (e.g. ``decoder.layers.0.``)."""
    d, hn, nh, ng = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    shapes = {prefix + "input_layernorm.weight": (d,),
              prefix + "self_attention.linear_qkv.weight": ((nh + 2 * ng) * hn, d)}
    if cfg.qk_layernorm:
        shapes[prefix + "self_attention.q_layernorm.weight"] = (hn,)
        shapes[prefix + "self_attention.k_layernorm.weight"] = (hn,)
    shapes[prefix + "self_attention.linear_proj.weight"] = (d, nh * hn)
    shapes[prefix + "pre_mlp_layernorm.weight"] = (d,)
    shapes[prefix + "mlp.linear_fc1.weight"] = (2 * cfg.ffn_hidden_size, d)
    shapes[prefix + "mlp.linear_fc2.weight"] = (d, cfg.ffn_hidden_size)
    return shapes


def mtp_param_shapes(cfg: RefConfig, mtp_num_layers: int) -> Dict[str, Tuple[int, ...]]:
    """The MTP depths' backbone weights (routers excluded)."""
    d = cfg.hidden_size
    shapes = {}
    for k in range(mtp_num_layers):
        p = f"mtp.layers.{k}."
        shapes.update({p + "enorm.weight": (d,), p + "hnorm.weight": (d,), p + "eh_proj.weight": (d, 2 * d)})
        shapes.update(layer_param_shapes(cfg, p + "mtp_model_layer."))
        shapes[p + "final_layernorm.weight"] = (d,)
    return shapes


def mtp_router_prefixes(mode: str, mtp_num_layers: int) -> List[str]:
    """The routers of the MTP depths (replacement modes only; the additive modes' depths are residual layers)."""
    if mode not in REPLACEMENT_MODES:
        return []
    return [f"mtp.layers.{k}.{r}" for k in range(mtp_num_layers)
            for r in ("mtp_model_layer.self_attention_router", "mtp_model_layer.mlp_router", "final_router")]


def init_reference_weights(cfg: RefConfig, mode: str = "baseline", null_source: bool = False,
                           gate: bool = False, seed: int = 0, router_init: str = "random",
                           mtp_num_layers: int = 0):
    """Random float64 weights for self-tests.

    Backbone: embeddings N(0,1), linears N(0, 1/fan_in), norm weights 1 + 0.1 N(0,1).
    Routers (``router_init='random'``, so tests are meaningful): query N(0, 1/d) (logits O(1)),
    key-norm weight 1 + 0.1 N, null source N(0,1), gate N(0,1).
    ``router_init='design'``: docs/design.md's initialisation (query 0, key-norm 1, null 0, gate 0).
    """
    assert router_init in ("random", "design")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    w = {}
    shapes = dict(backbone_param_shapes(cfg), **mtp_param_shapes(cfg, mtp_num_layers))
    for name, shape in shapes.items():
        if len(shape) == 1:
            w[name] = 1.0 + 0.1 * randn(*shape)
        elif name == "embedding.word_embeddings.weight":
            w[name] = randn(*shape)
        else:
            w[name] = randn(*shape) / math.sqrt(shape[1])
    d = cfg.hidden_size
    mtp_routers = [f"{p}.{which}" for p in mtp_router_prefixes(mode, mtp_num_layers)
                   for which in ("query", "key_norm_weight") + (("null_source",) if null_source else ())]
    for name in router_param_names(cfg, mode, null_source, gate) + mtp_routers:
        field = name.rsplit(".", 1)[1]
        if router_init == "design":
            w[name] = torch.ones(d, dtype=DTYPE) if field == "key_norm_weight" else (
                torch.zeros(1 if field == "gate" else d, dtype=DTYPE))
        elif field == "query":
            w[name] = randn(d) / math.sqrt(d)
        elif field == "key_norm_weight":
            w[name] = 1.0 + 0.1 * randn(d)
        elif field == "null_source":
            w[name] = randn(d)
        else:  # gate
            w[name] = randn(1)
    return w


# ----------------------------------------------------------------------------------------------
# Backbone pieces ([b, s, ...] layout)
# ----------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_freqs(cfg: RefConfig, seq_len: int):
    """Megatron's RotaryEmbedding.get_emb (non-interleaved): [s, hn] = cat(freqs, freqs)."""
    hn = cfg.kv_channels
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, hn, 2, dtype=DTYPE) / hn))
    freqs = torch.outer(torch.arange(seq_len, dtype=DTYPE), inv_freq)  # [s, hn/2]
    return torch.cat((freqs, freqs), dim=-1)  # [s, hn]


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t, emb):
    """t: [b, s, heads, hn]; emb: [s, hn]. Megatron's _apply_rotary_pos_emb_bshd, rotary_interleaved=False."""
    emb = emb[None, :, None, :]
    return t * torch.cos(emb) + rotate_half(t) * torch.sin(emb)


def split_qkv(mixed, cfg: RefConfig):
    """mixed: [b, s, ng*(np/ng+2)*hn] -> q [b, s, np, hn], k, v [b, s, ng, hn].

    Megatron's layout: per query group g the rows are [q heads of g (np/ng*hn), k_g (hn), v_g (hn)].
    Query head h belongs to group h // (np/ng)."""
    b, s, _ = mixed.shape
    hn, nh, ng = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    per = nh // ng
    mixed = mixed.view(b, s, ng, (per + 2) * hn)
    q, k, v = torch.split(mixed, [per * hn, hn, hn], dim=-1)
    return q.reshape(b, s, nh, hn), k, v


def attention(x, w, prefix, cfg: RefConfig, rope_emb):
    """Attention sublayer body (after input_layernorm): returns linear_proj output [b, s, d]."""
    b, s, _ = x.shape
    hn, nh, ng = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    q, k, v = split_qkv(x @ w[prefix + "linear_qkv.weight"].T, cfg)
    if cfg.qk_layernorm:
        q = rms_norm(q, w[prefix + "q_layernorm.weight"], cfg.norm_eps)
        k = rms_norm(k, w[prefix + "k_layernorm.weight"], cfg.norm_eps)
    if rope_emb is not None:
        q, k = apply_rope(q, rope_emb), apply_rope(k, rope_emb)
    # GQA: each query head h uses kv group h // (nh/ng)
    k = k.repeat_interleave(nh // ng, dim=2)
    v = v.repeat_interleave(nh // ng, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, nh, s, hn]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hn)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    ctx = torch.softmax(scores, dim=-1) @ v  # [b, nh, s, hn]
    ctx = ctx.transpose(1, 2).reshape(b, s, nh * hn)
    return ctx @ w[prefix + "linear_proj.weight"].T


def mla_attention(x, w, prefix, cfg: RefConfig):
    """Multi-latent attention (DeepSeek-V2 paper, section 2.1; its public modeling code), body after the input
    norm: queries (optionally through a low-rank latent) and a low-rank key/value latent (each RMS-normed with
    ``cfg.qk_layernorm``), per-head
    no-position parts dn, one shared rotary key part dr per token, causal softmax with scale 1/sqrt(dn+dr).
    RoPE on the dr dimensions is DeepSeek's: the dimensions are read as interleaved pairs (0,1), (2,3), ...,
    reordered to [evens; odds], then rotated half against half (cos/sin of cat(freqs, freqs))."""
    b, s, _ = x.shape
    nh, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank)
    if cfg.q_lora_rank is None:
        q = x @ w[prefix + "linear_q_proj.weight"].T
    else:
        cq = x @ w[prefix + "linear_q_down_proj.weight"].T
        if cfg.qk_layernorm:
            cq = rms_norm(cq, w[prefix + "q_layernorm.weight"], cfg.norm_eps)
        q = cq @ w[prefix + "linear_q_up_proj.weight"].T
    q_nope, q_pe = q.view(b, s, nh, dn + dr).split([dn, dr], dim=-1)
    ckv, k_pe = (x @ w[prefix + "linear_kv_down_proj.weight"].T).split([r, dr], dim=-1)
    if cfg.qk_layernorm:
        ckv = rms_norm(ckv, w[prefix + "kv_layernorm.weight"], cfg.norm_eps)
    kv = ckv @ w[prefix + "linear_kv_up_proj.weight"].T
    k_nope, v = kv.view(b, s, nh, dn + dv).split([dn, dv], dim=-1)
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dr, 2, dtype=DTYPE) / dr))
    freqs = torch.outer(torch.arange(s, dtype=DTYPE), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]  # [1, s, 1, dr]

    def rope(t):  # [b, s, heads, dr]
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
        return t * torch.cos(emb) + rotate_half(t) * torch.sin(emb)

    q = torch.cat((q_nope, rope(q_pe)), dim=-1)
    k = torch.cat((k_nope, rope(k_pe[:, :, None, :]).expand(b, s, nh, dr)), dim=-1)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, nh, s, .]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(dn + dr)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    ctx = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v  # [b, nh, s, dv]
    return ctx.transpose(1, 2).reshape(b, s, nh * dv) @ w[prefix + "linear_proj.weight"].T


def mlp(x, w, prefix):
    gate_, up = torch.chunk(x @ w[prefix + "linear_fc1.weight"].T, 2, dim=-1)
    return (F.silu(gate_) * up) @ w[prefix + "linear_fc2.weight"].T


def sublayer(j, u, w, cfg: RefConfig, rope_emb, prefix: Optional[str] = None):
    """f_j(u), including the sublayer's own input norm. Returns v_j (the residual addend).
    ``prefix``: the layer's weights (default: decoder layer j // 2); only j's parity is read then."""
    p = f"decoder.layers.{j // 2}." if prefix is None else prefix
    if j % 2 == 0:
        h = rms_norm(u, w[p + "input_layernorm.weight"], cfg.norm_eps)
        if cfg.kv_lora_rank is not None:
            return mla_attention(h, w, p + "self_attention.", cfg)
        return attention(h, w, p + "self_attention.", cfg, rope_emb)
    h = rms_norm(u, w[p + "pre_mlp_layernorm.weight"], cfg.norm_eps)
    return mlp(h, w, p + "mlp.")


# ----------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------
def route(sources: List[torch.Tensor], query, key_norm_weight, null_source=None, eps=1e-5,
          like: Optional[torch.Tensor] = None):
    """docs/design.md router: logit_i = w . (g * s_i / rms(s_i)), alpha = softmax_i, r = sum alpha_i s_i.

    sources: list of [b, s, d]. null_source: optional [d], an extra last source (broadcast).
    Returns (r [b, s, d], alpha [b, s, N(+1)]). Zero sources and no null source -> r = 0, alpha
    of shape [b, s, 0] (``like`` gives the shape)."""
    srcs = list(sources)
    ref = srcs[0] if srcs else like
    if null_source is not None:
        srcs.append(null_source.expand_as(ref))
    if not srcs:
        return torch.zeros_like(like), like.new_zeros(*like.shape[:-1], 0)
    S = torch.stack(srcs, dim=-2)  # [b, s, N, d]
    keys = key_norm_weight * S / torch.sqrt(S.pow(2).mean(-1, keepdim=True) + eps)
    logits = keys @ query  # [b, s, N]
    alpha = torch.softmax(logits, dim=-1)
    r = (alpha.unsqueeze(-1) * S).sum(dim=-2)
    return r, alpha


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def reference_forward(weights: Dict[str, torch.Tensor], cfg: RefConfig, tokens, mode: str = "baseline",
                      num_blocks: Optional[int] = None, sources: str = "exact",
                      null_source: bool = False, gate: bool = False, eps: Optional[float] = None,
                      return_routing: bool = False,
                      debug_hook: Optional[Callable[[dict], None]] = None, mtp_num_layers: int = 0,
                      mtp_routing: Optional[dict] = None):
    """Logits [b, s, vocab] (float64) of the model in residual ``mode``.

    mtp_num_layers D > 0 returns ``(logits, [the logits of MTP depth k for k < D])`` instead
    (docs/design.md section 1.7; not with return_routing). ``mtp_routing``, a dict, gets the replacement modes'
    MTP routing weights [b, s, N(+1)], keyed ``mtp{k+1}.attn`` / ``.mlp`` / ``.final`` (k: the depth).

    num_blocks: K for delta_block / attnres (must divide L). sources: 'exact' | 'authors-code'
    (delta, delta_block only). null_source / gate: whether routers have z / a (gate: additive modes).
    eps: router rms eps (default cfg.norm_eps).
    return_routing: also return ``alphas`` (list per receiver, in order 0..2L-1 then 'final', of
    [b, s, N] routing weights) and ``num_sources`` (list of real-source counts per receiver).
    debug_hook: called at each receiver with a dict {receiver, sources, x (residual stream before
    the sublayer; None in replacement modes), r, u, alpha}.
    """
    assert mode in MODES, mode
    assert sources in SOURCE_DEFS, sources
    if mode in ("delta_block", "attnres"):
        assert num_blocks is not None and cfg.num_layers % num_blocks == 0, (
            "num_blocks must divide num_layers")
    eps = cfg.norm_eps if eps is None else eps
    w = {k: v.to(DTYPE) for k, v in weights.items()}
    L = cfg.num_layers
    layers_per_block = L // num_blocks if num_blocks else None
    gate = gate and mode in ADDITIVE_MODES

    tokens = torch.as_tensor(tokens)
    seq_len = tokens.shape[1]
    rope_emb = rope_freqs(cfg, seq_len) if cfg.position_embedding_type == "rope" else None
    h0 = F.embedding(tokens, w["embedding.word_embeddings.weight"])  # [b, s, d]

    alphas, counts = [], []

    def read(j, srcs, x=None, like=None):
        """Route receiver j over srcs; record alpha and count; return r."""
        z = w[reference_router_key(j, "null_source")] if null_source else None
        r, alpha = route(srcs, w[reference_router_key(j, "query")],
                         w[reference_router_key(j, "key_norm_weight")], z, eps, like=like)
        alphas.append(alpha)
        counts.append(len(srcs))
        return r, alpha

    def hook(j, srcs, x, r, u, alpha):
        if debug_hook is not None:
            debug_hook(dict(receiver=j, sources=list(srcs), x=x, r=r, u=u, alpha=alpha))

    def G(j, r):
        return w[reference_router_key(j, "gate")] * r if gate else r

    def is_block_start(layer):
        return layer % layers_per_block == 0

    if mode == "baseline":
        x = h0
        for j in range(2 * L):
            x = x + sublayer(j, x, w, cfg, rope_emb)

    elif mode == "delta":
        x = h0
        S = [h0] if sources == "exact" else []
        for j in range(2 * L):
            r, alpha = read(j, S, like=x)
            u = x + G(j, r)
            hook(j, S, x, r, u, alpha)
            v = sublayer(j, u, w, cfg, rope_emb)
            x = x + v
            if sources == "authors-code" and j == 0:
                S.append(h0)  # the public code appends h0 only after layer 0's attention
            S.append(v)

    elif mode == "delta_block" and sources == "exact":
        x = h0
        deltas = []  # completed block sums Delta_c
        P = None  # partial sum of the current block (None = empty)
        for j in range(2 * L):
            layer = j // 2
            if j % 2 == 0 and is_block_start(layer) and layer > 0:
                deltas.append(P)  # block (layer // lpb - 1) is complete
                P = None
            S = [h0] + deltas + ([P] if P is not None else [])
            r, alpha = read(j, S, like=x)
            u = x + G(j, r)
            hook(j, S, x, r, u, alpha)
            v = sublayer(j, u, w, cfg, rope_emb)
            x = x + v
            P = v if P is None else P + v

    elif mode == "delta_block":  # authors-code
        x = h0
        blocks = []
        for j in range(2 * L):
            layer = j // 2
            S = list(blocks)
            r, alpha = read(j, S, like=x)
            u = x + G(j, r)
            hook(j, S, x, r, u, alpha)
            if j % 2 == 0 and is_block_start(layer):
                # after routing, before the attention output is added
                blocks.append(x if not blocks else x - blocks[-1])
            v = sublayer(j, u, w, cfg, rope_emb)
            x = x + v

    elif mode == "attnres":
        B, p = [], h0
        for j in range(2 * L):
            layer = j // 2
            S = B + [p]
            u, alpha = read(j, S)
            hook(j, S, None, u, u, alpha)
            if j % 2 == 0 and is_block_start(layer):
                B = B + [p]
                p = torch.zeros_like(p)
            p = p + sublayer(j, u, w, cfg, rope_emb)
        S = B + [p]
        x, alpha = read("final", S)
        hook("final", S, None, x, x, alpha)

    else:  # full_attnres
        B, p = [], h0
        for j in range(2 * L):
            S = B + [p]
            u, alpha = read(j, S)
            hook(j, S, None, u, u, alpha)
            B = B + [p]
            p = sublayer(j, u, w, cfg, rope_emb)
        S = B + [p]
        x, alpha = read("final", S)
        hook("final", S, None, x, x, alpha)

    trunk = S if mode in REPLACEMENT_MODES else None  # what the final router read
    x = rms_norm(x, w["decoder.final_layernorm.weight"], cfg.norm_eps)
    out_w = (w["embedding.word_embeddings.weight"] if cfg.share_embeddings_and_output_weights
             else w["output_layer.weight"])
    logits = x @ out_w.T
    if mtp_num_layers:
        assert not return_routing
        return logits, mtp_forward(w, cfg, tokens, mode, x, trunk, mtp_num_layers, null_source, eps, rope_emb,
                                   out_w, mtp_routing)
    if return_routing:
        return logits, alphas, counts
    return logits


def mtp_forward(w, cfg: RefConfig, tokens, mode, h, trunk, mtp_num_layers, null_source, eps, rope_emb, out_w,
                routing: Optional[dict] = None):
    """docs/design.md section 1.7. Depth k reads h (the previous depth's output; first the decoder's, after
    its final norm) and the tokens shifted left by k + 1 (a 0 enters at the end), forms
    z = eh_proj([enorm(embedding); hnorm(h)]) and runs one layer on z: a residual layer (baseline and the
    additive modes), or, in the replacement modes, sublayers that route over the decoder's final sources
    ``trunk`` plus the depth's own (attnres: one partial p starting at z; full_attnres: z and each output),
    and a final router of the depth over the same; then the depth's final norm. Returns the logits per depth;
    ``routing`` (a dict) gets each routed depth's weights, keyed mtp{k+1}.attn / .mlp / .final."""
    out = []
    ids = torch.as_tensor(tokens)
    for k in range(mtp_num_layers):
        ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        p = f"mtp.layers.{k}."
        e = rms_norm(F.embedding(ids, w["embedding.word_embeddings.weight"]), w[p + "enorm.weight"], cfg.norm_eps)
        z = torch.cat([e, rms_norm(h, w[p + "hnorm.weight"], cfg.norm_eps)], dim=-1) @ w[p + "eh_proj.weight"].T
        layer = p + "mtp_model_layer."
        if mode in REPLACEMENT_MODES:
            def read(router, srcs, receiver):
                zs = w[router + ".null_source"] if null_source else None
                r, alpha = route(srcs, w[router + ".query"], w[router + ".key_norm_weight"], zs, eps)
                if routing is not None:
                    routing[f"mtp{k + 1}.{receiver}"] = alpha
                return r

            own, partial = [], z
            for j, router, receiver in ((0, "self_attention_router", "attn"), (1, "mlp_router", "mlp")):
                u = read(layer + router, trunk + own + [partial], receiver)
                v = sublayer(j, u, w, cfg, rope_emb, prefix=layer)
                if mode == "full_attnres":
                    own, partial = own + [partial], v
                else:
                    partial = partial + v
            y = read(p + "final_router", trunk + own + [partial], "final")
        else:
            y = z
            for j in (0, 1):
                y = y + sublayer(j, y, w, cfg, rope_emb, prefix=layer)
        h = rms_norm(y, w[p + "final_layernorm.weight"], cfg.norm_eps)
        out.append(h @ out_w.T)
    return out


def weights_from_megatron_state_dict(state_dict) -> Dict[str, torch.Tensor]:
    """Keep the tensors of a Megatron GPTModel state_dict (drops ``_extra_state`` entries), as float64."""
    return {k: v.detach().to(DTYPE) for k, v in state_dict.items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}
