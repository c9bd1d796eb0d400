"""Checkpoints: what a checkpoint directory records, and the tools' loader / saver.

  run_config    - the run_config.json contract in one place: the directory layout (tracker, iter_NNNNNNN/),
                  the recorded keys, writing it on Megatron-LM's args, reading it back (model flags check,
                  model fields, pretrain_gpt.py flags of the model, the tokenizer's vocabulary)
  model_config  - a GPT model (DeltaTransformerConfig + GPTModel options) from a dict of model fields, without
                  a command line (the run_config.json keys, SMALL_CPU_MODEL's defaults)
  store         - the tools' torch_dist save / load (atomic, any TP/PP/VPP layout) with run_config.json
  errors        - CheckpointError, ConversionError, describe_load_failure (a damaged checkpoint file, one line) and
                  resume_advice (the complete checkpoints on disk, newest first)
  layout        - where Megatron-LM's trainer puts a checkpoint: the tracker file and the iteration directories
  reader        - the tools' one way to open a checkpoint: verified against integrity.json first, one line per fault
  integrity     - integrity.json (run_config.json included) verified by default, a mismatch in one line
  finite        - no NaN / inf parameter is ever saved (the check before each save)
  save_lock     - one writer per --save directory (the lock file), rank 0's answer broadcast to every rank
"""
