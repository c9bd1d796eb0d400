"""The residual-routing fields (`delta_*`) on Megatron's config classes.

:class:`DeltaFields` defines the fields and their checks once; each Megatron-Core config class Megatron-LM's
core_transformer_config_from_args can build gets them by a dataclass combination: DeltaTransformerConfig
(TransformerConfig), DeltaMLATransformerConfig (MLATransformerConfig, ``--multi-latent-attention``),
DeltaHeterogeneousTransformerConfig (HeterogeneousTransformerConfig, ``--heterogeneous-layers-config-path``).

The rules about which residual options go together live in `modes.check_delta_options`; what the routed
modes refuse of Megatron-Core (RESIDUAL_FUSIONS, UNSUPPORTED_FEATURES, check_cuda_graphs) lives here. Each is used
both by the dataclass's `__post_init__` (library users) and by the argument parsers (so pretrain_gpt.py fails before
the distributed start-up). Messages name the command-line flag, since that is what most users typed.
"""

from dataclasses import dataclass, fields

from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_delta.core.group_plan import check_group_size
from megatron_delta.core.modes import BASELINE, check_delta_options
from megatron_delta.core.mtp import ROUTED_MTP_REFUSED, check_mtp_options
from megatron_delta.core.router import KERNEL_CHOICES, check_kernel_placement

# Megatron-Core fusions that fold the residual add into another kernel. A routed layer
# (DeltaTransformerLayer.forward) adds nothing to a residual inside Megatron's modules: its norms get the
# routed input u and its addend v = dropout(out + bias) goes to the SourceBuffer (x <- x + v), so a fusion
# that hands the norm's input on as "the residual", or adds the residual in a linear, would compute
# something else. These are refused for the routed modes. `bias_dropout_fusion` is allowed: the routed
# layer's bias-dropout module (layer.get_bias_dropout) adds no residual, fused or not (v = dropout(out + bias)).
RESIDUAL_FUSIONS = {
    "fused_residual_rmsnorm": ("--fused-residual-rmsnorm", "TE's fused RMSNorm returns its input as the "
                               "residual (x), but a routed sublayer's norm input is u = x + G(r)"),
    "fp32_residual_connection": ("--fp32-residual-connection", "the routed modes' residual stream is their "
                                 "sources, kept in the activation dtype; an fp32 copy would not be used"),
    "inference_fuse_tp_communication": ("--inference-fuse-tp-communication", "linear_proj would add the "
                                        "residual x inside its reduce-scatter, where a routed layer adds v "
                                        "to its sources"),
}


def check_residual_fusions(residual: str, **fusions: bool) -> None:
    """Refuse, for a routed mode, each fusion in RESIDUAL_FUSIONS that is switched on (ValueError naming the
    flag). Unknown names are ignored, so callers may pass whatever their config or args have."""
    if residual == BASELINE:
        return
    for field, (flag, why) in RESIDUAL_FUSIONS.items():
        if fusions.get(field):
            raise ValueError(f"{flag} folds the residual add into a fused kernel and cannot be used with "
                             f"--residual {residual}: {why}. Leave {flag} off (the routed layer computes "
                             f"u = x + G(r) and x <- x + v itself)")


# Megatron-Core features the routed layer and block do not implement: config field -> (flag, why). The
# baseline is Megatron's own TransformerLayer / TransformerBlock and keeps all of them. Cross-attention
# has no config field: DeltaTransformerLayer refuses a layer spec that has it.
UNSUPPORTED_FEATURES = {
    "fp4": ("--fp4-format", "the routed block enters FP8 contexts only and the routers switch only FP8 "
            "autocast off around their fp32 math"),
    "cpu_offloading": ("cpu_offloading=True", "TransformerBlock offloads its one hidden-states tensor "
                       "per layer (Megatron-LM has no flag for it); the routed block holds a SourceBuffer of "
                       "many, which nothing offloads"),
    "fine_grained_activation_offloading": ("--fine-grained-activation-offloading", "the offload manager's "
                                           "bookkeeping is untested with routed layers, and the sources the "
                                           "routers read stay resident"),
    "context_parallel_size": ("--context-parallel-size", "the routed block's stage payload and rotary "
                              "trimming assume that each rank holds whole sequences"),
    "overlap_moe_expert_parallel_comm": ("--overlap-moe-expert-parallel-comm", "its combined 1F1B schedule runs "
                                         "Megatron's TransformerLayer piece by piece (attention, dispatch, experts, "
                                         "combine) on one hidden-states tensor, bypassing the routed block and "
                                         "its SourceBuffer"),
}

