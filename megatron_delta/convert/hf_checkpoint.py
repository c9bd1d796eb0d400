"""The import / export commands between megatron-delta checkpoints (torch_dist) and Hugging Face transformers.

    export: Megatron checkpoint -> HF directory
            baseline      -> stock Qwen3ForCausalLM (qk_layernorm) / LlamaForCausalLM (no qk norm) /
                             Qwen3MoeForCausalLM (--num-experts) / DeepseekV3ForCausalLM
                             (--multi-latent-attention, dense or DeepSeek's MoE routing), loadable without remote code
            routed modes  -> DeltaQwen3ForCausalLM remote code (trust_remote_code=True; its MoE MLP in
                             Qwen3-MoE's layout) / DeltaDeepseekV3ForCausalLM (--multi-latent-attention)
            multi-token prediction depths are not exported (one printed line says so)
            + the SentencePiece tokenizer named in run_config.json (tokenizer.json, tokenizer.model)
    import: HF Qwen3 / Qwen3-MoE / Llama / DeepSeek-V3 directory -> Megatron checkpoint (iteration 0, model weights
            only) in any residual mode; router parameters get their initial values (zero query, unit key norm,
            zero null source / gate), so with `--delta-gate scalar` the imported model computes
            the HF model's function exactly.

Reading a checkpoint: the model is built in this process under TP1/PP1 and loaded with
checkpoint/store.py's `load_checkpoint` (evaluation/loaders.py); dist_checkpointing reshards, so a checkpoint saved
under any TP/PP/VPP layout yields full tensors. Writing: torch_dist checkpoints are layout independent
(loading reshards), so saving under TP1/PP1 is enough for training under any TP/PP later; only the
vocabulary padding depends on TP (Megatron pads to a multiple of make-vocab-size-divisible-by x TP),
so `import` pads for the TP size it is given.

The tensors' names and shapes are mapped by convert/state_dict_adapter.py; the HF configuration by
:func:`hf_config_from_run_config` / :func:`model_config_from_hf` here.
"""
import json
import os
import shutil
import tempfile

import torch

from megatron_delta.checkpoint.errors import ConversionError
from megatron_delta.checkpoint.run_config import HF_TOKENIZER_FILES, true_vocab_size
from megatron_delta.convert.state_dict_adapter import (
    SUPPORTED_HF_ARCHS,
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
)
from megatron_delta.core.modes import BASELINE, BLOCK_MODES, GATES, RESIDUAL_MODES, SOURCE_DEFINITIONS
from megatron_delta.evaluation.loaders import build_megatron_model, load_megatron


# =============================================================================================== HF configs
def hf_config_from_run_config(rc: dict, vocab_size: int):
    """transformers config for the checkpoint: Qwen3Config / LlamaConfig (baseline) or DeltaQwen3Config."""
    from transformers import LlamaConfig, Qwen3Config

    kw = dict(vocab_size=vocab_size, hidden_size=rc["hidden_size"], intermediate_size=rc["ffn_hidden_size"],
              num_hidden_layers=rc["num_layers"], num_attention_heads=rc["num_attention_heads"],
              num_key_value_heads=rc["num_query_groups"], head_dim=rc["kv_channels"],
              max_position_embeddings=rc["max_position_embeddings"], rms_norm_eps=rc["norm_epsilon"],
              rope_theta=float(rc["rotary_base"]), tie_word_embeddings=not rc["untie_embeddings_and_output_weights"],
              hidden_act="silu", attention_bias=False, attention_dropout=0.0)
    if rc.get("bos_token_id") is not None:
        kw["bos_token_id"] = rc["bos_token_id"]
    if rc.get("eos_token_id") is not None:
        kw["eos_token_id"] = rc["eos_token_id"]
    if rc.get("multi_latent_attention"):
        return deepseek_v3_config(rc, kw)
    moe = hf_moe_fields(rc)
    if moe and not rc["qk_layernorm"]:
        raise ConversionError("a mixture-of-experts model without --qk-layernorm has no Hugging Face counterpart "
                              "here: the export writes Qwen3-MoE's layout (q/k norms)")
    if rc["residual"] == BASELINE:
        if moe:
            from transformers import Qwen3MoeConfig

            cfg = Qwen3MoeConfig(**moe, **kw)
            cfg.architectures = ["Qwen3MoeForCausalLM"]
        elif rc["qk_layernorm"]:
            cfg = Qwen3Config(**kw)
            cfg.architectures = ["Qwen3ForCausalLM"]
        else:
            cfg = LlamaConfig(mlp_bias=False, **kw)
            cfg.architectures = ["LlamaForCausalLM"]
        return cfg
    from megatron_delta.hf import DeltaQwen3Config

    return DeltaQwen3Config(**_delta_hf_fields(rc), use_qk_norm=bool(rc["qk_layernorm"]), **moe, **kw)


