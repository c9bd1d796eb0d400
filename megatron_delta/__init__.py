"""megatron-delta: Delta Attention Residuals for Megatron-Core.

Sub-packages, from the bottom layer up (a package imports only those below it; tests/unit/test_import_direction.py
holds the order):

  core/         the model: residual modes, routers, sources, stage payload, Megatron-Core layer/block/model
                subclasses and specs. Imports nothing from the rest of the package.
  hf/           the Hugging Face model and configuration (no Megatron import; core/modes.py's rules only)
  platform/     Megatron-Core on this machine: the CPU + gloo adaptation, distributed start-up, and patches/,
                the one registry of changes to upstream behaviour, each with its upstream issue and versions
  data/         text, tokenizers, indexed datasets, GPT datasets, the bundled default corpus
  checkpoint/   the run_config.json contract, models from their fields, the tools' loader/saver, errors
  evaluation/   checkpoints loaded for evaluation, the trainer's held-out and routing evaluations, cloze
  convert/      Megatron <-> Hugging Face: the state-dict adapter and the import/export commands
  trainer/      pretrain_gpt.py on Megatron-LM's trainer (megatron.training): flags, providers, the run, hooks
"""
__version__ = "0.1.0"
