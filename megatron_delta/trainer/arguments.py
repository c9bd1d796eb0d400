"""The project's flags, added to Megatron-LM's parser through ``extra_args_provider``.

Every Megatron-LM flag keeps its name and meaning; these add the residual routing (README, "The
residual modes") and a few run conveniences. :func:`validate_delta_args` runs after Megatron's parser
and before Megatron's ``validate_args``, so a bad combination is one line naming the flag.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Optional

from megatron_delta.core.group_plan import check_group_size
from megatron_delta.core.modes import BASELINE, BLOCK_MODES, RESIDUAL_MODES, SOURCE_DEFINITIONS
from megatron_delta.core.router import KERNEL_CHOICES

PROG = "pretrain_gpt.py"


class TrainerArgumentError(ValueError):
    """A bad flag or flag combination; main() prints `pretrain_gpt.py: error: <message>`."""


def add_delta_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the megatron-delta flags."""
    g = parser.add_argument_group("residual routing (megatron-delta)")
    g.add_argument("--residual", choices=RESIDUAL_MODES, default=BASELINE,
                   help="depth routing of the residual stream (default: baseline, Megatron's own layer)")
    g.add_argument("--delta-num-blocks", type=int, default=None,
                   help=f"K blocks of L/K layers ({', '.join(BLOCK_MODES)}); default 4 (L when L <= 4); "
                        "needed when 4 does not divide L")
    g.add_argument("--delta-null-source", action="store_true",
                   help="each router also reads a learnable zero-initialised null source")
    g.add_argument("--delta-gate", choices=["none", "scalar"], default="none",
                   help="scalar gate u = x + a*r, a=0 at init (additive modes only)")
    g.add_argument("--delta-sources", choices=SOURCE_DEFINITIONS, default="exact")
    g.add_argument("--delta-router-eps", type=float, default=None, help="default: --norm-epsilon")
    g.add_argument("--delta-router-kernels", choices=list(KERNEL_CHOICES), default="auto",
                   help="auto: fused C kernels for fp32 CPU tensors, built on first use (PyTorch ops if "
                        "that fails), the project's Triton kernels for CUDA tensors (fla-core's kernel when "
                        "Triton does not import); c: the same, a failed build is an error; torch: PyTorch ops; "
                        "triton: the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1); fla: fla-core's "
                        "kernel (docs/gpu.md)")
    g.add_argument("--delta-router-group-size", default="auto", metavar="S",
                   help="delta and full_attnres: S consecutive routers share one pass over the sources older than "
                        "their group (core/group_router.py); auto (default): each chunk's routers split into the "
                        "groups with the fewest counted passes; 1: one router per pass")
    g.add_argument("--delta-pp-source-cache", choices=["on", "off"], default=None,
                   help="interleaved pipelines (routed modes): each rank keeps the sources its earlier virtual "
                        "chunks held and a boundary sends only what the receiving rank lacks (default: on where "
                        "it applies)")
    g.add_argument("--delta-cpu-allocator", choices=["cache", "system"], default="cache",
                   help="CPU runs: cache = glibc keeps freed tensor memory for reuse; system = as configured")
    g.add_argument("--delta-router-lr-mult", type=float, default=1.0,
                   help="router parameters get their own optimizer group: lr x M, no weight decay")
    g.add_argument("--delta-metrics-file", type=str, default=None,
                   help="append JSON lines of metrics (iteration, lm_loss, lr, grad_norm; validation) here")
    g.add_argument("--delta-heldout-data-path", nargs="*", default=None,
                   help="another distribution, evaluated beside validation at every evaluation")
    # Megatron-LM's --verify-integrity (store_true, default False) gets its negation and the default None:
    # validate_delta_args turns it on for torch_dist checkpoints (checkpoint/integrity.py)
    g.add_argument("--no-verify-integrity", dest="verify_integrity", action="store_false",
                   help="do not hash checkpoints on save nor verify them on load (default: both, with "
                        "--ckpt-format torch_dist; Megatron-LM's --verify-integrity)")
    parser.set_defaults(verify_integrity=None)
    _escape_percent_in_help(parser)
    return parser


