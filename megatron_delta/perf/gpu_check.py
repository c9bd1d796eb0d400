"""tools/gpu_check.py's throughput runs on one GPU: Megatron's DDP, optimizer and forward-backward schedule over a
model of the 1B shape or the 8B layer slice (train), eager or with Megatron's full-iteration CUDA graph
(--cuda-graph-impl full_iteration: the forward-backward of every micro-batch captured once, then replayed), where
Megatron and this project accept it (graph_refusal: the line a refused configuration gets). Env says what
differs between a GPU run and the CPU dry run (tiny shapes, the Triton kernels under the interpreter, no graphs);
check_session sets the one-process world up; CheckRun keeps the results: the JSON rewritten after every run,
the time budget, a failed run recorded and the rest run on. The correctness checks are pytest's (tests/gpu/);
perf/speed_targets.py sets each run beside the cost model and the targets. torch and Megatron are imported inside
the functions, so that the tool refuses a machine without CUDA at once."""
import contextlib
import gc
import json
import math
import os
import time
import types

from megatron_delta.core.modes import BASELINE, BLOCK_MODES, DELTA, DELTA_BLOCK
from megatron_delta.perf.routed_stream import NUM_BLOCKS
from megatron_delta.perf.shapes import SHAPES as MODEL_SHAPES
from megatron_delta.perf.speed_targets import TARGETS

NO_GPU_EXIT = 2
GRAPH_IMPL = "full_iteration"  # --cuda-graph-impl of the graphed runs (`local` is refused for the routed modes)
# The throughput runs' shapes (perf.shapes; the 8B slice takes as many layers as fit, a multiple of NUM_BLOCKS,
# unless --num-layers-8b); the dry run's are tiny stand-ins with the same roles.
SHAPES = {name: dict(hidden=s["hidden_size"], ffn=s["ffn_hidden_size"], heads=s["num_attention_heads"],
                     groups=s["num_query_groups"], seq=s["seq_length"],
                     layers=None if name == "8B" else s["num_layers"])
          for name, s in ((n, MODEL_SHAPES[n]) for n in ("8B", "1B"))}
DRY_SHAPES = {"8B": dict(hidden=64, ffn=192, heads=4, groups=2, seq=32, layers=4),
              "1B": dict(hidden=32, ffn=96, heads=4, groups=2, seq=32, layers=4)}
SPEED_MICRO_BATCHES = 8  # micro-batches per timed step (a training step's forward + backward, not one)
SEED = 1234
# Adam as in pretrain_gpt.py's default run (tests/helpers/flags.py QWEN3); the learning rate is --lr, its floor lr / 10.
ADAM = dict(weight_decay=0.1, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95)


def speed_runs(shape_name):
    """The throughput runs at a shape: (mode, group size, graphs) - the baseline and the shape's target mode eager
    first (a run cut short by the time budget has measured them), then both with CUDA graphs, then the other mode:
    delta on the group router (--delta-router-group-size auto) and delta_block, on the project's Triton kernels."""
    target, other = sorted((DELTA, DELTA_BLOCK), key=lambda m: (shape_name, m) not in TARGETS)
    order = [(BASELINE, False), (target, False), (BASELINE, True), (target, True), (other, False), (other, True)]
    return [(m, "auto" if m == DELTA else None, graphs) for m, graphs in order]


def missing_requirement():
    """Why this machine cannot run the GPU check (a sentence ending "Nothing was run."), or None."""
    import torch

    if not torch.cuda.is_available():
        return ("no CUDA device visible (torch.cuda.is_available() is False); this check needs one GPU "
                "(or run --dry-run on CPU under TRITON_INTERPRET=1). Nothing was run.")
    from megatron_delta.core import triton_router

    if not triton_router.available():
        return "Triton cannot be imported, and the routers run on the project's Triton kernels. Nothing was run."
    return None


def transformer_engine_line():
    """What the runs' layers are: Megatron's local layers, and whether Transformer Engine is here at all (found, not
    imported: its import fails without CUDA)."""
    import importlib.util

    te = importlib.util.find_spec("transformer_engine") is not None
    return ("Megatron's local layers (--transformer-impl local); Transformer Engine "
            + ("is installed but not used" if te else "is not installed here: no TE spec, no FP8"))


