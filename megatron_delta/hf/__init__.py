"""Hugging Face side of checkpoint conversion.

  configuration_delta - DeltaQwen3Config (Qwen3Config + residual/delta_* fields, use_qk_norm), DeltaDeepseekV3Config
                        (DeepseekV3Config + the same fields)
  modeling_delta      - DeltaQwen3ForCausalLM (Qwen3 / Llama backbone + depth routers), DeltaDeepseekV3ForCausalLM
                        (DeepSeek-V3's multi-latent attention and MoE + depth routers)
  tokenizer           - export_sentencepiece_tokenizer (spm model -> tokenizer.json)

``configuration_delta.py`` and ``modeling_delta.py`` are self-contained remote code:
``write_remote_code_model`` copies them next to the weights, with ``modes.py`` (a copy of
megatron_delta/core/modes.py, which they import relatively there), and writes ``auto_map``, so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads the model
without this package installed.
"""
import os
import shutil

from .configuration_delta import DeltaDeepseekV3Config, DeltaQwen3Config
from .modeling_delta import DeltaDeepseekV3ForCausalLM, DeltaQwen3ForCausalLM, DeltaRouter
from .tokenizer import build_fast_tokenizer, export_sentencepiece_tokenizer

# remote-code file in an export -> its source, relative to the megatron_delta package
REMOTE_CODE_FILES = {
    "configuration_delta.py": os.path.join("hf", "configuration_delta.py"),
    "modeling_delta.py": os.path.join("hf", "modeling_delta.py"),
    "modes.py": os.path.join("core", "modes.py"),
}
AUTO_MAP = {
    "AutoConfig": "configuration_delta.DeltaQwen3Config",
    "AutoModelForCausalLM": "modeling_delta.DeltaQwen3ForCausalLM",
}
# the config class of an export -> its model class (remote code)
MODEL_CLASSES = {DeltaQwen3Config: DeltaQwen3ForCausalLM, DeltaDeepseekV3Config: DeltaDeepseekV3ForCausalLM}


def write_remote_code_model(model_or_state_dict, config: DeltaQwen3Config, out_dir, dtype=None):
    """Save weights (model.safetensors) + config.json with ``auto_map`` + the remote-code files.

    ``model_or_state_dict``: a ``DeltaQwen3ForCausalLM`` (or any module whose state dict uses its
    parameter names) or a state dict with those names. With tied embeddings ``lm_head.weight`` is
    dropped (it is re-tied on load). ``dtype`` optionally casts floating backbone tensors; router
    tensors (``*_router.*``) always stay fp32.
    """
    from safetensors.torch import save_file

    if type(config) not in MODEL_CLASSES:
        raise TypeError(f"config must be a DeltaQwen3Config or DeltaDeepseekV3Config, got {type(config).__name__}")
    config.validate_delta()
    sd = model_or_state_dict.state_dict() if hasattr(model_or_state_dict, "state_dict") else dict(model_or_state_dict)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    tensors = {}
    for name, t in sd.items():
        t = t.detach().to("cpu")
        if "_router." in name:
            t = t.float()
        elif dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous().clone()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    cfg = type(config).from_dict(config.to_dict())
    model_name = MODEL_CLASSES[type(config)].__name__
    cfg.auto_map = {"AutoConfig": f"configuration_delta.{type(config).__name__}",
                    "AutoModelForCausalLM": f"modeling_delta.{model_name}"}
    cfg.architectures = [model_name]
    if dtype is not None:
        cfg.dtype = dtype
    cfg.save_pretrained(out_dir)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for fname, source in REMOTE_CODE_FILES.items():
        shutil.copyfile(os.path.join(package, source), os.path.join(out_dir, fname))
    return out_dir


__all__ = [
    "AUTO_MAP",
    "REMOTE_CODE_FILES",
    "DeltaDeepseekV3Config",
    "DeltaDeepseekV3ForCausalLM",
    "DeltaQwen3Config",
    "DeltaQwen3ForCausalLM",
    "DeltaRouter",
    "build_fast_tokenizer",
    "export_sentencepiece_tokenizer",
    "write_remote_code_model",
]
