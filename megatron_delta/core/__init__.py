"""The model core: residual routing inside Megatron-Core, and nothing of training.

Modules (one concept each):
  config   - DeltaTransformerConfig: TransformerConfig + the delta_* fields, validated on construction
  router   - DepthRouter: softmax over depth (fp32), its fused CPU kernels (cpu_kernels, csrc/) and the
             GPU kernel adapter (fla_router)
  sources  - SourcePlan / SourceBuffer: which sources each sublayer reads, per residual mode
  payload  - the stage payload: one tensor per micro-batch across a pipeline boundary
  layer / block / model / specs / norms - the Megatron-Core integration (subclasses + layer specs)

Nothing here imports the training side (megatron_delta.model_config, .trainer, .data, .checkpointing,
.conversion, ...) or megatron.training; tests/test_import_direction.py holds that.
"""
