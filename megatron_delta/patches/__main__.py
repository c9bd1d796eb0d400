"""``python -m megatron_delta.patches``: the registry, one line per entry, with its state in this environment."""
from megatron_delta.patches import describe

print("\n".join(describe()))
