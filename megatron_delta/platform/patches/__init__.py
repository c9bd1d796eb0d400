"""Every change this project makes to upstream behaviour (Megatron-Core, megatron.training), in one table.

Each :class:`Patch` names the upstream thing it changes (``module.attr``), the upstream issue or limitation it
answers (a Megatron-LM issue number where one exists, else the failure without it), the megatron-core
versions it was written and verified for, and where it applies (CPU only, or every device). Entries with an
``apply`` function are installed here, by :func:`apply_patches`, only where they apply: on a megatron-core
outside an entry's versions (or on CUDA, for a CPU-only entry) the entry is skipped, and
:func:`describe` / ``python -m megatron_delta.platform.patches`` show why. The other entries point at the one place
that makes the change (a subclass in megatron_delta/core, whose models import nothing of the training side;
a setting; the trainer's hooks) so that a reader finds all of them from here.

Known upstream warnings that say nothing to a user of this project are listed here too (KNOWN_WARNINGS) and
silenced only around the upstream calls that emit them (:func:`known_warnings_quieted`, a
``warnings.catch_warnings`` block): the project never changes the process-wide warning filters.

Modules: this one (the table, apply_patches, describe, the warnings); cpu (the CPU-only entries'
implementations); distopt (the distributed optimizer's fixes on every device); ckpt_writer (the checkpoint
writer's results queue in a Manager that exits with its rank); install (replace / suspend, the one way an entry
changes upstream); __main__ (``python -m megatron_delta.platform.patches``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import warnings
from typing import Callable, Dict, List, Optional, Tuple

__all__ = [
    "Patch", "REGISTRY", "CPU_ONLY", "EVERY_DEVICE", "megatron_core_version", "applies", "apply_patches",
    "entry", "applied", "describe", "patches_suspended", "batch_p2p_comm", "check_p2p_config", "KnownWarning",
    "KNOWN_WARNINGS", "KNOWN_LOG_RECORDS", "known_warnings_quieted", "import_megatron", "PATCHED_MODULES",
    "TRAINING_MODULES",
]

CPU_ONLY = "CPU only"
EVERY_DEVICE = "every device"
logger = logging.getLogger(__name__)


def _specifier(versions: str):
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(versions)


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    changes: Tuple[str, ...]  # the upstream things changed, "module.attr"
    answers: str  # the upstream issue ("Megatron-LM #750: ...") or the failure without the patch, one line
    versions: str  # megatron-core versions it is written for (a PEP 440 specifier set)
    where: str  # CPU_ONLY or EVERY_DEVICE
    apply: Optional[Callable[[], None]] = None  # installs it (None: made elsewhere, see `made_by`)
    made_by: str = ""  # for the entries not installed here: where the change is made

    def __post_init__(self):
        if self.where not in (CPU_ONLY, EVERY_DEVICE):
            raise ValueError(f"patch {self.name}: where must be {CPU_ONLY!r} or {EVERY_DEVICE!r}, got {self.where!r}")
        if (self.apply is None) == (not self.made_by):
            raise ValueError(f"patch {self.name}: give either apply (installed here) or made_by (made elsewhere)")
        if not (self.changes and self.answers and self.versions):
            raise ValueError(f"patch {self.name}: changes, answers and versions are required")
        _specifier(self.versions)  # a well-formed specifier set


def _apply(module: str, function: str) -> Callable[[], None]:
    """The implementation, imported when the patch is applied (megatron_delta.platform.patches.cpu / .distopt /
    .ckpt_writer)."""

    def apply():
        getattr(importlib.import_module(f"megatron_delta.platform.patches.{module}"), function)()

    apply.__qualname__ = f"{module}.{function}"
    return apply


# Megatron-Core modules on the training path (model build, forward/backward schedules, p2p, DDP,
# optimizers, grad clipping, RNG, timers, checkpointing exchange) that hard-code CUDA through their
# module-level name ``torch``.  They get the torch proxy (module_torch).
PATCHED_MODULES: Tuple[str, ...] = (
    "megatron.core.utils",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.mlp",
    # baseline --num-experts: the router's and dispatchers' device='cuda' tensors, the alltoall dispatcher's
    # class-level torch.cuda.Stream(), the aux-loss tracker's reductions
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_logging",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)

# megatron.training (Megatron-LM's trainer, shipped in the megatron-core 0.19.2 wheel): ~90 uses of
# torch.cuda / device='cuda' (first: training.py:1131, the start-time all_reduce). training_module_torch.
TRAINING_MODULES: Tuple[str, ...] = (
    "megatron.training.arguments",
    "megatron.training.checkpointing",
    "megatron.training.dist_signal_handler",
    "megatron.training.ft_integration",
    "megatron.training.initialize",
    "megatron.training.inprocess_restart",
    "megatron.training.training",
    "megatron.training.utils.common_utils",
    "megatron.training.utils.utils",
    "megatron.training.models.dist_utils",
    "megatron.training.datasets.data_samplers",
)

CORE = ">=0.16,<0.20"  # Megatron-Core code verified with 0.16.1 and 0.19.2
V019 = ">=0.19,<0.20"  # megatron.training / distrib_optimizer code of the 0.19.2 wheel

REGISTRY: Tuple[Patch, ...] = (
    # ---------------------------------------------------------------- Megatron-Core on CPU + gloo
    Patch("current_device", ("torch.cuda.current_device",),
          "Megatron-Core uses torch.cuda.current_device() as a device in ~40 places: RuntimeError without CUDA",
          CORE, CPU_ONLY, _apply("cpu", "patch_current_device")),
    Patch("synchronize", ("torch.cuda.synchronize",),
          "torch.cuda.synchronize() after batched p2p, in the timers and DDP: RuntimeError without CUDA",
          CORE, CPU_ONLY, _apply("cpu", "patch_synchronize")),
    Patch("tensor_cuda", ("torch.Tensor.cuda",),
          "the tied embedding with PP > 1 is moved with weight.data.cuda() (LanguageModule): fails without CUDA",
          CORE, CPU_ONLY, _apply("cpu", "patch_tensor_cuda")),
    Patch("module_torch", tuple(f"{m}.torch" for m in PATCHED_MODULES),
          "device='cuda' tensors and torch.cuda.* calls in the schedules, optimizers, DDP buffers, timers, "
          "checkpoint exchange: fail without CUDA",
          CORE, CPU_ONLY, _apply("cpu", "patch_module_torch")),
    Patch("rng", ("megatron.core.tensor_parallel.random._get_cuda_rng_state",
                  "megatron.core.tensor_parallel.random._set_cuda_rng_state",
                  "megatron.core.tensor_parallel.random.torch"),
          "model_parallel_cuda_manual_seed, CudaRNGStatesTracker and CheckpointFunction need the CUDA generator "
          "(TP dropout, recompute); its logger's 'CPU RNG state changed within GPU RNG context' is expected on CPU",
          CORE, CPU_ONLY, _apply("cpu", "patch_rng")),
    Patch("clip_grads", ("megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
                         "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32"),
          "clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor': AssertionError on CPU",
          CORE, CPU_ONLY, _apply("cpu", "patch_clip_grads")),
    Patch("tensor_type_checks", ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
                                 "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
                                 "._build_model_and_main_param_groups",
                                 "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__"),
          "the distributed and fp16/bf16 optimizers sort parameters by Tensor.type() == 'torch.cuda.*': CPU "
          "parameters are refused as of an unsupported type",
          CORE, CPU_ONLY, _apply("cpu", "patch_tensor_type_checks")),
    Patch("checkpoint_without_output_fp8", ("megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__",),
          "CheckpointWithoutOutput sets self.fp8 = fp8 is not None, True for its default fp8=False (random.py:740), "
          "so --recompute-modules layernorm asks TE's FP8GlobalStateManager: NameError without Transformer Engine",
          V019, CPU_ONLY, _apply("cpu", "patch_checkpoint_without_output_fp8")),
    # ---------------------------------------------------------------- megatron.training on CPU + gloo
    Patch("training_module_torch", tuple(f"{m}.torch" for m in TRAINING_MODULES),
          "~90 torch.cuda.* calls and device='cuda' tensors in megatron.training (first training.py:1131, the "
          "start-time all_reduce): fail without CUDA",
          V019, CPU_ONLY, _apply("cpu", "patch_training_module_torch")),
    Patch("initialize_allow_no_cuda", ("megatron.training.initialize.initialize_megatron",
                                       "megatron.training.training.initialize_megatron"),
          "initialize_megatron asserts CUDA unless allow_no_cuda=True, which pretrain() does not pass "
          "(initialize.py:66): 'Megatron requires CUDA'",
          V019, CPU_ONLY, _apply("cpu", "patch_initialize_allow_no_cuda")),
    Patch("initialize_model_parallel", ("megatron.training.initialize.torch",
                                        "megatron.training.initialize.initialize_megatron"),
          "with torch.cuda.device_count() == 0 initialize_megatron silently skips initialize_model_parallel and the "
          "TP RNG seeding (initialize.py:306, :447)",
          V019, CPU_ONLY, _apply("cpu", "patch_initialize_model_parallel")),
    Patch("compile_helpers", ("megatron.core.datasets.utils.compile_helpers",),
          "_compile_dependencies runs `make` in site-packages for dataset helpers the wheel ships prebuilt "
          "(initialize.py:177): fails without a compiler or a writable site-packages",
          V019, CPU_ONLY, _apply("cpu", "patch_compile_helpers")),
    Patch("device_arch_version", ("megatron.training.arguments.get_device_arch_version",
                                  "megatron.training.utils.common_utils.get_device_arch_version"),
          "with TP > 1 validate_args asks the GPU for its architecture (arguments.py:1414): fails without CUDA",
          V019, CPU_ONLY, _apply("cpu", "patch_device_arch_version")),
    Patch("loader_generator", ("megatron.training.datasets.data_samplers.build_pretraining_data_loader",
                               "megatron.training.training.build_pretraining_data_loader"),
          "on CPU dropout's generator is the default one, from which each DataLoader iterator draws a seed: a "
          "resumed run's dropout masks differ from the uninterrupted run's",
          V019, CPU_ONLY, _apply("cpu", "patch_loader_generator")),
    Patch("moe_splits_to_host", ("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",),
          "the alltoall MoE dispatcher makes its split sizes numpy arrays only when they are on CUDA (moe_utils.py:"
          "1184): on CPU all_to_all_single gets tensors, a TypeError",
          CORE, CPU_ONLY, _apply("cpu", "patch_moe_splits_to_host")),
    Patch("moe_uneven_gather", ("megatron.core.tensor_parallel.mappings._gather_along_first_dim",),
          "with TP > 1 the alltoall MoE dispatcher gathers each tensor-parallel rank's tokens with output_split_sizes "
          "(token_dispatcher.py:739, mappings.py:153), an all_gather of tensors of different sizes, which gloo "
          "refuses: 'ProcessGroupGloo::allgather: invalid tensor size'",
          CORE, CPU_ONLY, _apply("cpu", "patch_moe_uneven_gather")),
    # ---------------------------------------------------------------- distributed optimizer over torch Adam
    Patch("distopt_fresh_state_dict", ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict",),
          "state_dict of an optimizer that has not stepped (a resume's load, --train-iters 0 --save) asserts one "
          "Adam step value (distrib_optimizer.py:839): AssertionError",
          V019, EVERY_DEVICE, _apply("distopt", "fix_distopt_fresh_state_dict")),
    Patch("distopt_step_per_param",
          ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict",),
          "load_state_dict gives every parameter one shared Adam step tensor holding a dummy 0 "
          "(distrib_optimizer.py:1026-1032, :1225): a resumed run's loss drifts from its second iteration",
          V019, EVERY_DEVICE, _apply("distopt", "fix_distopt_step_per_param")),
    Patch("distopt_load_no_grad",
          tuple(f"megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.{m}" for m in (
              "load_parameter_state_from_dp_reshardable", "load_parameter_state_from_dp_zero",
              "load_parameter_state_from_dp_zero_legacy")),
          "the dp_reshardable / dp_zero loaders copy_() into views of leaf parameters with autograd on "
          "(distrib_optimizer.py:1225): 'a view of a leaf Variable that requires grad ... in-place operation'",
          V019, EVERY_DEVICE, _apply("distopt", "fix_distopt_load_no_grad")),
    Patch("distopt_missing_state_key",
          ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",),
          "the fully_reshardable loader (--dist-ckpt-optim-fully-reshardable) leaves Adam's step out of the "
          "tensors it sets (distrib_optimizer.py:1223): KeyError: 'step' on resume",
          V019, EVERY_DEVICE, _apply("distopt", "fix_distopt_missing_state_key")),
    # ---------------------------------------------------------------- checkpoint writer processes
    Patch("ckpt_writer_manager_exits_with_rank",
          ("megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue",),
          "the torch_dist writer's results queue lives in a multiprocessing Manager (filesystem_async.py:53-66) "
          "that outlives a SIGKILLed rank: the Manager (~600 MB) and its resource tracker are reparented to "
          "init at every torchrun --max-restarts restart",
          V019, EVERY_DEVICE, _apply("ckpt_writer", "fix_results_queue_manager")),
    # ---------------------------------------------------------------- optimizer checkpoints across expert parallelism
    Patch("expert_parallel_optimizer_reshard",
          ("megatron.core.optimizer.optimizer.ChainedOptimizer.load_state_dict",),
          "a checkpoint saved with expert parallelism holds two chained optimizers (dense, expert) and a run without "
          "it builds one, which is handed both entries (optimizer.py:1574): KeyError: 'optimizer' when an EP > 1 "
          "checkpoint resumes under EP1",
          V019, EVERY_DEVICE, _apply("distopt", "fix_expert_parallel_optimizer_reshard")),
    # ---------------------------------------------------------------- made elsewhere (pointers)
    Patch("p2p_shape_exchange", ("megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator"
                                 "._communicate_shapes",),
          "Megatron-LM #1450: with PP=2 + VPP prev and next peer are one rank and the batched shape exchange "
          "pairs send-prev with recv-prev: the shapes swap (routed payloads send shapes, variable_seq_lengths)",
          CORE, EVERY_DEVICE,
          made_by="subclass PayloadP2PCommunicator, megatron_delta/core/payload.py; passed to the schedules by "
                  "schedule_communication_kwargs; shapes travel only where a rank holds several chunks "
                  "(payload_shapes_travel)"),
    Patch("vpp_pp2_batched_p2p", ("megatron.core.model_parallel_config.ModelParallelConfig.batch_p2p_comm",),
          "Megatron-LM #750: with PP=2 + VPP, batched p2p (the default) cannot tell send-next from send-prev to "
          "the one peer: training is silently wrong",
          CORE, EVERY_DEVICE,
          made_by="megatron_delta.platform.patches.batch_p2p_comm, the one decision (for "
                  "megatron_delta.checkpoint.model_config.model_config); "
                  "the trainer keeps upstream's (batch_p2p_comm = not overlap_p2p_comm, and validate_args refuses "
                  "PP=2 + VPP without overlap); check_p2p_config() refuses a config with the trap"),
    Patch("local_mla_core_attention", ("megatron.core.transformer.dot_product_attention.DotProductAttention",),
          "NVIDIA/Megatron-LM #1589 (PR #6564 open): the local MLA spec's DotProductAttention takes no k_channels / "
          "v_channels, which MLASelfAttention passes: TypeError when a --transformer-impl local MLA model is built",
          V019, EVERY_DEVICE,
          made_by="subclass MLADotProductAttention, megatron_delta/core/mla.py; the local MLA layer specs of "
                  "megatron_delta/core/specs.py use it"),
    Patch("local_mla_tp_gradients",
          ("megatron.core.transformer.multi_latent_attention.MLASelfAttention._qkv_down_projection",
           "megatron.core.distributed.finalize_model_grads._allreduce_non_tensor_model_parallel_grads (q_layernorm)"),
          "the local MLA spec under TP > 1 (no upstream issue found): k_pe's gradient keeps only this rank's heads "
          "(gathered ColumnParallelLinear output, split in backward), and without SP the replicated q_layernorm's "
          "gradient is summed over the TP ranks: TP2 training drifts from TP1 (1e-4 in loss after 3 steps)",
          V019, EVERY_DEVICE,
          made_by="subclass LocalMLASelfAttention, megatron_delta/core/mla.py; the local MLA layer specs of "
                  "megatron_delta/core/specs.py use it"),
    Patch("delta_config_classes", ("megatron.core.transformer.MLATransformerConfig",
                                   "megatron.core.transformer.heterogeneous.heterogeneous_config."
                                   "HeterogeneousTransformerConfig"),
          "core_transformer_config_from_args (argument_utils.py) builds the MLATransformerConfig / "
          "HeterogeneousTransformerConfig it imports for --multi-latent-attention / "
          "--heterogeneous-layers-config-path, whatever config_class it is given: no delta_* fields, so no "
          "--residual with either flag",
          V019, EVERY_DEVICE,
          made_by="megatron_delta/trainer/provider.py delta_config_classes: DeltaMLATransformerConfig and "
                  "DeltaHeterogeneousTransformerConfig in their places for the one call of transformer_config, the "
                  "originals back after it"),
    Patch("trainer_hooks",
          tuple(f"megatron.training.training.{f}" for f in (
              "get_megatron_optimizer_config", "setup_model_and_optimizer", "load_checkpoint", "train",
              "training_log", "evaluate", "evaluate_and_print_results", "save_checkpoint"))
          + ("megatron.training.checkpointing.save_checkpoint",
             "megatron.training.checkpointing.get_checkpoint_tracker_filename"),
          "upstream's pretrain() has no hook for the routers' param group (--delta-router-lr-mult), "
          "--delta-metrics-file, --delta-heldout-data-path and routing statistics, run_config.json in each checkpoint, "
          "the iteration-0 save, the lock of --save (two runs overwrite each other's checkpoints), the line of a "
          "--load that starts from scratch, the load of a checkpoint without integrity.json, run_config.json "
          "verified before it is read, a NaN / inf state saved and the tracker moved to it, a Ctrl-C midway "
          "through a save",
          V019, EVERY_DEVICE,
          made_by="megatron_delta/trainer/hooks.py RunHooks: each function wrapped for one run "
                  "(with RunHooks(args)), the originals back when it ends"),
    Patch("checkpoint_hint", ("megatron.training.checkpointing.load_checkpoint (RuntimeError text)",),
          "a distributed-optimizer checkpoint loaded into another TP/PP layout raises a hint naming "
          "--ckpt-fully-parallel-save, which does not choose a loadable format (checkpointing.py:2251)",
          V019, EVERY_DEVICE,
          made_by="megatron_delta/trainer/main.py run_error_message: the hint names "
                  "--dist-ckpt-optim-fully-reshardable or --no-load-optim instead"),
    Patch("verify_integrity_default", ("megatron.training.arguments._add_checkpointing_args (--verify-integrity)",),
          "--verify-integrity defaults to off: flipped bytes in a .distcp shard load silently and training goes on "
          "from damaged weights or optimizer state",
          V019, EVERY_DEVICE,
          made_by="megatron_delta/trainer/arguments.py add_delta_args: --no-verify-integrity, default None; "
                  "megatron_delta/checkpoint/integrity.py resolve_default: on for --ckpt-format torch_dist"),
    Patch("model_parallel_release",
          ("megatron.core.parallel_state.destroy_model_parallel",
           "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.grad_accs",
           "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward"),
          "a second layout or run in one process keeps the first's groups and gloo threads: destroy_model_parallel "
          "leaves every group registered (and two globals set), DDP's grad-accumulator hooks make a cycle through "
          "C++ that gc cannot free, the rotary lru_cache keeps finished models; ~60 threads per rebuild, thousands "
          "per test launch",
          CORE, EVERY_DEVICE,
          made_by="megatron_delta/platform/distributed.py release_model_parallel (before each rebuild of the "
                  "groups, and by megatron_delta/trainer/main.py reset_global_state after each run)"),
)

_BY_NAME: Dict[str, Patch] = {p.name: p for p in REGISTRY}
if len(_BY_NAME) != len(REGISTRY):
    raise RuntimeError("megatron_delta.platform.patches: two entries share a name")
_APPLIED: List[str] = []
_REPORTED: set = set()


def megatron_core_version() -> str:
    """The installed megatron-core version (its package metadata, else megatron.core.__version__)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        import megatron.core

        return str(megatron.core.__version__)


