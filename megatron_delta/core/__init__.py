"""The model core: residual routing inside Megatron-Core, and nothing of training.

Modules (one concept each):
  modes        - the residual modes and their rules (what each sublayer reads, commits and forms), checks
  config       - DeltaFields (the delta_* fields, validated on construction) on TransformerConfig
                 (DeltaTransformerConfig) and MLATransformerConfig (DeltaMLATransformerConfig)
  router       - DepthRouter: softmax over depth (fp32)
  group_plan   - which routers route together and the passes counted for them (pure arithmetic, no torch)
  group_router - the group router of delta / full_attnres: one pass over a group's older sources, then merges
  cpu_kernels  - the router's fused CPU kernels (C sources in csrc/, compiled on first use)
  group_kernels - the group router's fused CPU kernels (csrc/group_router_kernels.c)
  triton_router - the router's Triton kernels for CUDA tensors (tested on CPU under Triton's interpreter)
  triton_group_kernels - the group router's Triton kernels
  fla_router   - the GPU kernel adapter (fla-core's fused_attnres)
  traffic      - the counter of [tokens, hidden] reads and writes the routers make (the cost model's check)
  sources      - SourcePlan / SourceBuffer: which sources each sublayer reads, per residual mode
  source_cache - the pipeline source cache shared by a rank's virtual-pipeline chunks
  payload      - the stage payload: one tensor per micro-batch across a pipeline boundary
  mtp          - the residual modes in Megatron-Core's multi-token prediction layers
  layer / block / model / specs / norms - the Megatron-Core integration (subclasses + layer specs)
  mla          - multi-latent attention on the local backend (what megatron-core 0.19 lacks there)

Nothing here imports the training side (megatron_delta.platform, .data, .checkpoint, .evaluation, .convert,
.trainer) or megatron.training; tests/unit/test_import_direction.py holds that.
"""
