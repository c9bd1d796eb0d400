"""megatron-delta: Delta Attention Residuals for Megatron-Core.

Modules (one concept each):
  cpu_platform  - the adaptation of Megatron-Core to CPU + gloo (active only without CUDA)
  config        - DeltaConfig: residual mode and delta_* options, validated on construction
  router        - DepthRouter: the softmax-over-depth router math (fp32)
  sources       - SourceBuffer: which sources each sublayer reads, per residual mode
  payload       - pack_stage_payload / unpack_stage_payload across pipeline stages
  layer / block / model / layer_specs - the Megatron-Core integration
  data          - tokenizer and dataset building (Megatron indexed datasets)
"""
__version__ = "0.1.0"