# TransformerConfig's defaults: a feature is switched on when its field is set to anything else
# (None, False and 0 also count as off: Megatron-LM's --num-experts 0 means none).
_UPSTREAM_DEFAULTS = {f.name: f.default for f in fields(TransformerConfig)}


def check_unsupported_features(residual: str, **values) -> None:
    """Refuse, for a routed mode, each feature in UNSUPPORTED_FEATURES that ``values`` switch on (ValueError
    naming the flag, the mode and what to do). Unknown names are ignored, so callers may pass what they have."""
    if residual == BASELINE:
        return
    for field, (flag, why) in UNSUPPORTED_FEATURES.items():
        value = values.get(field)
        if value not in (None, False, 0) and value != _UPSTREAM_DEFAULTS[field]:
            raise ValueError(f"{flag} is not supported with --residual {residual}: {why}. Drop {flag}, or "
                             f"use --residual baseline (Megatron-Core's own layers support it)")


# CUDA graphs. `full_iteration` captures an iteration's whole forward-backward: the sources, the routers' launch
# tables (kept alive for the graph: triton_router.device_tables) and the gradient buffers the host makes are made
# during the capture and the replay repeats them; the routed step has no synchronisation and a fixed launch
# sequence (perf/capture_check.py proves both on CPU), and pipeline payloads need no shape message
# (core/payload.py). Per-layer graphs (`local`, `transformer_engine`) take only
# a layer's tensor arguments as static inputs. --enable-cuda-graph and --external-cuda-graph are deprecated
# spellings of `local` and `transformer_engine`, which Megatron-Core migrates in __post_init__, after this check.
PER_LAYER_GRAPHS_REFUSED = (
    "a per-layer graph replays a layer with the tensors of its arguments at their capture addresses, and a routed "
    "layer reads its sources from the stage's SourceBuffer, which is not one of its arguments")
CUDA_GRAPH_FLAGS = {"cuda_graph_impl": "--cuda-graph-impl", "enable_cuda_graph": "--enable-cuda-graph",
                    "external_cuda_graph": "--external-cuda-graph"}


def check_cuda_graphs(residual: str, cuda_graph_impl: str = "none", enable_cuda_graph: bool = False,
                      external_cuda_graph: bool = False) -> None:
    """Refuse, for a routed mode, per-layer CUDA graphs (ValueError naming the flag and what to do). Full-iteration
    graphs are accepted (under an interleaved pipeline the payloads are padded to one length: core/payload.py
    payload_padding). The baseline keeps them all."""
    if residual == BASELINE:
        return
    per_layer = [f"{CUDA_GRAPH_FLAGS['cuda_graph_impl']} {cuda_graph_impl}"] if cuda_graph_impl in (
        "local", "transformer_engine") else []
    per_layer += [CUDA_GRAPH_FLAGS[f] for f, on in (("enable_cuda_graph", enable_cuda_graph),
                                                   ("external_cuda_graph", external_cuda_graph)) if on]
    if per_layer:
        raise ValueError(f"{per_layer[0]} is not supported with --residual {residual}: {PER_LAYER_GRAPHS_REFUSED}. "
                         f"Use --cuda-graph-impl full_iteration (the whole forward-backward in one graph), or "
                         f"--residual baseline")


# Why the routed modes refuse --heterogeneous-layers-config-path (the baseline builds Megatron's own model).
HETEROGENEOUS_REFUSED = (
    "Megatron's heterogeneous layer spec gives each layer its own submodules (attention or MLP a no-op or a "
    "linear layer, its own FFN size) and TransformerBlock gives each layer a plain TransformerConfig without the "
    "delta_* fields, while a routed model builds every layer from the one routed layer spec")


def check_heterogeneous_layers(residual: str, path) -> None:
    """Refuse --heterogeneous-layers-config-path for a routed mode (ValueError naming the flag and what to do)."""
    if path and residual != BASELINE:
        raise ValueError(f"--heterogeneous-layers-config-path is not supported with --residual {residual}: "
                         f"{HETEROGENEOUS_REFUSED}. Drop the flag, or use --residual baseline")


