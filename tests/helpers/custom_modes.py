"""A residual mode defined outside the package, as a user adds one (docs/design.md): delta_window."""
from megatron_delta.core import modes


class DeltaWindowMode(modes.DeltaMode):
    """A made-up sixth mode: delta whose routers read h0 and the last two sublayer outputs only."""

    name = "delta_window"
    source_definitions = (modes.EXACT,)
    sources_sum_to_x = False  # the window is not x: x is held

    @classmethod
    def for_sources(cls, sources):
        return cls

    def reads(self, j):
        return ["h0"] + [f"v{i}" for i in range(max(0, j - 2), j)]
