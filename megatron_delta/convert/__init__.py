"""Conversion between megatron-delta checkpoints and Hugging Face transformers.

  state_dict_adapter - Megatron-Core <-> HF tensor names and shapes (one rename table, split / fuse)
  hf_checkpoint      - the export / import commands (tools/convert_checkpoint.py) and the HF configuration mapping
"""
