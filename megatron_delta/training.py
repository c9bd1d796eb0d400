"""The training loop behind pretrain_gpt.py, on megatron.core alone.

Megatron-Core pieces used as they are: parallel_state, GPTModel / our DeltaGPTModel, DDP,
get_megatron_optimizer, OptimizerParamScheduler, get_forward_backward_func (1F1B, interleaved),
finalize_model_grads and dist_checkpointing. What lives here is what Megatron-LM's
megatron/training package does and the megatron-core wheel lacks: flag handling, data order,
logging, evaluation and the checkpoint schedule.
"""

import json
import math
import os
import sys
import time
from functools import partial

import torch

from megatron_delta.arguments import ArgumentError, parse_args
from megatron_delta.cpu_platform import (activate_cpu_platform, destroy_distributed, initialize_distributed,
                                         is_cpu_platform, set_cpu_allocator)


# ----------------------------------------------------------------------------------------------- data
class PretrainingBatches:
    """This data-parallel rank's micro-batches, in Megatron's global order, from `consumed_samples` on.

    Global sample k of step t is index t*GBS + k; each step's micro-batch m on rank r takes
    [m*DP*MBS + r*MBS, +MBS): the order of Megatron-LM's MegatronPretrainingSampler, so a run resumed
    at `consumed_samples` sees exactly the batches an uninterrupted run would.
    """

    def __init__(self, dataset, consumed_samples, micro_batch_size, dp_rank, dp_size):
        self.dataset, self.next = dataset, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        return self

    def __next__(self):
        start = self.next + self.dp_rank * self.mbs
        self.next += self.mbs * self.dp_size
        samples = [self.dataset[(start + i) % len(self.dataset)] for i in range(self.mbs)]
        return {k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                for k in ("tokens", "labels", "loss_mask", "position_ids")}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _loss_func(loss_mask, output_tensor):
    mask = loss_mask.reshape(-1).float()
    total = torch.sum(output_tensor.float().reshape(-1) * mask)
    count = mask.sum()
    loss = total / count.clamp(min=1)
    return loss, {"lm loss": torch.stack([total.detach(), count])}


def _sum_loss_reports(reports):
    """Sum the [loss*tokens, tokens] reports of the micro-batches; reduce over data parallel."""
    from megatron.core import parallel_state

    if not reports:
        return None
    total = torch.stack([r["lm loss"] for r in reports]).sum(0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1]).item()


# ---------------------------------------------------------------------------------------- logging
class Reporter:
    """Progress lines, the JSON-lines metrics file and TensorBoard; only the last rank writes."""

    def __init__(self, args):
        self.active = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        self.metrics = args.metrics_file if self.active else None
        self.tb = None
        if self.active and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(args.tensorboard_dir)
        if self.metrics:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics)), exist_ok=True)

    def print(self, *a):
        if self.active:
            print(*a, flush=True)

    def record(self, record: dict):
        if self.metrics:
            with open(self.metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            it = record["iteration"]
            prefix = record.get("split", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "iteration":
                    self.tb.add_scalar(f"{prefix}/{k}", v, it)
            self.tb.flush()


def _hms(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# ------------------------------------------------------------------------------------------ setup
def _resolve_data(args):
    """The embedded default run builds (once, cached) the bundled corpus' tokenizer and datasets."""
    if args.embedded_default:
        from megatron_delta.data import ensure_default_data

        paths = ensure_default_data(os.path.join("runs", "cache"))
        args.data_path = paths["train_data_path"]
        args.tokenizer_model = args.tokenizer_model or paths["tokenizer_model"]
        args.valid_data_path = args.valid_data_path or [paths["sotu_valid_data_path"]]
        args.heldout_data_path = args.heldout_data_path or [paths["heldout_data_path"]]


def build_data(args, tokenizer):
    from megatron_delta.data import build_gpt_datasets

    gbs = args.global_batch_size
    # Every evaluation reads the same first eval_iters batches of a split (comparable over time).
    eval_samples = args.eval_iters * gbs
    train, valid, _ = build_gpt_datasets(
        args.data_path, args.split, args.seq_length, args.seed, (max(args.train_iters, 1) * gbs, eval_samples, 0),
        tokenizer, mock=args.mock_data, cache_dir=args.data_cache_path, valid_data_path=args.valid_data_path)
    heldout = None
    if args.heldout_data_path:
        heldout, _, _ = build_gpt_datasets(
            args.heldout_data_path, "100,0,0", args.seq_length, args.seed, (eval_samples, 0, 0),
            tokenizer, cache_dir=args.data_cache_path)
    return {"train": train, "valid": valid, "heldout": heldout}


def setup_model_and_optimizer(args, vocab_size):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_delta.model import build_model_chunks, padded_vocab_size, transformer_config_from_args

    args.padded_vocab_size = padded_vocab_size(vocab_size, args)
    config = transformer_config_from_args(args)
    chunks = build_model_chunks(args, config, args.padded_vocab_size)
    if torch.cuda.is_available():  # weights are initialised on CPU (identical in every layout), then moved
        chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer, check_for_nan_in_grad=True)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                     disable_bucketing=(i > 0)) for i, c in enumerate(chunks)]
    for m in model:
        m.broadcast_params()

    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=optimizer_overrides(args, opt_config))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        wsd_decay_steps=(args.lr_decay_iters * args.global_batch_size) // 10 if args.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if args.lr_decay_style == "WSD" else None)

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.variable_seq_lengths = _needs_variable_payload(args)
    return model, optimizer, scheduler, config


