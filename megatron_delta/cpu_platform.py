"""The adaptation of Megatron-Core (0.16.1; megatron.training and FIXES: 0.19.2) to CPU + gloo.

Everything that makes Megatron-Core's training path run without CUDA lives in this one module and
is applied by :func:`activate_cpu_platform`, which does nothing when CUDA is available.  Each patch
is one function below, with a comment naming the failure of /work/shared/NOTES-platform.md
("Megatron-Core on CPU with gloo: what breaks and the fix") that it fixes.

Besides the CPU patches (PATCHES), the registry holds FIXES: upstream bugs that are not CPU issues
(the distributed optimizer with torch's own Adam, i.e. without Apex / Transformer Engine, on any
device). :func:`apply_megatron_fixes` applies them on every device, for the Megatron-Core versions in
FIX_VERSIONS; :func:`activate_cpu_platform` calls it first, also when CUDA is available.

Public API
----------
activate_cpu_platform() -> bool   idempotent; applies FIXES; False (and no CPU patching) with CUDA
apply_megatron_fixes() -> list    idempotent; the FIXES applied (any device)
is_cpu_platform() -> bool          True once the CPU adaptation is active
initialize_distributed(...)        torch.distributed (gloo on CPU / nccl on GPU) + Megatron model
                                   parallel groups + model-parallel RNG seeding
destroy_distributed()
set_cpu_allocator(choice) -> str   "cache": glibc keeps freed memory, as the CUDA caching allocator

Caveat (NOTES "Traps"): virtual pipeline parallelism with PP=2 and ``batch_p2p_comm=True`` (the
Megatron default) is silently wrong; use ``batch_p2p_comm=False`` or ``overlap_p2p_comm=True``
with VPP.  :func:`initialize_distributed` cannot enforce this (it lives in the ModelParallelConfig),
see :func:`check_p2p_config`.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import logging
import os
import random
import socket
import types
from typing import Callable, Dict, List, Optional

import torch

__all__ = [
    "activate_cpu_platform",
    "is_cpu_platform",
    "initialize_distributed",
    "destroy_distributed",
    "check_p2p_config",
    "patches_suspended",
    "PATCHES",
    "free_port",
    "PATCHED_MODULES",
    "CPU_ALLOCATOR_CHOICES",
    "set_cpu_allocator",
    "FIXES",
    "FIX_VERSIONS",
    "apply_megatron_fixes",
]

_ACTIVE = False
_CPU = torch.device("cpu")
_MISSING = object()
# What each patch replaced: patch name -> [(owner, attribute, original or _MISSING)], so that
# patches_suspended() can show, in the tests, that each patch is needed.
_APPLIED: Dict[str, list] = {}
# Currently installed patched values (patch name -> [(owner, attribute, value)]).
_INSTALLED: Dict[str, list] = {}
_CURRENT_PATCH: List[str] = []

# Megatron-Core modules on the training path (model build, forward/backward schedules, p2p, DDP,
# optimizers, grad clipping, RNG, timers, checkpointing exchange) that hard-code CUDA through their
# module-level name ``torch``.  They get the proxy of patch 4.
PATCHED_MODULES: List[str] = [
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
]

# megatron.training (Megatron-LM's trainer, shipped in the megatron-core 0.19.2 wheel): ~90 uses of
# torch.cuda / device='cuda' (first: training.py:1131, the start-time all_reduce). Patch 8.
TRAINING_MODULES: List[str] = [
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
]


def is_cpu_platform() -> bool:
    """True once :func:`activate_cpu_platform` has adapted Megatron-Core to CPU."""
    return _ACTIVE


def _set(owner, attr: str, value) -> None:
    """setattr recording the original for the patch being applied."""
    patch = _CURRENT_PATCH[-1]
    original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(
        owner, attr, _MISSING
    )
    _APPLIED.setdefault(patch, []).append((owner, attr, original))
    _INSTALLED.setdefault(patch, []).append((owner, attr, value))
    setattr(owner, attr, value)


def _restore(owner, attr: str, original) -> None:
    if original is _MISSING:
        if attr in getattr(owner, "__dict__", {}):
            delattr(owner, attr)
    else:
        setattr(owner, attr, original)


@contextlib.contextmanager
def patches_suspended(*names: str):
    """Temporarily undo the named patches (testing aid: shows the upstream failure)."""
    known = set(PATCHES) | set(FIXES)
    unknown = set(names) - known
    if unknown:
        raise ValueError(f"unknown patches {sorted(unknown)}; known: {sorted(known)}")
    for name in names:
        for owner, attr, original in reversed(_APPLIED.get(name, [])):
            _restore(owner, attr, original)
    try:
        yield
    finally:
        for name in names:
            for owner, attr, value in _INSTALLED.get(name, []):
                setattr(owner, attr, value)


# --------------------------------------------------------------------------------------------
# Device helpers shared by the patches
# --------------------------------------------------------------------------------------------
def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # torch reads a bare int device as cuda:<int>
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs["device"] = _CPU
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False  # pinning needs a CUDA build
    return kwargs


class _NullStream:
    """Stand-in for torch.cuda.Stream / Event on CPU: everything is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, *args, **kwargs):
        return 0.0