@dataclass
class DeltaFields:
    """The residual-routing fields and their checks, combined with a Megatron-Core config class (first base:
    its ``__post_init__`` checks these, then runs the Megatron class's). `residual='baseline'` is plain Megatron."""

    residual: str = BASELINE
    """baseline or a routed mode of core/modes.py (``--residual``'s choices; docs/design.md section 1)."""
    delta_num_blocks: int | None = None
    """K for the block modes (core/modes.py BLOCK_MODES); None picks the default (4)."""
    delta_null_source: bool = False
    """Each router also reads a learnable, zero-initialised null source."""
    delta_gate: str = "none"
    """'scalar': u = x + a*r with a = 0 at init (the model starts as the baseline)."""
    delta_sources: str = "exact"
    """'exact' (docs/design.md) or 'authors-code' (the public code's block sources)."""
    delta_router_eps: float = 1e-6
    """eps of the routers' key RMS norm."""
    delta_router_kernels: str = "auto"
    """'auto': fused C kernels for fp32 CPU tensors (cpu_kernels.py), the project's Triton kernels for CUDA tensors
    (triton_router.py; fla-core's kernel where Triton does not import), PyTorch ops otherwise; 'c', 'triton', 'fla'
    (fla_router.py) or 'torch' (PyTorch ops) force one (docs/usage.md, router kernels)."""

    delta_router_group_size: int | str = "auto"
    """delta / full_attnres: routers per group pass over the older sources (core/group_router.py); 'auto' splits
    each chunk's routers into the groups with the fewest counted passes, 1 is one router per pass."""

    delta_pp_source_cache: bool = True
    """Interleaved pipelines: a rank keeps the sources its earlier chunks held, and a boundary sends only
    what the receiving rank lacks (core/source_cache.py). No effect without virtual pipeline stages."""

    def __post_init__(self):
        # Ours first: they read only fields as given, and name the flag where Megatron's checks of the
        # same fields (e.g. CPU offloading, MoE) would fail with their own message or an assert.
        if self.delta_router_kernels not in KERNEL_CHOICES:
            raise ValueError(f"--delta-router-kernels {self.delta_router_kernels!r} is not one of "
                             f"{', '.join(KERNEL_CHOICES)}")
        check_kernel_placement(self.delta_router_kernels,
                               activation_dtype="bf16" if self.bf16 else "fp16" if self.fp16 else "fp32")
        self.delta_num_blocks = check_delta_options(
            self.residual, self.num_layers, self.delta_num_blocks, self.delta_null_source,
            self.delta_gate, self.delta_sources, router_kernels=self.delta_router_kernels)
        self.delta_router_group_size = check_group_size(self.delta_router_group_size, self.residual,
                                                        self.delta_sources, self.delta_router_kernels)
        check_residual_fusions(self.residual, **{f: getattr(self, f, False) for f in RESIDUAL_FUSIONS})
        check_unsupported_features(self.residual, **{f: getattr(self, f) for f in UNSUPPORTED_FEATURES})
        check_cuda_graphs(self.residual, self.cuda_graph_impl, self.enable_cuda_graph, self.external_cuda_graph)
        check_mtp_options(self.residual, self.mtp_num_layers, self.recompute_granularity,
                          **{f: getattr(self, f) for f in ROUTED_MTP_REFUSED})
        super().__post_init__()  # the Megatron-Core config class's checks and derived fields

    @property
    def routed(self) -> bool:
        return self.residual != BASELINE


@dataclass
class DeltaTransformerConfig(DeltaFields, TransformerConfig):
    """TransformerConfig + residual routing."""


@dataclass
class DeltaMLATransformerConfig(DeltaFields, MLATransformerConfig):
    """MLATransformerConfig (multi-latent attention, ``--multi-latent-attention``) + residual routing."""


@dataclass
class DeltaHeterogeneousTransformerConfig(DeltaFields, HeterogeneousTransformerConfig):
    """HeterogeneousTransformerConfig (a config per layer, ``--heterogeneous-layers-config-path``) + residual
    routing; `baseline` only (HETEROGENEOUS_REFUSED says why the routed modes refuse it)."""

    def __post_init__(self):
        check_heterogeneous_layers(self.residual, self.heterogeneous_layers_config_path or "<encoded json>")
        super().__post_init__()