def applies(patch: Patch, version: Optional[str] = None, cuda: Optional[bool] = None) -> Tuple[bool, str]:
    """(whether ``patch`` applies, why not) for megatron-core ``version`` (default: installed) and a process
    with or without CUDA (default: this one)."""
    version = megatron_core_version() if version is None else version
    if not _specifier(patch.versions).contains(version, prereleases=True):
        return False, f"megatron-core {version} is outside {patch.versions}"
    if patch.where == CPU_ONLY:
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        if cuda:
            return False, "CUDA is available (CPU only)"
    return True, ""


def apply_patches(where: str, version: Optional[str] = None) -> List[str]:
    """Install the entries of ``where`` (CPU_ONLY or EVERY_DEVICE) that apply to megatron-core ``version``
    (default: the installed one; the tests pass others). Idempotent; returns the names installed by this call.
    An entry outside its versions is skipped with a warning on this module's logger."""
    from megatron_delta.platform.patches.install import installing

    if where not in (CPU_ONLY, EVERY_DEVICE):
        raise ValueError(f"where must be {CPU_ONLY!r} or {EVERY_DEVICE!r}, got {where!r}")
    done = []
    for patch in REGISTRY:
        if patch.where != where or patch.apply is None or patch.name in _APPLIED:
            continue
        ok, why = applies(patch, version, cuda=False)  # the caller decided on the device
        if not ok:
            if (patch.name, why) not in _REPORTED:  # once: activate_cpu_platform runs at every initialisation
                _REPORTED.add((patch.name, why))
                logger.warning("megatron_delta.platform.patches: %s not applied: %s", patch.name, why)
            continue
        with installing(patch.name):
            patch.apply()
        _APPLIED.append(patch.name)
        done.append(patch.name)
    return done