def check_deepseek_export(rc: dict, ckpt_dir: str) -> None:
    """What of a multi-latent-attention checkpoint DeepSeek-V3's stock layout (DeepseekV3ForCausalLM) expresses
    here: baseline, dense or DeepSeek's MoE routing (_deepseek_moe_problem), its latent norms; one ConversionError
    naming the flag otherwise (before any file)."""
    why = _deepseek_moe_problem(rc) if rc.get("num_experts") else None
    if why:
        pass  # the mixture of experts' reason
    elif not rc.get("qk_layernorm"):
        why = "no --qk-layernorm: DeepSeek-V3's attention always norms its query and key/value latents"
    elif (rc.get("rope_type") or "yarn") == "rope" and float(rc.get("rotary_scaling_factor") or 1) > 1 and \
            float(rc.get("mscale_all_dim") or 0):
        why = ("--rope-type rope with --rotary-scaling-factor > 1 and --mscale-all-dim: Megatron scales the softmax "
               "by YaRN's mscale, DeepSeek-V3 only with YaRN rotary embeddings")
    if why:
        raise ConversionError(f"--load {ckpt_dir} (--multi-latent-attention) has no Hugging Face counterpart here: "
                              f"{why}; evaluate it with the Megatron tools (tools/evaluate.py, tools/perplexity.py)")


def check_shared_expert_gate(rc: dict, ckpt_dir: str) -> None:
    """--moe-shared-expert-gate (a sigmoid gate on the shared experts' output, mlp.shared_experts.gate_weight) has no
    counterpart in the Hugging Face layouts the export writes (DeepSeek-V3, Qwen3-MoE): one ConversionError
    naming the flag, before any file."""
    if rc.get("moe_shared_expert_gate"):
        raise ConversionError(f"--load {ckpt_dir} was trained with --moe-shared-expert-gate, which the Hugging Face "
                              f"layouts the export writes (DeepSeek-V3, Qwen3-MoE) have no counterpart for: their "
                              f"shared experts are ungated; train without --moe-shared-expert-gate to export, or "
                              f"evaluate this checkpoint with the Megatron tools (tools/evaluate.py, "
                              f"tools/perplexity.py)")


def _first_dense_layers(rc: dict):
    """k when --moe-layer-freq makes the first k layers dense and the others MoE (DeepSeek-V3's
    first_k_dense_replace), else None."""
    L, freq = rc["num_layers"], rc.get("moe_layer_freq") or 1
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(L)]
    k = pattern.index(1) if 1 in pattern else L
    return k if pattern == [0] * k + [1] * (L - k) else None