class Env:
    """What differs between the GPU run and the dry run."""

    def __init__(self, opts):
        import torch

        self.dry = opts.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.impl = "local"
        self.shapes = DRY_SHAPES if self.dry else SHAPES
        self.gpu_name = "CPU (dry run)" if self.dry else torch.cuda.get_device_name()
        self.resident = 0

    def sync(self):
        import torch

        if not self.dry:
            torch.cuda.synchronize()

    def reset_peak(self):
        """Starts a run's peak memory; returns the GiB still allocated from before (None in the dry run): a run's
        own peak is counted above what it found allocated."""
        import torch

        if self.dry:
            return None
        torch.cuda.reset_peak_memory_stats()
        self.resident = torch.cuda.memory_allocated()
        return self.resident / 2**30

    def peak_gib(self):
        """The GiB the run allocated at its peak, above what was allocated when it started (reset_peak)."""
        import torch

        return None if self.dry else (torch.cuda.max_memory_allocated() - self.resident) / 2**30

    def gpu_kind(self):
        """cost_model.GPUS key for the prediction (H100 where the name says neither)."""
        for k in ("B200", "H200", "H100"):
            if k in self.gpu_name:
                return k
        return "H100"


def router_kernels(env):
    """The routers' fused kernels a run here can take: the project's Triton kernels (the dry run: under the
    Triton interpreter only)."""
    from megatron_delta.core.router import KERNEL_CHOICES

    return ["triton"] if "triton" in KERNEL_CHOICES and (not env.dry or os.environ.get("TRITON_INTERPRET") == "1") \
        else []


def model_fields(opts, env, mode, *, shape):
    """The model fields (megatron_delta.checkpoint.model_config) of one run: ``shape``, local layers in BF16 (the
    dry run: fp32), K = NUM_BLOCKS in the block modes."""
    s = shape
    fields = dict(residual=mode, transformer_impl=env.impl, vocab_size=opts.vocab_size,
                  num_layers=s["layers"], hidden_size=s["hidden"], ffn_hidden_size=s["ffn"],
                  num_attention_heads=s["heads"], num_query_groups=s["groups"], seq_length=s["seq"],
                  bf16=not env.dry)
    if mode in BLOCK_MODES:
        fields["delta_num_blocks"] = NUM_BLOCKS
    return fields


def graph_config(graphs):
    """The config fields of a run with CUDA graphs (none without)."""
    return dict(cuda_graph_impl=GRAPH_IMPL) if graphs else {}


def build(env, fields, kernels="triton", group_size=None, **config_overrides):
    """(resolved fields, config, model chunk on the device); ``kernels``: the routers' backend; ``group_size``:
    delta's --delta-router-group-size (None: the default); ``config_overrides``: config fields set directly."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields
    from megatron_delta.core.model import build_model_chunks

    fields = resolve_model_fields(fields)
    over = {} if fields["residual"] == BASELINE else {"delta_router_kernels": kernels}
    if group_size is not None:
        over["delta_router_group_size"] = group_size
    config, options = model_config(fields, use_cpu_initialization=env.dry, **over, **config_overrides)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    (chunk,) = build_model_chunks(config, fields["padded_vocab_size"], **options)
    return fields, config, chunk.to(env.device)


def graph_refusal(opts, env, mode, shape, group_size=None):
    """The line this project or Megatron refuses a graphed run of ``mode`` with (the configuration alone is
    checked, nothing is built), or None where it is accepted."""
    from megatron_delta.checkpoint.model_config import ModelConfigError, model_config, resolve_model_fields

    over = {} if mode == BASELINE else {"delta_router_kernels": "triton"}
    if group_size is not None:
        over["delta_router_group_size"] = group_size
    try:
        model_config(resolve_model_fields(model_fields(opts, env, mode, shape=shape)), use_cpu_initialization=True,
                     **over, **graph_config(True))
    except (ValueError, AssertionError, ModelConfigError) as e:
        return str(e).splitlines()[0]
    return None


def free(env, *objs):
    import torch

    del objs
    gc.collect()
    if not env.dry:
        torch.cuda.empty_cache()


@contextlib.contextmanager
def full_iteration_graphs(enabled):
    """Megatron's FullCudaGraphWrapper keeps its graphs, iteration counts and static inputs in class attributes,
    one set per process: cleared before a graphed run and after it, so that each run captures its own graph and
    the last one's memory pool is released."""
    if not enabled:
        yield None
        return
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

    def clear():
        FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
        FullCudaGraphWrapper.result = {"training": None, "validation": None}
        FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
        StaticBufferLoader.static_buffers = {"training": [], "validation": []}

    clear()
    try:
        yield FullCudaGraphWrapper
    finally:
        clear()