def _escape_percent_in_help(parser: argparse.ArgumentParser) -> None:
    """argparse %-formats help strings; megatron.training 0.19.2 has one with a bare '%' followed by
    ')' (so `--help` raises "ValueError: unsupported format character ')'"). Escape every '%' that
    is neither an argparse placeholder such as %(default)s nor an escaped '%%' (--rotary-percent,
    --split)."""
    import re

    # "%%" and "%(name)s" stay as they are; any other "%" becomes "%%"
    token = re.compile(r"%%|%\(\w+\)[a-z]|%")
    for action in parser._actions:
        if isinstance(action.help, str) and "%" in action.help:
            action.help = token.sub(lambda m: m.group(0) if len(m.group(0)) > 1 else "%%", action.help)


# Megatron-LM's defaults that need a GPU, as (args attribute, value that needs one, the flag that turns it off).
GPU_DEFAULTS = (
    ("transformer_impl", "transformer_engine", "--transformer-impl local"),
    ("distributed_backend", "nccl", "--distributed-backend gloo"),
    ("gradient_accumulation_fusion", True, "--no-gradient-accumulation-fusion"),
    ("masked_softmax_fusion", True, "--no-masked-softmax-fusion"),
    ("bias_gelu_fusion", True, "--no-bias-gelu-fusion"),
    ("bias_dropout_fusion", True, "--no-bias-dropout-fusion"),
    ("apply_rope_fusion", True, "--no-rope-fusion"),
    ("use_cpu_initialization", False, "--use-cpu-initialization"),
    ("no_persist_layer_norm", False, "--no-persist-layer-norm"),
)


def check_graphs_need_cuda(args: argparse.Namespace) -> None:
    """Without CUDA, refuse CUDA graphs at start-up (one line, every mode): Megatron would fail deep inside,
    making the CUDA stream it captures on."""
    import torch

    impl = getattr(args, "cuda_graph_impl", "none")
    graphs = [flag for flag, on in ((f"--cuda-graph-impl {impl}", impl not in (None, "none")),
                                    ("--enable-cuda-graph", getattr(args, "enable_cuda_graph", False)),
                                    ("--external-cuda-graph", getattr(args, "external_cuda_graph", False))) if on]
    if graphs and not torch.cuda.is_available():
        raise TrainerArgumentError(f"no CUDA device: {graphs[0]} captures CUDA kernels into a graph, which needs a "
                                   f"CUDA device; drop it on CPU")


def check_cpu_switches(args: argparse.Namespace) -> None:
    """Without CUDA, refuse at start-up (one line listing the switches) a run that keeps one of Megatron-LM's
    GPU-only defaults, instead of a failure deep inside Megatron (e.g. "ProcessGroupNCCL is only supported
    with GPUs")."""
    import torch

    if torch.cuda.is_available():
        return
    missing = [flag for attr, gpu_value, flag in GPU_DEFAULTS if getattr(args, attr, None) == gpu_value]
    if missing:
        raise TrainerArgumentError(
            f"no CUDA device: Megatron-LM's GPU defaults need {' '.join(missing)} on CPU (all CPU switches: "
            f"{' '.join(flag for _, _, flag in GPU_DEFAULTS)})")


# Megatron-LM's args attribute of a TransformerConfig field, where the names differ
# (megatron.training.argument_utils.core_transformer_config_from_args: num_moe_experts = args.num_experts).
CONFIG_FIELD_ARGS = {"num_moe_experts": "num_experts"}

# Megatron-LM's multi-latent-attention flags (arguments.py _add_mla_args): args attribute -> (flag, parser default).
# They mean something only with --multi-latent-attention (MLATransformerConfig's fields); the three rotary ones
# also configure --position-embedding-type yarn (argument_utils.py _apply_yarn_config_from_args).
MLA_FLAGS = {
    "q_lora_rank": ("--q-lora-rank", None), "kv_lora_rank": ("--kv-lora-rank", 32),
    "qk_head_dim": ("--qk-head-dim", 128), "qk_pos_emb_head_dim": ("--qk-pos-emb-head-dim", 64),
    "v_head_dim": ("--v-head-dim", 128), "cache_mla_latents": ("--cache-mla-latents", False),
    "rotary_scaling_factor": ("--rotary-scaling-factor", 1.0), "mscale": ("--mscale", 1.0),
    "mscale_all_dim": ("--mscale-all-dim", 0.0),
}
MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
YARN_SHARED_FLAGS = ("rotary_scaling_factor", "mscale", "mscale_all_dim")
# --position-embedding-type yarn's own flags, which MLATransformerConfig does not read (its
# original_max_position_embeddings, beta_fast and beta_slow have no Megatron-LM flag and keep their defaults)
YARN_ONLY_FLAGS = {"yarn_original_max_position_embeddings": "--yarn-original-max-position-embeddings",
                   "yarn_beta_fast": "--yarn-beta-fast", "yarn_beta_slow": "--yarn-beta-slow",
                   "yarn_correction_range_round_to_int": "--yarn-correction-range-round-to-int"}