def _deepseek_moe_problem(rc: dict):
    """Why this mixture of experts has no DeepSeek-V3 counterpart (None: it has one)."""
    topk, groups, group_topk = rc.get("moe_router_topk") or 2, rc.get("moe_router_num_groups"), \
        rc.get("moe_router_group_topk")
    ffn, shared = rc.get("moe_ffn_hidden_size") or rc["ffn_hidden_size"], rc.get("moe_shared_expert_intermediate_size")
    if (rc.get("moe_router_score_function") or "softmax") != "sigmoid" or rc.get("moe_router_pre_softmax"):
        return "--moe-router-score-function softmax (or --moe-router-pre-softmax): DeepSeek-V3's router is a sigmoid"
    if _first_dense_layers(rc) is None:
        return f"--moe-layer-freq {rc.get('moe_layer_freq')}: DeepSeek-V3 has dense layers first, then MoE layers only"
    if groups and (topk // group_topk != 2 or rc["num_experts"] % groups):
        return (f"--moe-router-num-groups {groups} / --moe-router-group-topk {group_topk}: DeepSeek-V3 scores each "
                f"group by its top 2 experts, Megatron by its top --moe-router-topk / --moe-router-group-topk "
                f"({topk // group_topk})")
    if not groups and rc["num_experts"] < 2:
        return "one expert: DeepSeek-V3's router scores its one group by its top 2 experts"
    if shared and shared % ffn:
        return (f"--moe-shared-expert-intermediate-size {shared} is not a multiple of --moe-ffn-hidden-size {ffn} "
                f"(DeepSeek-V3's n_shared_experts)")
    return None


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's attention scale, as Megatron's MLA (_yarn_get_mscale) and DeepSeek-V3 compute it."""
    import math

    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_v3_config(rc: dict, kw: dict):
    """DeepseekV3Config of a baseline MLA checkpoint (DeltaDeepseekV3Config, remote code, for a routed one): dense
    layers first (first_k_dense_replace; all of them without --num-experts), DeepSeek's MoE routing,
    RoPE on the rotary dimensions as Megatron's MLA applies it (rope_interleave), YaRN with MLATransformerConfig's
    fixed original_max_position_embeddings / beta_fast / beta_slow and Megatron's cos/sin scale
    mscale(factor, --mscale) / mscale(factor, --mscale-all-dim) given explicitly (transformers infers another
    without --mscale-all-dim)."""
    from transformers import DeepseekV3Config

    rope = dict(rope_type="default", rope_theta=float(rc["rotary_base"]))
    if (rc.get("rope_type") or "yarn") == "yarn":
        factor = float(rc.get("rotary_scaling_factor") or 1.0)
        mscale, mscale_all = float(rc.get("mscale") or 1.0), float(rc.get("mscale_all_dim") or 0.0)
        rope.update(rope_type="yarn", factor=factor, original_max_position_embeddings=4096, beta_fast=32.0,
                    beta_slow=1.0, mscale=mscale, mscale_all_dim=mscale_all, truncate=True,
                    attention_factor=_mscale(factor, mscale) / _mscale(factor, mscale_all))
    kw = dict(kw, num_key_value_heads=rc["num_attention_heads"])
    kw.pop("head_dim")
    moe = dict(first_k_dense_replace=rc["num_layers"])
    if rc.get("num_experts"):  # _deepseek_moe_problem said it fits
        ffn, topk = rc.get("moe_ffn_hidden_size") or rc["ffn_hidden_size"], rc.get("moe_router_topk") or 2
        moe = dict(first_k_dense_replace=_first_dense_layers(rc), n_routed_experts=rc["num_experts"],
                   num_experts_per_tok=topk, moe_intermediate_size=ffn,
                   n_shared_experts=(rc.get("moe_shared_expert_intermediate_size") or 0) // ffn,
                   routed_scaling_factor=float(rc.get("moe_router_topk_scaling_factor") or 1.0),
                   n_group=rc.get("moe_router_num_groups") or 1, topk_group=rc.get("moe_router_group_topk") or 1,
                   norm_topk_prob=topk > 1)  # Megatron normalises the sigmoid top-k weights for top-k > 1
    fields = dict(
        **kw, q_lora_rank=rc.get("q_lora_rank"), kv_lora_rank=rc["kv_lora_rank"], qk_nope_head_dim=rc["qk_head_dim"],
        qk_rope_head_dim=rc["qk_pos_emb_head_dim"], v_head_dim=rc["v_head_dim"], rope_interleave=True,
        rope_parameters=rope, num_mtp_layers=0, **moe)
    if rc["residual"] != BASELINE:  # remote code: DeepSeek-V3's modules with the routers (megatron_delta/hf)
        from megatron_delta.hf import DeltaDeepseekV3Config

        return DeltaDeepseekV3Config(**_delta_hf_fields(rc), **fields)
    cfg = DeepseekV3Config(**fields)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def _delta_hf_fields(rc: dict) -> dict:
    """The remote-code configs' residual fields of a checkpoint (DeltaQwen3Config, DeltaDeepseekV3Config)."""
    return dict(residual=rc["residual"],
                delta_num_blocks=rc.get("delta_num_blocks") if rc["residual"] in BLOCK_MODES else None,
                delta_sources=rc.get("delta_sources") or SOURCE_DEFINITIONS[0],
                delta_null_source=bool(rc.get("delta_null_source")), delta_gate=rc.get("delta_gate") or GATES[0],
                delta_router_eps=float(rc.get("delta_router_eps") or rc["norm_epsilon"]))


def hf_moe_fields(rc: dict) -> dict:
    """Qwen3-MoE's configuration fields of a checkpoint's mixture of experts ({} for a dense model): Megatron's
    --moe-layer-freq as the layers without experts (mlp_only_layers), --moe-router-topk, and its routing:
    softmax over the top-k logits (Megatron's default) is Qwen3-MoE's norm_topk_prob, softmax over all experts
    then top-k (--moe-router-pre-softmax) is norm_topk_prob false."""
    if not rc.get("num_experts"):
        return {}
    if (rc.get("moe_router_score_function") or "softmax") != "softmax":
        raise ConversionError(f"--moe-router-score-function {rc['moe_router_score_function']}: Qwen3-MoE's router "
                              f"is a softmax; this mixture of experts has no Hugging Face counterpart here")
    L, freq = rc["num_layers"], rc.get("moe_layer_freq") or 1
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(L)]
    return dict(num_experts=rc["num_experts"], num_experts_per_tok=rc.get("moe_router_topk") or 2,
                moe_intermediate_size=rc.get("moe_ffn_hidden_size") or rc["ffn_hidden_size"],
                norm_topk_prob=not rc.get("moe_router_pre_softmax"), decoder_sparse_step=1,
                mlp_only_layers=[i for i, is_moe in enumerate(pattern) if not is_moe])