def train(opts, env, mode, *, shape, overrides, kernels="triton", iters=None, warmup=0, micro_batches=1,
          group_size=None, graphs=False):
    """``iters`` iterations with Megatron's DDP + optimizer + forward-backward schedule on a learnable stream,
    ``micro_batches`` micro-batches per iteration; ``graphs``: the schedule wrapped in Megatron's
    FullCudaGraphWrapper (captured at the second iteration, replayed from then on; DDP made on its capture stream,
    as megatron.training does). ``overrides(args, standard_overrides)``: the optimizer's parameter-group overrides
    with the routers' group, as pretrain_gpt.py makes them (the trainer's router_overrides). tokens_per_sec: the
    micro-batches' forward + backward alone; the optimizer step is timed apart (optimizer_ms) and
    step_tokens_per_sec counts it too."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.pipeline_parallel import get_forward_backward_func

    free(env)
    resident_gib = env.reset_peak()
    iters = iters or opts.iters
    fields, config, chunk = build(env, model_fields(opts, env, mode, shape=shape), kernels=kernels,
                                  group_size=group_size, **graph_config(graphs))
    with full_iteration_graphs(graphs) as wrapper:
        ddp_stream = contextlib.nullcontext()
        if graphs:
            from megatron.core.full_cuda_graph import get_shared_capture_stream

            capture = get_shared_capture_stream()  # its AccumulateGrad nodes on the capture stream
            capture.wait_stream(torch.cuda.current_stream())
            ddp_stream = torch.cuda.stream(capture)
        with ddp_stream:
            ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), module=chunk)
        if graphs:
            torch.cuda.current_stream().wait_stream(capture)
        lr = dict(lr=opts.lr, min_lr=opts.lr / 10)
        opt_config = OptimizerConfig(optimizer="adam", **lr, **ADAM, bf16=not env.dry, params_dtype=config.params_dtype)
        # the routers' parameter group, as pretrain_gpt.py makes it (--delta-router-lr-mult 1: no weight decay)
        routers = types.SimpleNamespace(residual=mode, delta_router_lr_mult=1.0, **lr)
        optimizer = get_megatron_optimizer(opt_config, [ddp], config_overrides=overrides(
            routers, get_standard_config_overrides(opt_config)))
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = ddp.no_sync

        s, b = fields["seq_length"], 1
        g = torch.Generator(device="cpu").manual_seed(1)
        base = torch.randint(0, opts.vocab_size, (16,), generator=g)  # period 16: the loss must fall fast
        seqs = base.repeat((s + 1) // 16 + 2)[: s + 1].to(env.device)
        batch = {"tokens": seqs[:-1].expand(b, -1).contiguous(), "labels": seqs[1:].expand(b, -1).contiguous(),
                 "position_ids": torch.arange(s, device=env.device).expand(b, -1).contiguous()}

        def step_fn(data_iterator, model):
            x = next(data_iterator)  # the graphed schedule hands its static copy of the batch
            out = model(x["tokens"], x["position_ids"], None, labels=x["labels"])

            def loss_fn(o):
                loss = o.float().mean()
                return loss, {"lm loss": loss.detach()}
            return out, loss_fn

        fb = get_forward_backward_func()
        if graphs:
            fb = wrapper(fb, cuda_graph_warmup_steps=1)
        losses, fb_times, opt_times = [], [], []
        for _ in range(iters):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            env.sync()
            t0 = time.perf_counter()
            reports = fb(forward_step_func=step_fn, data_iterator=iter([batch] * micro_batches), model=ddp,
                         num_microbatches=micro_batches, seq_length=s, micro_batch_size=b, forward_only=False)
            env.sync()
            t1 = time.perf_counter()
            optimizer.step()
            env.sync()
            fb_times.append(t1 - t0)
            opt_times.append(time.perf_counter() - t1)
            losses.append(sum(float(r["lm loss"]) for r in reports) / len(reports))
    timed, opt_timed = fb_times[warmup:] or fb_times, opt_times[warmup:] or opt_times
    tokens = s * b * micro_batches * len(timed)
    out = {"mode": mode, "kernels": kernels if mode != BASELINE else "-", "group_size": group_size,
           "graphs": graphs, "precision": "fp32" if env.dry else "bf16", "num_layers": fields["num_layers"],
           "num_blocks": fields["delta_num_blocks"], "micro_batches": micro_batches, "losses": losses,
           "tokens_per_sec": tokens / sum(timed), "fb_ms": [1e3 * t for t in timed],
           "optimizer_ms": 1e3 * sum(opt_timed) / len(opt_timed),
           "step_tokens_per_sec": tokens / (sum(timed) + sum(opt_timed)), "peak_mem_gib": env.peak_gib(),
           "resident_gib": resident_gib,
           "ok": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]}
    free(env, ddp, optimizer, chunk)
    return out


@contextlib.contextmanager
def check_session(opts):
    """The Env of this run, inside the one-process world (gloo on CPU, nccl on a GPU); undone on exit."""
    import logging

    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed

    if not opts.dry_run:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # DDP / optimizer set-up lines per run
    env = Env(opts)
    try:
        initialize_distributed(1, 1, seed=SEED)
        yield env
    finally:
        destroy_distributed()


PARTS = ("speed", "host", "bandwidth", "kernels")  # the result's lists, one per part of tools/gpu_check.py


class CheckRun:
    """One run's results (``result``): the JSON at --out, rewritten after every run so that a timeout still
    leaves results; the time budget (--time-budget-s) from the start; attempt() runs one part's run and records
    it, a failure as ok=False with its error; a run the budget leaves out is recorded under "skipped"."""

    def __init__(self, opts, env):
        import torch

        from megatron_delta.core import fla_router

        self.opts, self.env = opts, env
        self.t_start = time.time()
        self.result = {"device": env.gpu_name, "dry_run": env.dry, "torch": torch.__version__, "opts": vars(opts),
                       "layers": transformer_engine_line(),
                       "router_kernels": fla_router.describe("triton", cuda=not env.dry),
                       **{part: [] for part in PARTS}, "skipped": []}

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.opts.out)), exist_ok=True)
        with open(self.opts.out, "w") as f:
            json.dump(self.result, f, indent=1)

    def over_budget(self, what):
        if time.time() - self.t_start > self.opts.time_budget_s:
            self.result["skipped"].append(what)
            print(f"gpu_check: time budget ({self.opts.time_budget_s:.0f} s) spent, not run: {what}", flush=True)
            return True
        return False

    def attempt(self, part, what, fn, **fields):
        """fn()'s result appended to ``part`` (None when the budget is spent); an exception is recorded as
        ``fields`` + ok False + its error, and the run goes on."""
        if self.over_budget(what):
            return None
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001  (report and go on)
            r = dict(fields, ok=False, error=f"{type(e).__name__}: {e}")
            free(self.env)
        self.result[part].append(r)
        self.save()
        return r

    def finish(self):
        """The verdicts (every run ok and nothing skipped; the targets met), the wall time; saved."""
        result = self.result
        result["ok"] = all(r["ok"] for part in PARTS for r in result[part]) and not result["skipped"]
        result["targets_met"] = all(r.get("target_ok", True) for r in result["speed"])
        result["wall_s"] = time.time() - self.t_start
        self.save()
        return result