def check_mla_flags(args: argparse.Namespace) -> None:
    """Multi-latent attention's flags, checked before the distributed start-up (one line naming the flag): an
    MLA flag without --multi-latent-attention, a combination Megatron-Core would refuse only when the model is
    built (or at the first step), and the sizes tensor parallelism splits."""
    mla = bool(getattr(args, "multi_latent_attention", False))
    if not mla:
        yarn = args.position_embedding_type == "yarn"
        for attr, (flag, default) in MLA_FLAGS.items():
            if getattr(args, attr, default) != default and not (yarn and attr in YARN_SHARED_FLAGS):
                raise ValueError(f"{flag} configures multi-latent attention: add --multi-latent-attention, or drop "
                                 f"{flag}")
        if args.rope_type == "yarn":
            raise ValueError("--rope-type yarn applies to multi-latent attention only (Megatron-LM's other "
                             "attention takes --rope-type rope): add --multi-latent-attention, or use "
                             "--position-embedding-type yarn")
        return
    if args.position_embedding_type not in ("rope", "none"):
        raise ValueError(f"--multi-latent-attention computes its rotary embedding inside the attention (--rope-type "
                         f"rope or yarn, default yarn); --position-embedding-type {args.position_embedding_type} "
                         f"would add another: use --position-embedding-type rope (or none)")
    for attr, flag in YARN_ONLY_FLAGS.items():
        if getattr(args, attr, None) is not None:
            raise ValueError(f"{flag} is not read with --multi-latent-attention: Megatron-LM's MLATransformerConfig "
                             f"keeps its own YaRN defaults (original_max_position_embeddings 4096, beta_fast 32, "
                             f"beta_slow 1); its YaRN flags are --rotary-scaling-factor, --mscale, --mscale-all-dim. "
                             f"Drop {flag}")
    if getattr(args, "apply_rope_fusion", False) and args.transformer_impl != "transformer_engine":
        raise ValueError("--multi-latent-attention with RoPE fusion (Megatron-LM's default) needs Transformer "
                         "Engine's fused MLA RoPE kernels: pass --no-rope-fusion, or --transformer-impl "
                         "transformer_engine on a GPU")
    if args.qk_layernorm and args.q_lora_rank is None and args.transformer_impl != "transformer_engine":
        raise ValueError("--qk-layernorm with --multi-latent-attention and no --q-lora-rank: Megatron-Core's local "
                         "MLA spec refuses a query-latent norm without a query latent (mla_qk_norm_config.py). "
                         "Pass --q-lora-rank, or drop --qk-layernorm (the key/value latent is then not normed "
                         "either)")
    for attr in MLA_SIZES:
        flag, value = MLA_FLAGS[attr][0], getattr(args, attr)
        if value is not None and value <= 0:
            raise ValueError(f"{flag} {value} must be a positive size")
    tp = args.tensor_model_parallel_size
    if args.transformer_impl != "transformer_engine" and tp > 1:
        # The local spec's down projections are ColumnParallelLinear (TE's are replicated): their outputs split
        sizes = [("--kv-lora-rank + --qk-pos-emb-head-dim", args.kv_lora_rank + args.qk_pos_emb_head_dim)]
        if args.q_lora_rank is not None:
            sizes.insert(0, ("--q-lora-rank", args.q_lora_rank))
        for flag, n in sizes:
            if n % tp:
                raise ValueError(f"--tensor-model-parallel-size {tp} must divide {flag} ({n}): the local "
                                 f"backend's MLA down projections split it over the tensor-parallel ranks")