class _NullNvtx:
    """torch.cuda.nvtx without CUDA: markers are dropped."""

    @staticmethod
    def range_push(*args, **kwargs):
        return 0

    @staticmethod
    def range_pop(*args, **kwargs):
        return 0

    @staticmethod
    def mark(*args, **kwargs):
        pass

    @staticmethod
    def range(*args, **kwargs):
        return contextlib.nullcontext()


class _CudaProxy(types.ModuleType):
    """What patched Megatron modules see as ``torch.cuda`` on CPU (patches 4 and 5).

    ``current_device`` and ``synchronize`` are not overridden here: they fall through to the real
    torch.cuda, which patches 1 and 2 fix for every caller.
    """

    def __init__(self):
        super().__init__("torch.cuda")
        self.__dict__.update(
            empty_cache=lambda: None,
            # RNG: the "CUDA" generator is the CPU generator (patch 5).
            get_rng_state=lambda *a, **k: torch.get_rng_state(),
            set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
            manual_seed=lambda seed: torch.manual_seed(seed),
            manual_seed_all=lambda seed: torch.manual_seed(seed),
            # Legacy typed tensors -> their CPU classes.
            FloatTensor=torch.FloatTensor,
            HalfTensor=torch.HalfTensor,
            BFloat16Tensor=torch.BFloat16Tensor,
            DoubleTensor=torch.DoubleTensor,
            IntTensor=torch.IntTensor,
            LongTensor=torch.LongTensor,
            ByteTensor=torch.ByteTensor,
            BoolTensor=torch.BoolTensor,
            # Streams / events / nvtx / memory stats: synchronous no-ops.
            Stream=_NullStream,
            Event=_NullStream,
            stream=lambda *a, **k: contextlib.nullcontext(),
            current_stream=lambda *a, **k: _NullStream(),
            default_stream=lambda *a, **k: _NullStream(),
            nvtx=_NullNvtx(),
            memory_allocated=lambda *a, **k: 0,
            max_memory_allocated=lambda *a, **k: 0,
            memory_reserved=lambda *a, **k: 0,
            max_memory_reserved=lambda *a, **k: 0,
            reset_peak_memory_stats=lambda *a, **k: None,
            memory_stats=lambda *a, **k: {},
            device_count=lambda: 0,
        )

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "zeros_like", "ones_like",
    "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "empty_strided",
    "tril_indices", "triu_indices", "normal", "frombuffer",
)


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        return fn(*args, **_cpu_kwargs(kwargs))

    return factory


