"""The HF state-dict adapter: Megatron-Core tensor names and shapes <-> Hugging Face ones (Qwen3 / Qwen3-MoE / Llama,
and DeltaQwen3 with its routers), both directions from one table.

Megatron names (GPTModel local spec) <-> HF names: ONE rename table serves both directions (EMBEDDING,
FINAL_NORM, OUTPUT, LAYER_RENAMES, LAYER_FUSED, ROUTER_RENAMES below): q/k/v are fused per query group
into linear_qkv, gate/up into linear_fc1; the routers map decoder.layers.i.self_attention_router.* <->
model.layers.i.attn_router.*, ...mlp_router.*, decoder.final_router.* <-> model.final_router.*.

:func:`megatron_to_hf_state_dict` and :func:`hf_to_megatron_state_dict` take whole-model state dicts (TP1/PP1)
and split / fuse the tensors that differ in shape; they raise ConversionError naming the missing tensor.
"""
import torch

from megatron_delta.checkpoint.errors import ConversionError

ROUTER_FIELDS = ("query", "key_norm_weight", "null_source", "gate")
SUPPORTED_HF_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "DeepseekV3ForCausalLM")


# =============================================================================================== names
# ONE rename table serves both directions (export reads it left to right, import right to left).
# Whole-model tensors: (Megatron name, HF name). The vocabulary rows of the embedding / output layer are
# stripped on export and zero-padded on import; output_layer <-> lm_head only for untied embeddings.
EMBEDDING = ("embedding.word_embeddings.weight", "model.embed_tokens.weight")
FINAL_NORM = ("decoder.final_layernorm.weight", "model.norm.weight")
OUTPUT = ("output_layer.weight", "lm_head.weight")
# Per layer i (under decoder.layers.i. / model.layers.i.): (Megatron, HF, present only with qk-layernorm)
LAYER_RENAMES = (
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", False),
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", True),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", True),
    ("input_layernorm.weight", "input_layernorm.weight", False),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", False),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", False),
)
# Per layer, one fused Megatron tensor <-> several HF tensors (split on export, concatenated on import):
# linear_qkv is [q heads of group g; k_g; v_g] for each query group g, linear_fc1 is [gate; up].
LAYER_FUSED = (
    ("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight")),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)
# A mixture-of-experts MLP (Megatron's MoELayer, local backend: one SequentialMLP expert per index e) <-> Qwen3-MoE's
# (its router `gate` and the experts stacked along dim 0: gate_up_proj [E, 2 ffn, d] = [gate; up] per expert as in
# linear_fc1, down_proj [E, d, ffn]). A layer is MoE when its router is there; its dense MLP names are then absent.
MOE_ROUTER = ("mlp.router.weight", "mlp.gate.weight")
MOE_EXPERTS = (("mlp.experts.local_experts.{e}.linear_fc1.weight", "mlp.experts.gate_up_proj"),
               ("mlp.experts.local_experts.{e}.linear_fc2.weight", "mlp.experts.down_proj"))
DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")  # the Megatron names a MoE layer lacks
# DeepSeek-V3's MoE (DeepseekV3ForCausalLM) adds the router's expert bias (--moe-router-enable-expert-bias; HF always
# has it, zero without) and the shared experts (--moe-shared-expert-intermediate-size), [gate; up] as linear_fc1.
MOE_EXPERT_BIAS = ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias")
SHARED_EXPERTS = (("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight",
                                                            "mlp.shared_experts.up_proj.weight")),
                  ("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",)))