def entry(name: str) -> Patch:
    """The registry entry ``name``."""
    if name not in _BY_NAME:
        raise KeyError(f"no patch {name!r} in megatron_delta.platform.patches; entries: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def applied() -> List[str]:
    """The names installed in this process, in order."""
    return list(_APPLIED)


def describe(version: Optional[str] = None, cuda: Optional[bool] = None) -> List[str]:
    """One line per entry: name, where, versions, and its state here (applied / would apply / skipped and why /
    made where)."""
    lines = []
    for p in REGISTRY:
        ok, why = applies(p, version, cuda)
        if p.apply is None:
            state = f"made by {p.made_by.split(':')[0].split(';')[0].split(' (')[0]}" + ("" if ok else f" [{why}]")
        elif p.name in _APPLIED and version is None:
            state = "applied"
        else:
            state = "applies" if ok else f"skipped: {why}"
        lines.append(f"{p.name:27s} {p.where:12s} {p.versions:13s} {state}")
    return lines


@contextlib.contextmanager
def patches_suspended(*names: str):
    """The upstream originals of the named (installed) patches back while the block runs: the tests show
    with it the failure each patch answers."""
    from megatron_delta.platform.patches.install import suspended

    unknown = [n for n in names if n not in _BY_NAME or _BY_NAME[n].apply is None]
    if unknown:
        raise ValueError(f"unknown patches {sorted(unknown)}; installable: "
                         f"{sorted(p.name for p in REGISTRY if p.apply is not None)}")
    with suspended(names):
        yield


# ------------------------------------------------------------------------ vpp_pp2_batched_p2p (Megatron-LM #750)
def batch_p2p_comm(virtual_pipeline_model_parallel_size: Optional[int]) -> bool:
    """ModelParallelConfig.batch_p2p_comm for a model built from the project's flags: batched p2p except with
    virtual pipeline stages (Megatron-LM #750: with PP=2 both directions go to one peer and a batch cannot
    tell them apart; unbatched p2p orders them by rank parity)."""
    return virtual_pipeline_model_parallel_size is None


def check_p2p_config(config) -> None:
    """Raise on the silently wrong setting of Megatron-LM #750 (PP=2, VPP, batch_p2p_comm without
    overlap_p2p_comm). ``config``: a ModelParallelConfig / TransformerConfig; the model-parallel state must be
    initialised."""
    from megatron.core import parallel_state

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (vpp is not None and vpp > 1 and pp == 2 and getattr(config, "batch_p2p_comm", False)
            and not getattr(config, "overlap_p2p_comm", False)):
        raise ValueError(
            "virtual pipeline parallelism with --pipeline-model-parallel-size 2 needs "
            "batch_p2p_comm=False or overlap_p2p_comm=True (upstream Megatron-LM #750: "
            "with batched p2p, sends to the same peer get mixed and training is silently wrong)")


# ------------------------------------------------------------------------ known upstream warnings
@dataclasses.dataclass(frozen=True)
class KnownWarning:
    name: str
    category: type
    message: str  # regular expression matched at the start of the message
    why: str  # why it says nothing to a user of this project


KNOWN_WARNINGS: Tuple[KnownWarning, ...] = (
    KnownWarning("no_te_apex", UserWarning, r"\s*(Transformer Engine|Apex) (and Apex )?(is|are) not installed",
                 "Megatron-Core's import-time notice of its torch fall-backs; without TE/Apex (every CPU) they are "
                 "the intended path"),
    KnownWarning("model_config_recommended", UserWarning, r"\s*It is recommended to use a ModelConfig",
                 "pretrain_cfg_container_from_args without a ModelConfig: the trainer passes a model provider, as "
                 "upstream's own pretrain_gpt.py does"),
    KnownWarning("all_gather_into_tensor", FutureWarning,
                 r"`torch.distributed.all_gather_into_tensor` is deprecated",
                 "torch's deprecation of a call inside Megatron-Core (DDP / checkpointing), not the project's"),
    KnownWarning("sharded_tensor", FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
                 "torch.distributed.checkpoint's deprecation of the ShardedTensor Megatron-Core's dist_checkpointing "
                 "hands it, not the project's"),
    KnownWarning("no_pin_memory", UserWarning, r"'pin_memory' argument is set as true but no accelerator",
                 "megatron.training's data loader pins memory for the GPU; on CPU torch ignores it"),
)


# Upstream log records that print a traceback in front of the project's own line for the same failure, with the
# logger's file (path suffix) and the start of the message: dropped while known_warnings_quieted runs.
KNOWN_LOG_RECORDS: Tuple[Tuple[str, str, str], ...] = (
    ("torch/distributed/checkpoint/state_dict_loader.py", "Global metadata is not found",
     "torch's loader logs (on the root logger, with exc_info) a .metadata it cannot read, then fails: "
     "errors.describe_load_failure names the file in one line"),
    ("torch/distributed/checkpoint/state_dict_loader.py", "Rank local metadata is not found",
     "its fall-back to a per-rank __N.metadata that torch_dist checkpoints never have, logged the same way"),
)


class _KnownLogRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        path = str(record.pathname).replace("\\", "/")
        return not any(path.endswith(where) and str(record.msg).startswith(start)
                       for where, start, _ in KNOWN_LOG_RECORDS)


@contextlib.contextmanager
def known_warnings_quieted():
    """KNOWN_WARNINGS silenced while the block runs (``warnings.catch_warnings``: the filters are restored
    after it), and KNOWN_LOG_RECORDS dropped (a filter on the root logger, removed after it). Put it around the
    upstream calls that emit them (a tool: around its main, as a decorator ``@known_warnings_quieted()``); the
    filters match those messages only, never the project's warnings."""
    records = _KnownLogRecords()
    logging.getLogger().addFilter(records)
    try:
        with _warnings_quieted():
            yield
    finally:
        logging.getLogger().removeFilter(records)


@contextlib.contextmanager
def _warnings_quieted():
    theirs = []
    with warnings.catch_warnings():
        for w in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=w.message, category=w.category)
        quiet = list(warnings.filters)
        try:
            yield
        finally:
            # filters an upstream module set meanwhile (sympy's 'once', imported lazily by torch) are its own:
            # they outlive the block, as they would without it
            theirs = [f for f in warnings.filters if f not in quiet]
    if theirs:
        warnings.filters[:0] = [f for f in theirs if f not in warnings.filters]
        getattr(warnings, "_filters_mutated", lambda: None)()


# The Megatron modules whose import warns (no_te_apex): imported once, quietly, by import_megatron.
_NOISY_IMPORTS = ("megatron.core.optimizer", "megatron.core.models.gpt.gpt_layer_specs",
                  "megatron.core.distributed", "megatron.core.pipeline_parallel")


def import_megatron(training: bool = False) -> None:
    """Import Megatron-Core (and megatron.training with ``training``) with their import-time notices silenced;
    later imports of them are cache hits and print nothing. Call it before the first Megatron import."""
    with known_warnings_quieted():
        for name in _NOISY_IMPORTS + (("megatron.training.training",) if training else ()):
            importlib.import_module(name)