def model_config_from_hf(cfg, residual, delta_num_blocks=None, delta_null_source=False, delta_gate=GATES[0],
                         delta_sources=SOURCE_DEFINITIONS[0], delta_router_eps=None) -> dict:
    """A run_config-like dict (Megatron model flags) for a stock Qwen3 / Llama config."""
    archs = list(getattr(cfg, "architectures", None) or [])
    mtype = getattr(cfg, "model_type", None)
    routing = dict(residual=residual, delta_num_blocks=delta_num_blocks, delta_null_source=delta_null_source,
                   delta_gate=delta_gate, delta_sources=delta_sources, delta_router_eps=delta_router_eps)
    if mtype == "deepseek_v3" and (not archs or archs[0] == "DeepseekV3ForCausalLM"):
        return _deepseek_model_config(cfg, routing)
    if mtype not in ("qwen3", "qwen3_moe", "llama") or (archs and archs[0] not in SUPPORTED_HF_ARCHS):
        raise ConversionError(f"unsupported architecture {archs or mtype!r} (model_type {mtype!r}): import "
                              f"supports {', '.join(SUPPORTED_HF_ARCHS)}")
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "attention_bias", False):
        raise ConversionError("linear biases (attention_bias / mlp_bias) are not supported by the import")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={cfg.hidden_act!r}: only SwiGLU (silu) MLPs are supported")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(f"rope scaling {rope.get('rope_type')!r} is not supported (plain RoPE only)")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer (Megatron's --rotary-base is an int)")
    if getattr(cfg, "use_sliding_window", False):
        raise ConversionError("sliding-window attention is not supported")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    moe = {}
    if mtype == "qwen3_moe":
        L, step, dense = cfg.num_hidden_layers, cfg.decoder_sparse_step, set(cfg.mlp_only_layers or [])
        pattern = [int(cfg.num_experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(L)]
        if any(pattern):  # Megatron's --moe-layer-freq as a list (its integer form counts from layer 0)
            moe = dict(num_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                       moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_pre_softmax=not cfg.norm_topk_prob,
                       moe_layer_freq=1 if all(pattern) else pattern)
    return dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
                num_attention_heads=cfg.num_attention_heads,
                num_query_groups=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                kv_channels=head_dim, norm_epsilon=cfg.rms_norm_eps, qk_layernorm=(mtype != "llama"), **moe,
                untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, rotary_base=int(theta),
                max_position_embeddings=cfg.max_position_embeddings, residual=residual,
                delta_num_blocks=delta_num_blocks, delta_null_source=delta_null_source, delta_gate=delta_gate,
                delta_sources=delta_sources, delta_router_eps=delta_router_eps)