# Multi-latent attention (Megatron's MLA spec) <-> DeepSeek-V3's (DeepseekV3ForCausalLM): the same tensors and layouts
# (q / kv up projections [heads x (no-position + rotary | no-position + value)], the latent [kv_lora_rank + rotary]),
# renamed; q_a_* only with --q-lora-rank (else one q_proj). Present instead of linear_qkv and the q/k norms.
MLA_RENAMES = (
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    ("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
)
# Router tensors keep their field names; these prefix / module renames apply in order (reversed for import).
ROUTER_RENAMES = (("decoder.", "model."), ("self_attention_router", "attn_router"))


def _layer_prefixes(i):
    return f"decoder.layers.{i}.", f"model.layers.{i}."


def _layer_renames(num_layers, qk_layernorm, moe_layers=()):
    """(Megatron name, HF name) of every one-to-one per-layer tensor (a MoE layer has no dense MLP)."""
    for i in range(num_layers):
        p, q = _layer_prefixes(i)
        for meg, hf, qk_only in LAYER_RENAMES:
            if (qk_layernorm or not qk_only) and not (i in moe_layers and meg in DENSE_MLP):
                yield p + meg, q + hf


def _fused(i, moe_layers, mla=False):
    return [(meg, hfs) for meg, hfs in LAYER_FUSED if not (i in moe_layers and meg in DENSE_MLP)
            and not (mla and meg.endswith("linear_qkv.weight"))]


def _mla_renames(sd, num_layers, to_hf):
    """Pop each layer's MLA tensors present in sd, under the other side's names."""
    out = {}
    for i in range(num_layers):
        p, q = _layer_prefixes(i)
        for meg, hf in MLA_RENAMES:
            src, dst = (p + meg, q + hf) if to_hf else (q + hf, p + meg)
            if src in sd:
                out[dst] = sd.pop(src)
    return out


def _experts_to_hf(sd, p, q, out):
    """One MoE layer's Megatron tensors (popped from sd) into out under HF names."""
    out[q + MOE_ROUTER[1]] = sd.pop(p + MOE_ROUTER[0])
    if p + MOE_EXPERT_BIAS[0] in sd:
        out[q + MOE_EXPERT_BIAS[1]] = sd.pop(p + MOE_EXPERT_BIAS[0])
    for meg, hfs in SHARED_EXPERTS:
        if p + meg in sd:
            out.update(zip((q + h for h in hfs), sd.pop(p + meg).chunk(len(hfs), dim=0)))
    for meg, hf in MOE_EXPERTS:
        experts = []
        while p + meg.format(e=len(experts)) in sd:
            experts.append(sd.pop(p + meg.format(e=len(experts))))
        out[q + hf] = torch.stack(experts)


def _experts_to_megatron(hf, p, q, out, expert_bias=False):
    """One MoE layer's HF tensors (popped from hf) into out under Megatron names; DeepSeek-V3's correction bias
    becomes the router's expert bias with ``expert_bias`` (Megatron's --moe-router-enable-expert-bias), else it
    must be zero."""
    out[p + MOE_ROUTER[0]] = hf.pop(q + MOE_ROUTER[1])
    bias = hf.pop(q + MOE_EXPERT_BIAS[1], None)
    if expert_bias:
        out[p + MOE_EXPERT_BIAS[0]] = bias
    elif bias is not None and bias.abs().max() > 0:
        raise ConversionError(f"{q + MOE_EXPERT_BIAS[1]} is not zero: the model needs the expert bias")
    for meg, hfs in SHARED_EXPERTS:
        if q + hfs[0] in hf:
            out[p + meg] = torch.cat([hf.pop(q + h) for h in hfs], dim=0)
    for meg, name in MOE_EXPERTS:
        for e, w in enumerate(hf.pop(q + name).unbind(0)):
            out[p + meg.format(e=e)] = w


def _router_name(name, to_hf):
    for meg, hf in (ROUTER_RENAMES if to_hf else ROUTER_RENAMES[::-1]):
        name = name.replace(meg, hf, 1) if to_hf else name.replace(hf, meg, 1)
    return name


def _split_fused(meg, w, per, num_query_groups, hn, d):
    """A fused Megatron tensor -> its HF tensors (in LAYER_FUSED order)."""
    if meg.endswith("linear_qkv.weight"):
        qkv = w.view(num_query_groups, per + 2, hn, d)
        return [qkv[:, :per].reshape(-1, d), qkv[:, per].reshape(-1, d), qkv[:, per + 1].reshape(-1, d)]
    return list(w.chunk(2, dim=0))


def _fuse(meg, parts, per, num_query_groups, hn, d):
    """HF tensors (in LAYER_FUSED order) -> the fused Megatron tensor."""
    if meg.endswith("linear_qkv.weight"):
        q, k, v = parts
        return torch.cat([q.view(num_query_groups, per, hn, d), k.view(num_query_groups, 1, hn, d),
                          v.view(num_query_groups, 1, hn, d)], dim=1).reshape(-1, d)
    return torch.cat(parts, dim=0)


def megatron_to_hf_state_dict(sd, *, num_layers, num_attention_heads, num_query_groups, kv_channels,
                              hidden_size, qk_layernorm, tied, vocab_size, mla=False):
    """Megatron (TP1, full tensors) state dict -> HF (Qwen3/Llama/DeltaQwen3; DeepSeek-V3 attention with
    ``mla``) state dict."""
    sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    mla_tensors = _mla_renames(sd, num_layers, to_hf=True) if mla else {}
    qk_layernorm = qk_layernorm and not mla  # MLA's latent norms are MLA_RENAMES
    geom = (num_attention_heads // num_query_groups, num_query_groups, kv_channels, hidden_size)
    emb = sd.pop(EMBEDDING[0])
    if emb.shape[0] < vocab_size:
        raise ConversionError(f"embedding has {emb.shape[0]} rows, fewer than the vocabulary ({vocab_size})")
    out = {EMBEDDING[1]: emb[:vocab_size], FINAL_NORM[1]: sd.pop(FINAL_NORM[0])}
    if OUTPUT[0] in sd:
        w = sd.pop(OUTPUT[0])
        if not tied:
            out[OUTPUT[1]] = w[:vocab_size]
    moe = {i for i in range(num_layers) if _layer_prefixes(i)[0] + MOE_ROUTER[0] in sd}
    out.update(mla_tensors)
    for meg, hf in _layer_renames(num_layers, qk_layernorm, moe):
        out[hf] = sd.pop(meg)
    for i in range(num_layers):
        p, q = _layer_prefixes(i)
        for meg, hfs in _fused(i, moe, mla):
            out.update(zip((q + h for h in hfs), _split_fused(meg, sd.pop(p + meg), *geom)))
        if i in moe:
            _experts_to_hf(sd, p, q, out)
    for name in list(sd):
        if "_router." in name:
            out[_router_name(name, to_hf=True)] = sd.pop(name)
    if sd:
        raise ConversionError(f"Megatron tensors with no HF counterpart: {sorted(sd)[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron_state_dict(hf, *, num_layers, num_attention_heads, num_query_groups, kv_channels,
                              hidden_size, qk_layernorm, tied, padded_vocab_size, mla=False, expert_bias=False):
    """HF backbone state dict -> Megatron (TP1) names; vocabulary padded with zero rows. ``mla``: DeepSeek-V3's
    attention; ``expert_bias``: its router's correction bias."""
    hf = dict(hf)
    mla_tensors = _mla_renames(hf, num_layers, to_hf=False) if mla else {}
    qk_layernorm = qk_layernorm and not mla
    geom = (num_attention_heads // num_query_groups, num_query_groups, kv_channels, hidden_size)

    def pad(w):
        if w.shape[0] > padded_vocab_size:
            raise ConversionError(f"vocabulary {w.shape[0]} exceeds the padded size {padded_vocab_size}")
        return torch.cat([w, w.new_zeros(padded_vocab_size - w.shape[0], w.shape[1])]) \
            if w.shape[0] < padded_vocab_size else w

    out = {EMBEDDING[0]: pad(hf.pop(EMBEDDING[1])), FINAL_NORM[0]: hf.pop(FINAL_NORM[1])}
    head = hf.pop(OUTPUT[1], None)
    if tied:
        # Megatron keeps a (tied) output_layer.weight in its state dict on the last stage
        out[OUTPUT[0]] = out[EMBEDDING[0]]
    else:
        if head is None:
            raise ConversionError(f"untied embeddings but the HF model has no {OUTPUT[1]}")
        out[OUTPUT[0]] = pad(head)
    out.update(mla_tensors)
    moe = {i for i in range(num_layers) if _layer_prefixes(i)[1] + MOE_ROUTER[1] in hf}
    for meg, name in _layer_renames(num_layers, qk_layernorm, moe):
        out[meg] = hf.pop(name)
    for i in range(num_layers):
        p, q = _layer_prefixes(i)
        for meg, hfs in _fused(i, moe, mla):
            out[p + meg] = _fuse(meg, [hf.pop(q + h) for h in hfs], *geom)
        if i in moe:
            _experts_to_megatron(hf, p, q, out, expert_bias)
    for name in list(hf):
        if "_router." in name:
            out[_router_name(name, to_hf=False)] = hf.pop(name)
        elif name.endswith("rotary_emb.inv_freq"):
            hf.pop(name)
    if hf:
        raise ConversionError(f"HF tensors with no Megatron counterpart (unsupported architecture "
                              f"feature?): {sorted(hf)[:8]}")
    return {k: v.contiguous() for k, v in out.items()}