def check_routed_features(args: argparse.Namespace) -> None:
    """What DeltaTransformerConfig refuses for the routed modes (core.config RESIDUAL_FUSIONS and
    UNSUPPORTED_FEATURES, the same rules and messages), checked on Megatron-LM's args before the distributed
    start-up (the config is built after it). Fields Megatron-LM has no flag for are absent from args: skipped."""
    from megatron_delta.core.config import (
        RESIDUAL_FUSIONS,
        UNSUPPORTED_FEATURES,
        check_cuda_graphs,
        check_heterogeneous_layers,
        check_residual_fusions,
        check_unsupported_features,
    )
    from megatron_delta.core.mtp import ROUTED_MTP_REFUSED, check_mtp_options

    def values(table):
        return {field: getattr(args, CONFIG_FIELD_ARGS.get(field, field), None) for field in table}

    check_residual_fusions(args.residual, **values(RESIDUAL_FUSIONS))
    check_unsupported_features(args.residual, **values(UNSUPPORTED_FEATURES))
    check_cuda_graphs(args.residual, getattr(args, "cuda_graph_impl", "none"),
                      bool(getattr(args, "enable_cuda_graph", False)),
                      bool(getattr(args, "external_cuda_graph", False)))
    check_mtp_options(args.residual, args.mtp_num_layers, args.recompute_granularity,
                      **{f: getattr(args, f, False) for f in ROUTED_MTP_REFUSED})
    check_heterogeneous_layers(args.residual, getattr(args, "heterogeneous_layers_config_path", None))


def check_tensor_parallel_split(args: argparse.Namespace) -> None:
    """What tensor parallelism splits over its ranks must divide by its size. Megatron-Core asserts it only
    when the model is built, after the distributed start-up, as 'x is not divisible by y'."""
    tp = args.tensor_model_parallel_size
    sizes = [("--num-attention-heads", args.num_attention_heads), ("--ffn-hidden-size", args.ffn_hidden_size)]
    if args.group_query_attention:
        sizes.append(("--num-query-groups", args.num_query_groups))
    for flag, n in sizes:
        if n is not None and n % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} must divide {flag} ({n}): tensor parallelism "
                             f"splits it over its ranks")


_ITER_DIR = re.compile(r"^iter_(\d{7})$")


def check_paths(args: argparse.Namespace) -> None:
    """The path-valued flags, checked at start-up (before the distributed start-up and any training), one line
    naming the flag: --save must be a writable directory (created if missing), --load not one iteration's
    directory, --delta-metrics-file a writable file, --delta-heldout-data-path existing indexed datasets."""
    if args.load:
        m = _ITER_DIR.match(os.path.basename(os.path.normpath(args.load)))
        if m:
            parent = os.path.dirname(os.path.normpath(args.load)) or "."
            raise TrainerArgumentError(
                f"--load {args.load} is one iteration's directory; --load takes the run's directory and "
                f"--ckpt-step the iteration: --load {parent} --ckpt-step {int(m.group(1))}")
    if args.save:
        _check_writable_dir("--save", args.save)
    if args.delta_metrics_file:
        path = args.delta_metrics_file
        if os.path.isdir(path):
            raise TrainerArgumentError(f"--delta-metrics-file {path} is a directory; pass a file name "
                                       f"(JSON lines are appended to it)")
        _check_writable_dir("--delta-metrics-file", os.path.dirname(os.path.abspath(path)), of=path)
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise TrainerArgumentError(f"--delta-metrics-file {path} is not writable; pass another file")
    for entry in args.delta_heldout_data_path or ():
        try:
            float(entry)  # a blend weight
        except ValueError:
            from megatron_delta.data.indexed import validate_indexed_prefix

            try:
                validate_indexed_prefix(entry, "--delta-heldout-data-path")
            except (ValueError, FileNotFoundError) as e:
                raise TrainerArgumentError(str(e)) from None


def _check_writable_dir(flag: str, path: str, of: Optional[str] = None) -> None:
    """path is (or can be made) a directory this process can create files in: tried, not asked (os.access
    says yes to root on a read-only filesystem)."""
    import tempfile

    shown = of or path
    if os.path.exists(path) and not os.path.isdir(path):
        where = f"{flag} {path}" if of is None else f"{flag} {of}: {path}"
        raise TrainerArgumentError(f"{where} is a file, not a directory; pass a directory")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise TrainerArgumentError(f"{flag} {shown}: cannot write into {path} ({e.strerror or e}); pass a "
                                   f"writable directory") from None