def _deepseek_model_config(cfg, routing: dict) -> dict:
    """The Megatron model flags of a DeepseekV3Config (multi-latent attention, DeepSeek's MoE routing), or a
    ConversionError naming what Megatron's MLA and MoE do not compute as transformers does."""
    def refuse(what):
        raise ConversionError(f"DeepseekV3ForCausalLM with {what}: not importable")

    if getattr(cfg, "attention_bias", False) or getattr(cfg, "hidden_act", "silu") != "silu":
        refuse("attention_bias or a hidden_act other than silu")
    if cfg.q_lora_rank is None:
        refuse("q_lora_rank None (Megatron's local MLA spec norms the key/value latent only with --qk-layernorm, "
               "which needs a query latent)")
    if not getattr(cfg, "rope_interleave", True):
        refuse("rope_interleave false (Megatron's MLA reads the rotary dimensions as interleaved pairs)")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", 10000.0)
    if float(theta) != int(theta):
        refuse(f"rope_theta {theta} (Megatron's --rotary-base is an integer)")
    mla = dict(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
               qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
               rope_type="rope")
    if rope.get("rope_type", "default") == "yarn":
        factor, mscale, mscale_all = rope["factor"], rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
        fixed = (rope.get("original_max_position_embeddings"), rope.get("beta_fast", 32), rope.get("beta_slow", 1),
                 rope.get("truncate", True))
        given = rope.get("attention_factor")
        hf_factor = given if given is not None else (
            _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor, 1.0))
        megatron = _mscale(factor, mscale or 1.0) / _mscale(factor, mscale_all)
        if fixed != (4096, 32, 1, True) or abs(hf_factor - megatron) > 1e-12:
            refuse(f"YaRN parameters {rope} (Megatron's MLA has original_max_position_embeddings 4096, beta_fast 32, "
                   f"beta_slow 1 and the cos/sin scale mscale(factor, mscale) / mscale(factor, mscale_all_dim))")
        mla.update(rope_type="yarn", rotary_scaling_factor=float(factor), mscale=float(mscale or 1.0),
                   mscale_all_dim=float(mscale_all))
    elif rope.get("rope_type", "default") != "default":
        refuse(f"rope_type {rope.get('rope_type')!r}")
    L, k = cfg.num_hidden_layers, min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    moe = {}
    if k < L:
        topk, groups, group_topk = cfg.num_experts_per_tok, cfg.n_group or 1, cfg.topk_group or 1
        if groups > 1 and topk // group_topk != 2:
            refuse(f"n_group {groups}, topk_group {group_topk}, num_experts_per_tok {topk} (Megatron scores a group by "
                   f"its top num_experts_per_tok / topk_group experts, transformers by its top 2)")
        if bool(cfg.norm_topk_prob) != (topk > 1):
            refuse(f"norm_topk_prob {cfg.norm_topk_prob} with top-{topk} (Megatron normalises a sigmoid top-k "
                   f"exactly when k > 1)")
        moe = dict(num_experts=cfg.n_routed_experts, moe_router_topk=topk,
                   moe_ffn_hidden_size=cfg.moe_intermediate_size,
                   moe_layer_freq=[0] * k + [1] * (L - k), moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor),
                   moe_router_num_groups=groups if groups > 1 else None,
                   moe_router_group_topk=group_topk if groups > 1 else None,
                   moe_shared_expert_intermediate_size=(cfg.n_shared_experts * cfg.moe_intermediate_size) or None)
    return dict(num_layers=L, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
                num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_attention_heads,
                kv_channels=cfg.hidden_size // cfg.num_attention_heads, norm_epsilon=cfg.rms_norm_eps,
                qk_layernorm=True,
                untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, rotary_base=int(theta),
                max_position_embeddings=cfg.max_position_embeddings, **mla, **moe, **routing)


