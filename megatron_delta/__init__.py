"""megatron-delta: Delta Attention Residuals for Megatron-Core.

  core/         the model: residual modes, routers, sources, stage payload, Megatron-Core layer/block/model
                subclasses and specs. Imports nothing from the rest of the package.
  trainer/      pretrain_gpt.py on Megatron-LM's trainer (megatron.training): flags, providers, evaluation
  hf/           the Hugging Face model and configuration (no Megatron import)
  the rest      the training side shared by the trainer and tools: model_config (a model from its fields, the
                run_config.json keys; no argv), data, checkpointing, conversion (Megatron <-> HF), cloze,
                routing_stats, cpu_platform (CPU + gloo start-up)
  patches/      the one registry of changes to upstream behaviour (CPU adaptation, bug workarounds, the
                trainer's hooks), each with its upstream issue and megatron-core versions
"""
__version__ = "0.1.0"
