"""The platform under the model: Megatron-Core on this machine, and the registry of changes to upstream.

  cpu          - the CPU + gloo adaptation's activation (activate_cpu_platform / is_cpu_platform) and the CPU
                 allocator (--delta-cpu-allocator)
  distributed  - distributed start-up: torch.distributed (gloo on CPU, nccl on GPU), Megatron's model-parallel
                 groups, the RNG; free_port
  patches/     - the one registry of changes to upstream behaviour (CPU adaptation, bug workarounds, the
                 trainer's hooks), each with its upstream issue and megatron-core versions;
                 ``python -m megatron_delta.platform.patches`` lists them

Imports megatron_delta.core only (tests/unit/test_import_direction.py holds the layering).
"""