# =============================================================================================== export / import
def _tmp_sibling(path):
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=os.path.basename(os.path.abspath(path)) + ".tmp-", dir=parent)


def _finish(tmp, final):
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)


def export_checkpoint(load: str, output: str, dtype: str = "fp32", log=print, verify_integrity: bool = True) -> str:
    """Megatron checkpoint -> HF directory (written to a temporary sibling, renamed at the end). The checkpoint
    is opened by checkpoint/reader.py (verified against its integrity.json unless not ``verify_integrity``)
    before anything is written."""
    if dtype not in ("fp32", "bf16"):
        raise ConversionError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    from megatron_delta.checkpoint.reader import open_checkpoint
    from megatron_delta.checkpoint.run_config import hf_tokenizer_dir

    ckpt_dir, _, rc, _, _ = open_checkpoint(load, verify_integrity)
    check_shared_expert_gate(rc, ckpt_dir)
    if rc.get("multi_latent_attention"):
        check_deepseek_export(rc, ckpt_dir)
    vocab = true_vocab_size(rc)  # fails early on a missing tokenizer
    hf_tok = hf_tokenizer_dir(ckpt_dir, rc)
    if hf_tok is not None and not os.path.isdir(hf_tok):
        raise ConversionError(f"--load {ckpt_dir}: the HF tokenizer directory {hf_tok} (run_config.json "
                              f"hf_tokenizer_dir) is missing; restore it or re-import the model")
    model, _, rc = load_megatron(load, verify_integrity=verify_integrity)
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()
          if isinstance(v, torch.Tensor) and not k.endswith("_extra_state") and not k.startswith("mtp.")}
    if rc.get("mtp_num_layers"):
        why = ("the DeepseekV3 export writes none (num_mtp_layers 0)" if rc.get("multi_latent_attention")
               else "Hugging Face's Qwen3 has no MTP head")
        log(f"[export] the {rc['mtp_num_layers']} multi-token prediction depth(s) (mtp.layers.*) are not exported: "
            f"{why}; they stay in the Megatron checkpoint {ckpt_dir}")
    tied = not rc["untie_embeddings_and_output_weights"]
    hf_sd = megatron_to_hf_state_dict(
        sd, num_layers=rc["num_layers"], num_attention_heads=rc["num_attention_heads"],
        num_query_groups=rc["num_query_groups"], kv_channels=rc["kv_channels"], hidden_size=rc["hidden_size"],
        qk_layernorm=rc["qk_layernorm"], tied=tied, vocab_size=vocab, mla=bool(rc.get("multi_latent_attention")))
    spm = rc.get("tokenizer_model") if rc.get("tokenizer_type") != "NullTokenizer" else None
    if spm:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=spm)
        rc = dict(rc, bos_token_id=sp.bos_id() if sp.bos_id() >= 0 else None,
                  eos_token_id=sp.eos_id() if sp.eos_id() >= 0 else None)
    cfg = hf_config_from_run_config(rc, vocab)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    tmp = _tmp_sibling(output)
    try:
        if rc["residual"] == BASELINE:
            from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

            cls = (DeepseekV3ForCausalLM if rc.get("multi_latent_attention") else Qwen3MoeForCausalLM
                   if rc.get("num_experts") else Qwen3ForCausalLM if rc["qk_layernorm"] else LlamaForCausalLM)
            hf = cls(cfg)
            missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
            missing = [m for m in missing if not (tied and m == "lm_head.weight")]
            if missing or unexpected:
                raise ConversionError(f"export: missing {missing}, unexpected {unexpected}")
            if tied:
                hf.tie_weights()
            hf.to(torch_dtype).save_pretrained(tmp)
        else:
            from megatron_delta.hf import write_remote_code_model

            write_remote_code_model(hf_sd, cfg, tmp, dtype=torch_dtype if dtype == "bf16" else None)
        if spm:
            from megatron_delta.hf import export_sentencepiece_tokenizer

            export_sentencepiece_tokenizer(spm, tmp)
        elif hf_tok:
            for f in HF_TOKENIZER_FILES:
                src = os.path.join(hf_tok, f)
                if os.path.isfile(src) and f != "generation_config.json":
                    shutil.copyfile(src, os.path.join(tmp, f))
        else:
            log(f"[export] no tokenizer exported (tokenizer_type {rc.get('tokenizer_type')}: token ids only)")
        with open(os.path.join(tmp, "megatron_run_config.json"), "w") as f:
            json.dump(rc, f, indent=1)
        _finish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[export] {ckpt_dir} ({rc['residual']}) -> {output} ({type(cfg).__name__}, {dtype}, vocab {vocab})")
    return output


