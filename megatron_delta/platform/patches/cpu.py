"""The CPU + gloo adaptation of Megatron-Core and megatron.training: the implementations of the CPU-only
entries of megatron_delta.platform.patches (the registry says which upstream failure each answers, for which
versions; this module says how). Applied by megatron_delta.platform.cpu.activate_cpu_platform, only
without CUDA."""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from typing import Callable, List, Optional

import torch

from megatron_delta.platform.patches import PATCHED_MODULES, TRAINING_MODULES
from megatron_delta.platform.patches.install import replace

_CPU = torch.device("cpu")



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
    """What patched Megatron modules see as ``torch.cuda`` on CPU (module_torch, rng).

    ``current_device`` and ``synchronize`` are not overridden here: they fall through to the real
    torch.cuda, which current_device and synchronize fix for every caller.
    """

    def __init__(self):
        super().__init__("torch.cuda")
        self.__dict__.update(
            empty_cache=lambda: None,
            # RNG: the "CUDA" generator is the CPU generator (rng).
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
    """What patched Megatron modules see as ``torch`` on CPU (module_torch).

    Only the tensor factory functions (device="cuda" -> cpu), ``torch.cuda`` and
    ``torch.autocast("cuda")`` differ from the real torch; every other attribute is the real one.
    A TorchFunctionMode cannot do this: it is inactive inside autograd backward.
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
# current_device: torch.cuda.current_device() is used as a device in ~40 places -> CPU device.
def patch_current_device() -> None:
    replace(torch.cuda, "current_device", lambda: _CPU)


# synchronize: torch.cuda.synchronize() after batched p2p (and in timers/DDP) -> no-op.
def patch_synchronize() -> None:
    replace(torch.cuda, "synchronize", lambda device=None: None)


# tensor_cuda: weight.data.cuda() for tied embeddings with PP > 1 -> Tensor.cuda is identity.
def patch_tensor_cuda() -> None:
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    replace(torch.Tensor, "cuda", cuda)


# module_torch: hard-coded device="cuda" / torch.cuda.* in schedules, optimizer, clip_grads,
# param_and_grad_buffer, ... -> those modules see a torch proxy mapping cuda devices to cpu.
def patch_module_torch() -> None:
    proxy = _torch_proxy()
    for name in PATCHED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module missing in another Megatron-Core version
            continue
        if getattr(module, "torch", None) is torch:
            replace(module, "torch", proxy)


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


# rng: model_parallel_cuda_manual_seed / CudaRNGStatesTracker / CheckpointFunction use
# the CUDA RNG -> the tracker forks the CPU generator (tensor-parallel dropout, recompute).
def patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    replace(mp_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    replace(mp_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    # torch.cuda.get_rng_state / set_rng_state / manual_seed of the module -> the CPU generator
    if getattr(mp_random, "torch", None) is torch:
        replace(mp_random, "torch", _torch_proxy())
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


# clip_grads: clip_grads asserts param.grad.type() == 'torch.cuda.FloatTensor' -> CPU path.
def patch_clip_grads() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        fn = getattr(module, "clip_grad_by_total_norm_fp32", None)
        if fn is not None and fn is not _clip_grad_by_total_norm_fp32_cpu:
            replace(module, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu)


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


# tensor_type_checks: DistributedOptimizer and the bf16/fp16 optimizer sort params by comparing
# Tensor.type() with 'torch.cuda.*' names -> during their constructors CPU tensors report those.
def patch_tensor_type_checks() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (DistributedOptimizer, Float16OptimizerWithFloat16Params):
        replace(cls, "__init__", _with_cuda_type_names(cls.__dict__["__init__"]))
    raw = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    if isinstance(raw, (classmethod, staticmethod)):
        replace(
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
            replace(module, "torch", proxy)


# training_module_torch (0.19.2; training.py:1131 first of ~90): torch.cuda.* and device='cuda'
# throughout the trainer -> its modules see the torch proxy of module_torch as well.
def patch_training_module_torch() -> None:
    _patch_proxy_into(TRAINING_MODULES, _torch_proxy())


# initialize_allow_no_cuda (0.19.2; initialize.py:66): initialize_megatron asserts CUDA unless
# allow_no_cuda=True, which pretrain() does not pass -> on CPU it is passed.
def patch_initialize_allow_no_cuda() -> None:
    from megatron.training import initialize, training

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    for module in (initialize, training):
        if getattr(module, "initialize_megatron", None) is original:
            replace(module, "initialize_megatron", initialize_megatron)


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


# initialize_model_parallel (0.19.2; initialize.py:270/306 and :447): with
# torch.cuda.device_count() == 0, _initialize_distributed SILENTLY skips initialize_model_parallel and
# _set_random_seed skips seeding the tensor-parallel RNG tracker -> in initialize.py the CPU counts as
# one device (set_device a no-op), and initialize_megatron checks that both exist afterwards.
def patch_initialize_model_parallel() -> None:
    from megatron.training import initialize, training

    replace(initialize, "torch", _OneDeviceTorch())
    inner = getattr(training, "initialize_megatron")  # initialize_allow_no_cuda's wrapper (or the original)
    original = initialize.initialize_megatron

    def checked(fn):
        @functools.wraps(fn)
        def initialize_megatron(*args, **kwargs):
            out = fn(*args, **kwargs)
            from megatron.training import get_args

            _check_model_parallel_initialized(
                kwargs.get("skip_mpu_initialization", False), kwargs.get("skip_model_parallel_init", False),
                lazy=getattr(get_args(), "lazy_mpu_init", False),
                skip_random_seed=kwargs.get("skip_random_seed", False))
            return out

        return initialize_megatron

    replace(initialize, "initialize_megatron", checked(original))
    replace(training, "initialize_megatron", checked(inner))


def _prebuilt_helpers_available() -> bool:
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


# compile_helpers (0.19.2; initialize.py:177 -> core/datasets/utils.py:25):
# _compile_dependencies runs `make` in site-packages for the dataset helpers; the wheel ships them
# prebuilt (helpers_cpp.*.so) -> compile only when the prebuilt module does not import.
def patch_compile_helpers() -> None:
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers

    @functools.wraps(original)
    def compile_helpers():
        if not _prebuilt_helpers_available():
            original()

    replace(dataset_utils, "compile_helpers", compile_helpers)


# device_arch_version (0.19.2; arguments.py:1414 -> utils/common_utils.py:504): with TP > 1
# validate_args asks the GPU for its architecture (torch.cuda.get_device_properties('cuda:0')), to
# require CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell -> the CPU has no CUDA connection limit:
# reported as 10 (Blackwell and later, where upstream no longer requires it).
def patch_device_arch_version() -> None:
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    cpu_arch = lambda: 10  # noqa: E731
    for module in (arguments, common_utils):
        if hasattr(module, "get_device_arch_version"):
            replace(module, "get_device_arch_version", cpu_arch)
    utils_pkg = importlib.import_module("megatron.training.utils")
    if hasattr(utils_pkg, "get_device_arch_version"):
        replace(utils_pkg, "get_device_arch_version", cpu_arch)


# moe_splits_to_host (0.19.2; moe/token_dispatcher.py:930 -> moe_utils.py:1184): the alltoall dispatcher
# asks maybe_move_tensor_to_cpu(..., as_numpy=True) for the split sizes all_to_all_single takes, which
# converts only a CUDA tensor; a CPU tensor comes back as a tensor, which the c10d binding refuses
# ("all_to_all_single(): incompatible function arguments") -> on CPU, as_numpy converts it too.
def patch_moe_splits_to_host() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


# moe_uneven_gather (0.19.2; tensor_parallel/mappings.py:151-153): _gather_along_first_dim with
# output_split_sizes (the alltoall MoE dispatcher under TP > 1: each TP rank's share of the tokens an expert
# rank received) calls torch.distributed.all_gather with a list of tensors of different sizes, which NCCL
# accepts and gloo refuses -> on CPU, uneven splits are padded to the largest, gathered and cut back.
def patch_moe_uneven_gather() -> None:
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    @functools.wraps(original)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or group is None or group.size() == 1 or len(set(sizes)) == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        width = max(sizes)
        padded = input_.new_zeros((width,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(gathered, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(gathered, sizes)], dim=0)

    replace(mappings, "_gather_along_first_dim", _gather_along_first_dim)


# loader_generator (0.19.2; datasets/data_samplers.py:19 via training.py:4569): on CPU the
# "CUDA" RNG (dropout) is the default CPU generator, from which torch's DataLoader also draws a seed
# whenever an iterator starts. A resumed run starts its loaders after loading the RNG state, so from
# there on its dropout masks differ from the uninterrupted run's -> each loader gets its own generator.
def patch_loader_generator() -> None:
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
            replace(module, "build_pretraining_data_loader", build_pretraining_data_loader)


# CheckpointWithoutOutput.__init__(fp8=False) sets `self.fp8 = fp8 is not None`, True for its default, so its
# forward asks TE's FP8GlobalStateManager, which is not imported without Transformer Engine: selective
# recompute of the norms (--recompute-modules layernorm) fails with a NameError. Without TE no FP8 runs, so the
# object records no FP8 state.
def patch_checkpoint_without_output_fp8() -> None:
    from megatron.core.tensor_parallel import random

    original = random.CheckpointWithoutOutput.__init__

    @functools.wraps(original)
    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = False

    replace(random.CheckpointWithoutOutput, "__init__", __init__)
