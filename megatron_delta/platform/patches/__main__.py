"""``python -m megatron_delta.platform.patches``: the registry, one line per entry, with its state in this
environment."""
from megatron_delta.platform.patches import describe

print("\n".join(describe()))