def load_hf_config(hf_dir: str):
    """A stock Qwen3/Llama HF configuration from a directory, with a clear error for anything else."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(f"--hf {hf_dir}: no config.json (not a transformers model directory)")
    try:
        cfg = AutoConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"--hf {hf_dir}: unsupported architecture ({e}); import supports "
                              f"{', '.join(SUPPORTED_HF_ARCHS)}") from None
    model_config_from_hf(cfg, BASELINE)  # raises on unsupported architectures
    return cfg


def load_hf_model(hf_dir: str):
    """A stock Qwen3/Llama HF model (fp32) from a directory, with a clear error for anything else."""
    load_hf_config(hf_dir)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def import_checkpoint(hf_dir_or_model, save: str, residual: str = RESIDUAL_MODES[0], delta_num_blocks=None,
                      delta_null_source=False, delta_gate=GATES[0], delta_sources=SOURCE_DEFINITIONS[0],
                      tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                      make_vocab_size_divisible_by=128, log=print, overwrite=False) -> str:
    """HF Qwen3/Llama -> Megatron checkpoint `save/iter_0000000` (model only; use `--finetune --load`).
    A `save` directory that holds anything is refused unless `overwrite`: it may be a trained run."""
    from megatron_delta.checkpoint.model_config import padded_vocab_size
    from megatron_delta.checkpoint.store import save_checkpoint
    from megatron_delta.core.modes import check_delta_options

    if not overwrite and os.path.isdir(save) and os.listdir(save):
        raise ConversionError(f"--save {save} already holds files (a trained run?): the import would replace them. "
                              f"Pass a new --save directory, or --overwrite to replace it")
    hf_dir = hf_dir_or_model if isinstance(hf_dir_or_model, str) else None
    where = f"--hf {hf_dir or type(hf_dir_or_model).__name__}"
    hf_config = load_hf_config(hf_dir) if hf_dir else hf_dir_or_model.config
    mc = model_config_from_hf(hf_config, residual, delta_num_blocks, delta_null_source, delta_gate, delta_sources)
    try:  # the residual options against the HF model's layers, before its weights; K as pretrain_gpt.py resolves it
        mc["delta_num_blocks"] = check_delta_options(residual, mc["num_layers"], delta_num_blocks, delta_null_source,
                                                     delta_gate, delta_sources)
    except ValueError as e:
        raise ConversionError(f"{where}: {e}") from None
    hf = load_hf_model(hf_dir) if hf_dir else hf_dir_or_model
    if mc["num_layers"] % pipeline_model_parallel_size:
        raise ConversionError(f"--pipeline-model-parallel-size {pipeline_model_parallel_size} does not divide "
                              f"the {mc['num_layers']} layers")
    for name, n in (("num_attention_heads", mc["num_attention_heads"]), ("num_query_groups", mc["num_query_groups"])):
        if n % tensor_model_parallel_size:
            raise ConversionError(f"--tensor-model-parallel-size {tensor_model_parallel_size} does not divide "
                                  f"{name}={n}")
    vocab = hf.config.vocab_size
    emb_rows = hf.get_input_embeddings().weight.shape[0]
    if emb_rows != vocab:
        raise ConversionError(f"config vocab_size {vocab} != embedding rows {emb_rows}")
    padded = padded_vocab_size(vocab, make_vocab_size_divisible_by, tensor_model_parallel_size)
    model, args = build_megatron_model(mc, padded, where)
    tied = not mc["untie_embeddings_and_output_weights"]
    meg_sd = hf_to_megatron_state_dict(
        {k: v.detach().float() for k, v in hf.state_dict().items()}, num_layers=mc["num_layers"],
        num_attention_heads=mc["num_attention_heads"], num_query_groups=mc["num_query_groups"],
        kv_channels=mc["kv_channels"], hidden_size=mc["hidden_size"], qk_layernorm=mc["qk_layernorm"],
        tied=tied, padded_vocab_size=padded, mla=bool(mc.get("multi_latent_attention")),
        expert_bias=bool(mc.get("moe_router_enable_expert_bias")))
    target = model.state_dict()
    new = {}
    for k, v in target.items():
        if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
            new[k] = v
        elif k in meg_sd:
            if tuple(meg_sd[k].shape) != tuple(v.shape):
                raise ConversionError(f"{k}: HF gives shape {tuple(meg_sd[k].shape)}, "
                                      f"Megatron expects {tuple(v.shape)}")
            new[k] = meg_sd.pop(k).to(v.dtype)
        elif "_router." in k:
            new[k] = v  # initial router values (zero query, unit key norm, zero null source / gate)
        else:
            raise ConversionError(f"Megatron parameter {k} has no HF counterpart")
    meg_sd.pop("output_layer.weight", None) if tied else None
    if meg_sd:
        raise ConversionError(f"HF tensors left over: {sorted(meg_sd)[:8]}")
    model.load_state_dict(new)
    # record the requested layout's vocabulary padding and the HF vocabulary / tokenizer
    args.vocab_size = vocab  # NullTokenizer semantics (Megatron-Core 0.17+): --vocab-size N gives N tokens
    args.tokenizer_type, args.tokenizer_model = "NullTokenizer", None
    args.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    # the HF tokenizer files are copied into the checkpoint (CKPT/iter_*/hf_tokenizer): fine-tuning runs that
    # load it carry them on, and export writes them next to the model
    extra = dict(hf_vocab_size=vocab, imported_from=hf_dir, hf_tokenizer_source=hf_dir,
                 imported_for_layout=dict(tensor_model_parallel_size=tensor_model_parallel_size,
                                          pipeline_model_parallel_size=pipeline_model_parallel_size))
    tmp = _tmp_sibling(save)
    try:
        save_checkpoint(tmp, 0, [model], None, None, 0, args, save_optim=False, extra=extra)
        _finish(tmp, save)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    blocks = f", {mc['delta_num_blocks']} blocks" if mc["delta_num_blocks"] is not None else ""
    log(f"[import] {hf_dir or type(hf).__name__} -> {save} (residual {residual}{blocks}, vocab {vocab} padded to "
        f"{padded} for TP{tensor_model_parallel_size}; torch_dist checkpoints load under any TP/PP layout)")
    return save