def optimizer_overrides(args, opt_config):
    """Megatron's standard groups (no weight decay on 1-D params) plus the routers' own group."""
    from megatron.core.optimizer import ParamGroupOverride, ParamKey, get_standard_config_overrides

    overrides = get_standard_config_overrides(opt_config)
    if args.residual != "baseline":
        overrides[ParamKey(attr="is_delta_router")] = ParamGroupOverride(
            max_lr=args.lr * args.router_lr_mult, min_lr=args.min_lr * args.router_lr_mult, wd_mult=0.0)
    return overrides


def _needs_variable_payload(args) -> bool:
    """Routed modes send a payload whose length differs by boundary; p2p then sends shapes first."""
    return args.residual != "baseline" and args.pipeline_model_parallel_size > 1


# ------------------------------------------------------------------------------------ train / eval
def _iterators(dataset, consumed, args, n_chunks):
    from megatron.core import parallel_state

    if dataset is None:
        return None
    its = [PretrainingBatches(dataset, consumed, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                              parallel_state.get_data_parallel_world_size()) for _ in range(n_chunks)]
    return its if n_chunks > 1 else its[0]


def run_schedule(args, model, data_iterator, forward_only):
    """One global batch through Megatron's forward_backward_func (1F1B, interleaved or none)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megatron_delta.payload import schedule_communication_kwargs

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model if len(model) > 1 else model[0],
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only,
        **schedule_communication_kwargs(get_model_config(model[0])))


def train_step(args, model, optimizer, scheduler, data_iterator):
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    reports = run_schedule(args, model, data_iterator, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=args.global_batch_size)
    return _last_stage_value(_sum_loss_reports(reports)), grad_norm


def _last_stage_value(value):
    """Loss reports exist on the last pipeline stage; send the value to every rank."""
    t = torch.tensor([float("nan") if value is None else value], dtype=torch.float64)
    torch.distributed.broadcast(t, src=torch.distributed.get_world_size() - 1)
    return t.item()


@torch.no_grad()
def evaluate(args, model, dataset, num_batches, start_sample=0):
    """Token-weighted mean loss over `num_batches` global batches of `dataset`."""
    for m in model:
        m.eval()
    it = _iterators(dataset, start_sample, args, len(model))
    total = torch.zeros(2, dtype=torch.float64)
    from megatron.core import parallel_state

    for _ in range(num_batches):
        reports = run_schedule(args, model, it, forward_only=True)
        if reports:
            total += torch.stack([r["lm loss"] for r in reports]).sum(0).double()
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    for m in model:
        m.train()
    loss = (total[0] / total[1]).item() if total[1] > 0 else None
    return _last_stage_value(loss)


def run_evaluations(args, model, data, iteration, reporter, final=False):
    results = {}
    for split, name in (("valid", "valid"), ("heldout", "heldout")):
        ds = data.get(split)
        if ds is None:
            continue
        loss = evaluate(args, model, ds, args.eval_iters)
        ppl = math.exp(min(loss, 50.0))
        results[split] = loss
        tag = " (final)" if final else ""
        reporter.print(f" validation{tag} [{name}] at iteration {iteration} | lm loss {loss:.4f} | ppl {ppl:.3f}")
        reporter.record({"iteration": iteration, "split": name, "lm_loss": loss, "ppl": ppl})
    routing = routing_summary(args, model, data.get("valid"))
    if routing is not None:
        reporter.print(routing["text"])
        reporter.record({"iteration": iteration, "routing": routing["stats"]})
    return results


def routing_summary(args, model, dataset):
    """Routing statistics of one validation batch (routed modes only); see megatron_delta.routing_stats."""
    if args.residual == "baseline" or dataset is None:
        return None
    from megatron_delta.block import collect_routing_stats

    return collect_routing_stats(args, model, dataset)


def train(args, model, optimizer, scheduler, data, start_iteration, consumed, reporter):
    it = _iterators(data["train"], consumed, args, len(model))
    iteration = start_iteration
    tokens_per_iter = args.global_batch_size * args.seq_length
    t_start = time.time()
    t_last, it_last = t_start, iteration
    deadline = t_start + args.time_limit_minutes * 60 if args.time_limit_minutes else None
    while iteration < args.train_iters:
        loss, grad_norm = train_step(args, model, optimizer, scheduler, it)
        iteration += 1
        consumed += args.global_batch_size
        lr = scheduler.get_lr(optimizer.param_groups[0])
        if not math.isfinite(loss):
            raise FloatingPointError(f"lm loss is {loss} at iteration {iteration}; lower --lr or check the data")
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            now = time.time()
            tps = tokens_per_iter * (iteration - it_last) / max(now - t_last, 1e-9)
            per_iter = (now - t_start) / (iteration - start_iteration)
            reporter.print(
                f" iteration {iteration:6d}/{args.train_iters:6d} | lm loss {loss:.4f} | lr {lr:.3e} | "
                f"grad norm {grad_norm:.3f} | tokens/s {tps:,.0f} | elapsed {_hms(now - t_start)} | "
                f"ETA {_hms(per_iter * (args.train_iters - iteration))}")
            t_last, it_last = now, iteration
        reporter.record({"iteration": iteration, "lm_loss": loss, "lr": lr,
                         "grad_norm": float(grad_norm) if grad_norm is not None else None,
                         "tokens_per_sec": tokens_per_iter * (iteration - start_iteration) / max(time.time() - t_start, 1e-9)})
        if iteration % args.eval_interval == 0 and iteration < args.train_iters:
            run_evaluations(args, model, data, iteration, reporter)
        if args.save and args.save_interval and iteration % args.save_interval == 0 and iteration < args.train_iters:
            _save(args, iteration, model, optimizer, scheduler, consumed, reporter)
        if deadline and time.time() > deadline:
            reporter.print(f" stopping at iteration {iteration}: --time-limit-minutes {args.time_limit_minutes} reached")
            break
    return iteration, consumed


def _save(args, iteration, model, optimizer, scheduler, consumed, reporter):
    from megatron_delta.checkpointing import save_checkpoint

    path = save_checkpoint(args.save, iteration, model, optimizer, scheduler, consumed, args,
                           save_optim=not args.no_save_optim)
    reporter.print(f" saved checkpoint {path}")


def pretrain(args):
    """Everything after argument parsing: the distributed world is initialised here and torn down."""
    activate_cpu_platform()
    initialize_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.virtual_pipeline_model_parallel_size, args.context_parallel_size, seed=args.seed)
    try:
        return _pretrain(args)
    finally:
        destroy_distributed()


def _pretrain(args):
    from megatron_delta.data import build_tokenizer

    reporter = Reporter(args)
    if is_cpu_platform():
        reporter.print(" " + set_cpu_allocator(args.delta_cpu_allocator))
    _resolve_data(args)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    model, optimizer, scheduler, config = setup_model_and_optimizer(args, tokenizer.vocab_size)
    n_params = sum(p.numel() for m in model for p in m.parameters())
    reporter.print(f" residual {args.residual} | layers {args.num_layers} | hidden {args.hidden_size} | "
                   f"parameters on this rank {n_params:,} | TP {args.tensor_model_parallel_size} PP "
                   f"{args.pipeline_model_parallel_size} DP {args.data_parallel_size} | global batch "
                   f"{args.global_batch_size} x {args.seq_length} tokens | {args.train_iters} iterations")
    report_payload(args, reporter)

    iteration, consumed = 0, 0
    if args.load:
        from megatron_delta.checkpointing import load_checkpoint

        if args.finetune:
            _, _, ckpt = load_checkpoint(args.load, model, None, None, args, load_optim=False, load_rng=False)
        else:
            iteration, consumed, ckpt = load_checkpoint(
                args.load, model, optimizer, scheduler, args,
                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
        reporter.print(f" loaded {ckpt} (iteration {iteration}{', fine-tuning from it' if args.finetune else ''})")
        from megatron_delta.checkpointing import carried_provenance, read_run_config

        # an imported HF model's vocabulary and tokenizer travel on into this run's checkpoints
        args.carried_provenance = carried_provenance(ckpt, read_run_config(ckpt), args)

    data = build_data(args, tokenizer)
    iteration, consumed = train(args, model, optimizer, scheduler, data, iteration, consumed, reporter)
    results = run_evaluations(args, model, data, iteration, reporter, final=True)
    if args.save:
        _save(args, iteration, model, optimizer, scheduler, consumed, reporter)
    return {"iteration": iteration, **{f"{k}_loss": v for k, v in results.items()}}


def report_payload(args, reporter):
    """One start-up line per pipeline boundary: what the routed modes send between stages."""
    if args.residual == "baseline" or args.pipeline_model_parallel_size == 1:
        return
    from megatron_delta.block import describe_stage_payloads

    for line in describe_stage_payloads(args):
        reporter.print(line)


def _quiet_known_warnings():
    """Megatron warns at import that TE/apex are absent: expected on CPU, noise in every run."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def main(argv=None):
    _quiet_known_warnings()
    try:
        args = parse_args(argv)
    except ArgumentError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 2
    from megatron_delta.checkpointing import CheckpointError

    try:
        pretrain(args)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr)
        return 1
    return 0
