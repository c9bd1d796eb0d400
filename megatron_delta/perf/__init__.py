"""Performance models and measurement: the library behind tools/memory_plan.py, tools/benchmark.py,
tools/gpu_check.py and tools/gpu_acceptance.sh, tools/host_work.py and tools/kernel_resources.py (which only parse
flags and print).
Importing the package imports none of its modules.

Modules (one concept each):
  shapes           - the 1B / 8B model shapes and the memory plan's job presets
  memory_model     - per-GPU memory per pipeline stage (weights, gradients, optimizer, activations, payload)
  cost_model       - the router's share of a training step on a GPU (bytes moved vs GEMM FLOPs)
  benchmark        - the CPU harness: every mode side by side in one process (time, saved bytes, peak, payload)
  router_breakdown - stand-ins for the router's kernels and the touch-once pass count (where routing time goes)
  machine_rates    - what this machine charges per [tokens, hidden] pass (operator costs, stream/memory rates)
  gpu_check        - the GPU throughput runs (tokens/s, peak memory; eager and with CUDA graphs) and their session
  speed_targets    - each throughput run beside the cost model's prediction and the targets
  acceptance       - the GPU acceptance run's summary: the CUDA tests' outcomes and the throughput run in one table
  routed_stream    - a mode's routed stream alone (SourceBuffer, routers, identity sublayers), forward + backward
  kernel_rates     - the router kernels' bytes over time against the copy rate; where the GPU's time goes
  host_work        - the routers' host work on CPU: launches, table copies and ops per call; a step's host time
  capture_check    - what a CUDA graph replay of the routed step needs, per mode: launch signatures, copies, syncs
  kernel_resources - the Triton kernels compiled for a GPU on CPU: registers, spills, programs per SM, bytes in flight

It imports megatron_delta.core, megatron.core and the shared training side that builds a model from its fields
and starts the one-process world (megatron_delta.checkpoint.model_config, megatron_delta.platform), never the trainer
(megatron_delta.trainer) or megatron.training: gpu_check.train takes the routers' optimizer group as an argument.
"""