class _TorchProxy(types.ModuleType):
    """What patched Megatron modules see as ``torch`` on CPU (patch 4).

    Only the tensor factory functions (device="cuda" -> cpu), ``torch.cuda`` and
    ``torch.autocast("cuda")`` differ from the real torch; every other attribute is the real one.
    A TorchFunctionMode cannot do this: it is inactive inside autograd backward (NOTES).
    """

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            if hasattr(torch, name):
                self.__dict__[name] = _cpu_factory(getattr(torch, name))
        self.__dict__["cuda"] = _CudaProxy()
        self.__dict__["autocast"] = self._autocast

    @staticmethod
    def _autocast(device_type="cuda", *args, **kwargs):
        if device_type == "cuda":
            device_type = "cpu"
        return torch.autocast(device_type, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_PROXY: Optional[_TorchProxy] = None


def _torch_proxy() -> _TorchProxy:
    global _TORCH_PROXY
    if _TORCH_PROXY is None:
        _TORCH_PROXY = _TorchProxy()
    return _TORCH_PROXY


# --------------------------------------------------------------------------------------------
# The patches (one function each)
# --------------------------------------------------------------------------------------------
# NOTES failure 1: torch.cuda.current_device() is used as a device in ~40 places -> CPU device.
def _patch_current_device() -> None:
    _set(torch.cuda, "current_device", lambda: _CPU)


# NOTES failure 2: torch.cuda.synchronize() after batched p2p (and in timers/DDP) -> no-op.
def _patch_synchronize() -> None:
    _set(torch.cuda, "synchronize", lambda device=None: None)


# NOTES failure 3: weight.data.cuda() for tied embeddings with PP > 1 -> Tensor.cuda is identity.
def _patch_tensor_cuda() -> None:
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    _set(torch.Tensor, "cuda", cuda)


# NOTES failure 4: hard-coded device="cuda" / torch.cuda.* in schedules, optimizer, clip_grads,
# param_and_grad_buffer, ... -> those modules see a torch proxy mapping cuda devices to cpu.
def _patch_module_torch() -> None:
    proxy = _torch_proxy()
    for name in PATCHED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module missing in another Megatron-Core version
            continue
        if getattr(module, "torch", None) is torch:
            _set(module, "torch", proxy)


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    """CPU version of megatron's ``_get_cuda_rng_state``."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe: bool = False):
    """CPU version of megatron's ``_set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


class _ExpectedCpuRngChange(logging.Filter):
    """On CPU the tracker forks the CPU generator itself, so its 'CPU RNG state changed within
    GPU RNG context' warning is expected on every forked dropout: drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


# NOTES failure 5: model_parallel_cuda_manual_seed / CudaRNGStatesTracker / CheckpointFunction use
# the CUDA RNG -> the tracker forks the CPU generator (tensor-parallel dropout, recompute).
def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    _set(mp_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _set(mp_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    # torch.cuda.get_rng_state / set_rng_state / manual_seed of the module -> the CPU generator
    if getattr(mp_random, "torch", None) is torch:
        _set(mp_random, "torch", _torch_proxy())
    logger = logging.getLogger(mp_random.__name__)
    if not any(isinstance(f, _ExpectedCpuRngChange) for f in logger.filters):
        logger.addFilter(_ExpectedCpuRngChange())


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's clip_grad_by_total_norm_fp32 with the CUDA-type assert made device-agnostic."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        if use_decoupled_grad:
            grad = getattr(param, "decoupled_grad", None)
            if grad is not None:
                assert grad.dtype in (torch.float32, torch.bfloat16)
                grads.append(to_local_if_dtensor(grad).detach())
        elif param.grad is not None:
            assert param.grad.dtype == torch.float32, param.grad.type()
            grads.append(to_local_if_dtensor(param.grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


# NOTES failure 6: clip_grads asserts param.grad.type() == 'torch.cuda.FloatTensor' -> CPU path.
def _patch_clip_grads() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        fn = getattr(module, "clip_grad_by_total_norm_fp32", None)
        if fn is not None and fn is not _clip_grad_by_total_norm_fp32_cpu:
            _set(module, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu)


_TYPE_NAMES_DEPTH = 0
_TYPE_IN_TENSOR_DICT = "type" in torch.Tensor.__dict__
_ORIGINAL_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    original = _ORIGINAL_TENSOR_TYPE
    if dtype is None and not kwargs:
        name = original(self)
        if name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name
    return original(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_names():
    """While active, ``tensor.type()`` names CPU tensors like CUDA ones ('torch.cuda.FloatTensor')."""
    global _TYPE_NAMES_DEPTH
    if _TYPE_NAMES_DEPTH == 0:
        torch.Tensor.type = _cuda_type_name
    _TYPE_NAMES_DEPTH += 1
    try:
        yield
    finally:
        _TYPE_NAMES_DEPTH -= 1
        if _TYPE_NAMES_DEPTH == 0:
            if _TYPE_IN_TENSOR_DICT:
                torch.Tensor.type = _ORIGINAL_TENSOR_TYPE
            else:
                del torch.Tensor.type  # back to torch._C.TensorBase.type


def _with_cuda_type_names(fn: Callable) -> Callable:
    if getattr(fn, "_cpu_platform_wrapped", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper._cpu_platform_wrapped = True
    return wrapper


# NOTES failure 7: DistributedOptimizer and the bf16/fp16 optimizer sort params by comparing
# Tensor.type() with 'torch.cuda.*' names -> during their constructors CPU tensors report those.
def _patch_tensor_type_checks() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (DistributedOptimizer, Float16OptimizerWithFloat16Params):
        _set(cls, "__init__", _with_cuda_type_names(cls.__dict__["__init__"]))
    raw = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    if isinstance(raw, (classmethod, staticmethod)):
        _set(
            DistributedOptimizer,
            "_build_model_and_main_param_groups",
            type(raw)(_with_cuda_type_names(raw.__func__)),
        )


# --------------------------------------------------------------------------------------------
# megatron.training 0.19.2 (Megatron-LM's trainer inside the megatron-core 0.19.2 wheel)
# --------------------------------------------------------------------------------------------
def _patch_proxy_into(modules: List[str], proxy) -> None:
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # another version, or an optional dependency missing
            continue
        if getattr(module, "torch", None) is torch:
            _set(module, "torch", proxy)


# megatron.training failure 8 (0.19.2; training.py:1131 first of ~90): torch.cuda.* and device='cuda'
# throughout the trainer -> its modules see the torch proxy of patch 4 as well.
def _patch_training_module_torch() -> None:
    _patch_proxy_into(TRAINING_MODULES, _torch_proxy())


# megatron.training failure 9 (0.19.2; initialize.py:66): initialize_megatron asserts CUDA unless
# allow_no_cuda=True, which pretrain() does not pass -> on CPU it is passed.
def _patch_initialize_allow_no_cuda() -> None:
    from megatron.training import initialize, training

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    for module in (initialize, training):
        if getattr(module, "initialize_megatron", None) is original:
            _set(module, "initialize_megatron", initialize_megatron)


class _OneDeviceCuda(_CudaProxy):
    """torch.cuda for megatron.training.initialize: the CPU counts as one device; set_device is a no-op."""

    def __init__(self):
        super().__init__()
        self.__dict__.update(device_count=lambda: 1, set_device=lambda *a, **k: None)


class _OneDeviceTorch(_TorchProxy):
    def __init__(self):
        super().__init__()
        self.__dict__["cuda"] = _OneDeviceCuda()


def _check_model_parallel_initialized(skip_mpu_initialization=False, skip_model_parallel_init=False,
                                      lazy=False, skip_random_seed=False):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if skip_mpu_initialization or lazy:
        return
    if not skip_model_parallel_init and not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("initialize_megatron left the model-parallel state uninitialised "
                           "(megatron/training/initialize.py:306 skips it when torch.cuda.device_count() == 0)")
    tracker = mp_random.get_cuda_rng_tracker()
    if not skip_random_seed and mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.get_states():
        raise RuntimeError("initialize_megatron did not seed the model-parallel RNG tracker "
                           "(megatron/training/initialize.py:447 skips it when torch.cuda.device_count() == 0)")


# megatron.training failure 10 (0.19.2; initialize.py:270/306 and :447): with
# torch.cuda.device_count() == 0, _initialize_distributed SILENTLY skips initialize_model_parallel and
# _set_random_seed skips seeding the tensor-parallel RNG tracker -> in initialize.py the CPU counts as
# one device (set_device a no-op), and initialize_megatron checks that both exist afterwards.
def _patch_initialize_model_parallel() -> None:
    from megatron.training import initialize, training

    _set(initialize, "torch", _OneDeviceTorch())
    inner = getattr(training, "initialize_megatron")  # patch 9's wrapper (or the original)
    original = initialize.initialize_megatron

    def checked(fn):
        @functools.wraps(fn)
        def initialize_megatron(*args, **kwargs):
            out = fn(*args, **kwargs)
            from megatron.training import get_args

            _check_model_parallel_initialized(
                kwargs.get("skip_mpu_initialization", False), kwargs.get("skip_model_parallel_init", False),
                lazy=getattr(get_args(), "lazy_mpu_init", False), skip_random_seed=kwargs.get("skip_random_seed", False))
            return out

        return initialize_megatron

    _set(initialize, "initialize_megatron", checked(original))
    _set(training, "initialize_megatron", checked(inner))


def _prebuilt_helpers_available() -> bool:
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


# megatron.training failure 11 (0.19.2; initialize.py:177 -> core/datasets/utils.py:25):
# _compile_dependencies runs `make` in site-packages for the dataset helpers; the wheel ships them
# prebuilt (helpers_cpp.*.so) -> compile only when the prebuilt module does not import.
def _patch_compile_helpers() -> None:
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers

    @functools.wraps(original)
    def compile_helpers():
        if not _prebuilt_helpers_available():
            original()

    _set(dataset_utils, "compile_helpers", compile_helpers)


# megatron.training failure 12 (0.19.2; arguments.py:1414 -> utils/common_utils.py:504): with TP > 1
# validate_args asks the GPU for its architecture (torch.cuda.get_device_properties('cuda:0')), to
# require CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell -> the CPU has no CUDA connection limit:
# reported as 10 (Blackwell and later, where upstream no longer requires it).
def _patch_device_arch_version() -> None:
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    cpu_arch = lambda: 10  # noqa: E731
    for module in (arguments, common_utils):
        if hasattr(module, "get_device_arch_version"):
            _set(module, "get_device_arch_version", cpu_arch)
    utils_pkg = importlib.import_module("megatron.training.utils")
    if hasattr(utils_pkg, "get_device_arch_version"):
        _set(utils_pkg, "get_device_arch_version", cpu_arch)


# megatron.training failure 13 (0.19.2; datasets/data_samplers.py:19 via training.py:4569): on CPU the
# "CUDA" RNG (dropout) is the default CPU generator, from which torch's DataLoader also draws a seed
# whenever an iterator starts. A resumed run starts its loaders after loading the RNG state, so from
# there on its dropout masks differ from the uninterrupted run's -> each loader gets its own generator.
def _patch_loader_generator() -> None:
    from megatron.training import training
    from megatron.training.datasets import data_samplers

    original = data_samplers.build_pretraining_data_loader

    @functools.wraps(original)
    def build_pretraining_data_loader(dataset, consumed_samples):
        loader = original(dataset, consumed_samples)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(consumed_samples)
        return loader

    for module in (data_samplers, training):
        if getattr(module, "build_pretraining_data_loader", None) is original:
            _set(module, "build_pretraining_data_loader", build_pretraining_data_loader)


# --------------------------------------------------------------------------------------------
# Upstream bugs that are not CPU issues: the distributed optimizer with torch's own Adam
# --------------------------------------------------------------------------------------------
# Without Apex and Transformer Engine (megatron.core.optimizer.distrib_optimizer.HAVE_APEX_OR_TE is
# False: any CPU, and GPUs without them), the DistributedOptimizer wraps torch.optim.Adam, whose
# per-parameter state holds its own 0-dim ``step`` tensor. distrib_optimizer.py (0.19.2) mishandles
# that tensor in four places, fixed by the four patches below. They are applied on every device
# (:func:`apply_megatron_fixes`), to the Megatron-Core versions in FIX_VERSIONS (the code verified:
# 0.19.2); each does nothing when the optimizer is Apex's / TE's fused Adam (HAVE_APEX_OR_TE).
FIX_VERSIONS = ((0, 19),)  # (major, minor) of megatron-core the fixes below are written against


def _torch_adam_without_fused(opt) -> bool:
    from megatron.core.optimizer import distrib_optimizer

    inner = getattr(opt, "optimizer", None)
    return not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Adam)


def _init_adam_state(adam: torch.optim.Adam) -> None:
    """The state torch.optim.Adam's first step gives a parameter (Adam._init_group): step 0, zero moments."""
    for group in adam.param_groups:
        for p in group["params"]:
            state = adam.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# Megatron-Core fix 1 (0.19.2; core/optimizer/distrib_optimizer.py:839): DistributedOptimizer.state_dict
# asserts that the torch Adam states hold exactly one step value; a fresh optimizer (a resume's
# sharded_state_dict(is_loading=True), or `--train-iters 0 --save` with --use-distributed-optimizer)
# holds none -> AssertionError. -> state_dict first gives the parameters without state the state
# torch's first Adam step would (step 0, zero moments: the same optimizer).
def _fix_distopt_fresh_state_dict() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["state_dict"]

    @functools.wraps(original)
    def state_dict(self):
        if _torch_adam_without_fused(self):
            _init_adam_state(self.optimizer)
        return original(self)

    _set(DistributedOptimizer, "state_dict", state_dict)


# Megatron-Core fix 2 (0.19.2; core/optimizer/distrib_optimizer.py:1026-1032 and :1225):
# DistributedOptimizer.load_state_dict gives every parameter ONE shared step tensor (torch Adam then
# adds 1 per parameter per iteration to it: wrong bias correction), and load_parameter_state_from_*
# then copies into it the dummy step captured when the load's sharded state dict was built (0): a
# resumed run restarts Adam at step 0 instead of the saved step, its loss drifts from the second
# resumed iteration on. -> after load_state_dict, each parameter gets its own step tensor holding the
# checkpoint's step (its param_groups' "step", which state_dict wrote).
def _fix_distopt_step_per_param() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["load_state_dict"]

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        if _torch_adam_without_fused(self) and isinstance(state_dict.get("optimizer"), dict):
            steps = {g["step"] for g in state_dict["optimizer"].get("param_groups", []) if g.get("step") is not None}
            if len(steps) > 1:
                raise RuntimeError(f"the optimizer checkpoint holds several Adam steps {sorted(steps)}")
            if steps:
                step = float(steps.pop())
                for state in self.optimizer.state.values():
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
        return out

    _set(DistributedOptimizer, "load_state_dict", load_state_dict)


# Megatron-Core fix 3 (0.19.2; core/optimizer/distrib_optimizer.py:1225 via :2061/:2140/:2254):
# _set_main_param_and_optimizer_states copy_()s the loaded values into the main params, which without
# fp16/bf16 main copies are views of the model's parameters (leaves that require grad), and the dp_reshardable
# (default) and dp_zero loaders call it with autograd on -> "a view of a leaf Variable that requires grad
# is being used in an in-place operation". -> those loaders run under torch.no_grad(), as upstream's
# fully_reshardable and fs_model_space loaders already do.
def _fix_distopt_load_no_grad() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for name in ("load_parameter_state_from_dp_reshardable", "load_parameter_state_from_dp_zero",
                 "load_parameter_state_from_dp_zero_legacy"):
        fn = DistributedOptimizer.__dict__.get(name)
        if fn is not None:
            _set(DistributedOptimizer, name, torch.no_grad()(fn))


# Megatron-Core fix 4 (0.19.2; core/optimizer/distrib_optimizer.py:1223 via :2390): with
# --dist-ckpt-optim-fully-reshardable the loader leaves torch Adam's "step" out of the tensors it hands
# to _set_main_param_and_optimizer_states, which looks up every state key -> KeyError: 'step' on
# resume (and training/checkpointing.py:2251's hint names a flag, --ckpt-fully-parallel-save, that
# does not choose this format). -> a state the checkpoint's tensors lack is left as it is (fix 2
# sets the step).
def _fix_distopt_missing_state_key() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"]

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            missing = [k for k in self.optimizer.state[main_param] if k not in tensors]
            if missing:
                tensors = {**tensors, **{k: None for k in missing}}  # None: upstream skips the key
        return original(self, model_param, tensors)

    _set(DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)


# Upstream bugs fixed on every device (:func:`apply_megatron_fixes`), in order.
FIXES: Dict[str, Callable[[], None]] = {
    "distopt_fresh_state_dict": _fix_distopt_fresh_state_dict,
    "distopt_step_per_param": _fix_distopt_step_per_param,
    "distopt_load_no_grad": _fix_distopt_load_no_grad,
    "distopt_missing_state_key": _fix_distopt_missing_state_key,
}
_FIXES_APPLIED: List[str] = []


def megatron_core_version() -> tuple:
    import megatron.core

    parts = []
    for piece in str(getattr(megatron.core, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def apply_megatron_fixes() -> List[str]:
    """Apply FIXES (upstream bugs that are not CPU issues) on any device.  Idempotent; returns the
    names applied (none on a Megatron-Core version outside FIX_VERSIONS: the fixes are written
    against that code)."""
    if _FIXES_APPLIED or megatron_core_version() not in FIX_VERSIONS:
        return list(_FIXES_APPLIED)
    for name, fix in FIXES.items():
        _CURRENT_PATCH.append(name)
        try:
            fix()
        finally:
            _CURRENT_PATCH.pop()
        _FIXES_APPLIED.append(name)
    return list(_FIXES_APPLIED)


# Every patch, in order (the tests suspend them one at a time with patches_suspended()).
PATCHES: Dict[str, Callable[[], None]] = {
    "current_device": _patch_current_device,
    "synchronize": _patch_synchronize,
    "tensor_cuda": _patch_tensor_cuda,
    "module_torch": _patch_module_torch,
    "rng": _patch_rng,
    "clip_grads": _patch_clip_grads,
    "tensor_type_checks": _patch_tensor_type_checks,
    "training_module_torch": _patch_training_module_torch,
    "initialize_allow_no_cuda": _patch_initialize_allow_no_cuda,
    "initialize_model_parallel": _patch_initialize_model_parallel,
    "compile_helpers": _patch_compile_helpers,
    "device_arch_version": _patch_device_arch_version,
    "loader_generator": _patch_loader_generator,
}


def activate_cpu_platform() -> bool:
    """Adapt Megatron-Core to CPU + gloo.  Idempotent.

    Applies FIXES (upstream bugs of every device) first.  Returns False and applies no CPU patch
    when CUDA is available.  Otherwise applies every patch (also when megatron.core was imported
    before) and returns True.
    """
    global _ACTIVE
    apply_megatron_fixes()  # upstream bugs of every device
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    for name, patch in PATCHES.items():
        _CURRENT_PATCH.append(name)
        try:
            patch()
        finally:
            _CURRENT_PATCH.pop()
    _ACTIVE = True
    return True


# --------------------------------------------------------------------------------------------
# The CPU allocator
# --------------------------------------------------------------------------------------------
CPU_ALLOCATOR_CHOICES = ("cache", "system")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); bigger blocks stay mmapped
_TRIM_THRESHOLD = 1 << 30
_ALLOCATOR_USER_CHOICES = ("jemalloc", "tcmalloc", "mimalloc")


def set_cpu_allocator(choice: str = "cache") -> str:
    """``--delta-cpu-allocator``: how freed CPU tensor memory is handled; returns a line for the log.

    PyTorch's CPU allocator is plain malloc/free. With glibc's defaults a freed multi-MiB activation
    or gradient is given back to the OS (unmapped, or trimmed off the heap top) and the next one of
    that size faults its pages in afresh, zeroed by the kernel: measured here, 20-240 thousand page
    faults per training step, 2-3 % of the step's CPU time (README, Performance). ``cache`` makes glibc
    keep freed memory for reuse, as PyTorch's CUDA caching allocator does on GPU (blocks up to 32 MiB
    come from the heap, the heap is not trimmed below 1 GiB free): the process keeps its peak RSS.
    ``system`` leaves malloc as configured. Left alone as well: non-glibc systems, and processes whose
    user chose a malloc (MALLOC_* / GLIBC_TUNABLES malloc settings, or jemalloc / tcmalloc / mimalloc
    in LD_PRELOAD). Process-wide; call it once at start-up (pretrain_gpt.py and tools/benchmark.py do).
    """
    import ctypes
    import ctypes.util

    if choice not in CPU_ALLOCATOR_CHOICES:
        raise ValueError(f"--delta-cpu-allocator {choice!r} is not one of {', '.join(CPU_ALLOCATOR_CHOICES)}")
    if choice == "system":
        return "CPU allocator: malloc as configured (--delta-cpu-allocator system)"
    preload = os.environ.get("LD_PRELOAD", "")
    chosen = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    chosen += [lib for lib in _ALLOCATOR_USER_CHOICES if lib in preload]
    if chosen:
        return f"CPU allocator: malloc as configured by {', '.join(chosen)} (--delta-cpu-allocator cache not applied)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "CPU allocator: malloc as configured (no glibc mallopt here)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        return "CPU allocator: malloc as configured (glibc refused mallopt)"
    return "CPU allocator: glibc keeps freed memory for reuse (--delta-cpu-allocator cache)"


# --------------------------------------------------------------------------------------------
# Distributed initialisation
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    """A free TCP port on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_p2p_config(config) -> None:
    """Raise on the silently-wrong VPP setting (PP=2, VPP, batch_p2p_comm=True, no overlap).

    Upstream Megatron-LM #750/#1450: send-next and send-prev to the same peer get mixed.
    ``config`` is a ModelParallelConfig/TransformerConfig.
    """
    from megatron.core import parallel_state

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (
        vpp is not None
        and vpp > 1
        and pp == 2
        and getattr(config, "batch_p2p_comm", False)
        and not getattr(config, "overlap_p2p_comm", False)
    ):
        raise ValueError(
            "virtual pipeline parallelism with --pipeline-model-parallel-size 2 needs "
            "batch_p2p_comm=False or overlap_p2p_comm=True (upstream Megatron-LM #750/#1450: "
            "with batched p2p, sends to the same peer get mixed and training is silently wrong)"
        )


def initialize_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 10,
    **model_parallel_kwargs,
) -> None:
    """Initialise torch.distributed, Megatron's model-parallel groups and the RNG.

    torch.distributed: env:// when torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are set,
    otherwise a one-process world on a free localhost port; gloo on CPU (after
    :func:`activate_cpu_platform`), nccl on GPU.  Already-initialised torch.distributed is reused
    and an existing model-parallel state is replaced.  Then
    ``parallel_state.initialize_model_parallel`` (extra keyword arguments are passed to it) and the
    seeding of Megatron-LM's ``_set_random_seed``: seed + 100 * pipeline rank for python, numpy and
    torch, and ``model_parallel_cuda_manual_seed`` (on CPU an RNG tracker forking the CPU
    generator).
    """
    from megatron.core import parallel_state, tensor_parallel

    cpu = activate_cpu_platform() or is_cpu_platform()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    for flag, value in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
        ("--context-parallel-size", cp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    if virtual_pipeline_model_parallel_size is not None:
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError("the virtual pipeline size must be a positive integer")
        if pp < 2 and virtual_pipeline_model_parallel_size > 1:
            raise ValueError(
                "virtual pipeline parallelism needs --pipeline-model-parallel-size >= 2, "
                f"got {pp}"
            )

    if not torch.distributed.is_initialized():
        backend = "gloo" if cpu else "nccl"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            world_size = int(os.environ["WORLD_SIZE"])
            _check_divisible(world_size, tp, pp, cp)
            if not cpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(
                backend=backend,
                init_method="env://",
                rank=int(os.environ["RANK"]),
                world_size=world_size,
                timeout=timeout,
            )
        else:
            _check_divisible(1, tp, pp, cp)
            if not cpu:
                torch.cuda.set_device(0)
            torch.distributed.init_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    world_size = torch.distributed.get_world_size()
    _check_divisible(world_size, tp, pp, cp)

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=cp,
        distributed_timeout_minutes=timeout_minutes,
        **model_parallel_kwargs,
    )

    # Megatron-LM's _set_random_seed: different pipeline stages get different seeds.
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _check_divisible(world_size: int, tp: int, pp: int, cp: int) -> None:
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = "
            f"{tp * pp * cp}; launch with a multiple of it (e.g. torchrun --nproc-per-node "
            f"{tp * pp * cp}) or reduce the parallel sizes"
        )


def destroy_distributed() -> None:
    """Tear down Megatron's model-parallel state, the RNG tracker and torch.distributed.

    Call it once, at the end of the process: a new env:// world after it on the same
    MASTER_PORT can hang.  To change parallel layouts within one process, call
    :func:`initialize_distributed` again instead (it keeps torch.distributed and replaces the
    model-parallel state).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    mp_random.initialize_rng_tracker(force_reset=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