def validate_delta_args(args: argparse.Namespace) -> None:
    """Resolve --delta-num-blocks / --delta-router-eps and reject bad combinations (one line, flag named)."""
    import torch

    from megatron_delta.checkpoint.integrity import resolve_default
    from megatron_delta.core.modes import check_delta_options
    from megatron_delta.core.router import check_kernels
    from megatron_delta.core.specs import check_moe_backend

    check_cpu_switches(args)
    problem = resolve_default(args)
    if problem:
        raise TrainerArgumentError(problem)
    if args.save and args.save_interval is None:
        if args.train_iters == 0:  # only the initial model is saved (main._save_initial_model)
            args.save_interval = 1
        else:
            raise TrainerArgumentError(f"--save needs --save-interval N (a checkpoint every N iterations; "
                                       f"N = --train-iters {args.train_iters} saves at the end only)")

    if (args.mtp_num_layers and args.pipeline_model_parallel_size > 1 and (args.save or args.load)
            and not args.untie_embeddings_and_output_weights):
        # megatron-core 0.19.2 (every --residual): a tied model's MTP stage under PP > 1 holds an output-layer
        # weight its sharded state dict refuses, so the first --save (or a --load) fails deep inside
        # dist_checkpointing (NVIDIA/Megatron-LM PR #7577, open)
        raise TrainerArgumentError("--mtp-num-layers with --pipeline-model-parallel-size > 1 cannot save or load a "
                                   "checkpoint with tied embeddings in megatron-core 0.19.2 (NVIDIA/Megatron-LM PR "
                                   "#7577); add --untie-embeddings-and-output-weights")
    try:
        args.delta_num_blocks = check_delta_options(
            args.residual, args.num_layers, args.delta_num_blocks, args.delta_null_source,
            args.delta_gate, args.delta_sources, args.delta_router_lr_mult, args.delta_router_kernels)
        args.delta_router_group_size = check_group_size(args.delta_router_group_size, args.residual,
                                                        args.delta_sources, args.delta_router_kernels)
        check_routed_features(args)
        check_moe_backend(args.transformer_impl, args.num_experts, args.moe_grouped_gemm)
        check_mla_flags(args)
        check_tensor_parallel_split(args)
        if args.residual != BASELINE:
            # `c` must build (and run this run's tensors), `fla` import: fail now, not at step 1
            # Megatron-LM puts the model on CUDA whenever CUDA is present (else the CPU platform runs)
            check_kernels(args.delta_router_kernels, on_cuda=torch.cuda.is_available(),
                          activation_dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")
    except ValueError as e:
        raise TrainerArgumentError(str(e)) from None
    check_graphs_need_cuda(args)  # after the routed refusals: theirs says which graphs a routed mode takes
    if args.delta_router_eps is None:
        args.delta_router_eps = args.layernorm_epsilon  # --norm-epsilon
    if args.train_iters and args.eval_interval is None and not args.train_samples:
        # megatron.training sizes the validation set as train_iters // eval_interval (training.py
        # get_train_valid_test_num_samples): without the flag it fails there with a TypeError.
        raise TrainerArgumentError("--eval-interval is needed with --train-iters (Megatron-LM's trainer sizes the "
                                   "validation set from it); pass --eval-interval N (with --eval-iters 0 for no "
                                   "validation)")
    if args.transformer_impl == "transformer_engine" and args.residual != BASELINE:
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            raise TrainerArgumentError(
                f"--residual {args.residual} with --transformer-impl transformer_engine needs Transformer "
                "Engine; use --transformer-impl local")


def resolve_pp_source_cache(args: argparse.Namespace) -> None:
    """--delta-pp-source-cache -> a bool, after Megatron-LM's validate_args (which derives the virtual pipeline
    size from --num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank). On by default
    where it applies: a routed mode under the interleaved schedule, without --pipeline-model-parallel-layout
    (core/source_cache.py plans even or first/last-stage splits). An explicit `on` elsewhere is refused."""
    from megatron_delta.core.source_cache import cache_applies

    interleaved = args.residual != BASELINE and (args.virtual_pipeline_model_parallel_size or 1) > 1
    applies = cache_applies(argparse.Namespace(**{**vars(args), "delta_pp_source_cache": True}))
    if args.delta_pp_source_cache == "on":
        if not interleaved:
            raise TrainerArgumentError(
                "--delta-pp-source-cache on applies only to a routed --residual under the interleaved pipeline "
                "schedule (--pipeline-model-parallel-size > 1 with --num-layers-per-virtual-pipeline-stage or "
                "--num-virtual-stages-per-pipeline-rank giving two or more chunks per rank); drop the flag")
        if args.pipeline_model_parallel_layout:
            raise TrainerArgumentError(
                "--delta-pp-source-cache on cannot plan the chunks of --pipeline-model-parallel-layout; use "
                "--num-layers-per-virtual-pipeline-stage (or --num-virtual-stages-per-pipeline-rank), or pass "
                "--delta-pp-source-cache off")
    args.delta_pp_source_cache = applies and args.delta_pp_source_cache != "off"
