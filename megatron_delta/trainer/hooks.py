"""The trainer's hooks into megatron.training: :class:`RunHooks`, installed for one run (``with RunHooks(args)``)
and then removed; the registry entry ``trainer_hooks`` of megatron_delta.platform.patches.

Megatron-LM's trainer looks these functions up as module attributes at call time, so each hook replaces or
wraps one upstream function for the run (the list is RunHooks' docstring; each override says in one line
which upstream function it replaces and why). :func:`router_overrides` is the routers' parameter group.
"""
from __future__ import annotations

import json
import os
import sys
import time

from megatron_delta.core.modes import BASELINE
from megatron_delta.trainer.arguments import PROG


class RunHooks:
    """The hooks of one run into megatron.training (module attributes it looks up by name at call time): the
    registry entry ``trainer_hooks`` of megatron_delta.platform.patches.

    Each replaces or wraps one upstream function for the duration of the run (``with RunHooks(args)``):
    training.get_megatron_optimizer_config   + the routers' param group (--delta-router-lr-mult)
    training.setup_model_and_optimizer       first: the lock of --save (rank 0); keeps model/optimizer; payload
                                             lines (routed, PP > 1)
    training.load_checkpoint                 first: the fresh-start line; the checkpoint to load exists, its files
                                             verified (run_config.json included; a line when unverified);
                                             run_config.json's model flags == the run's
    training.train                           the clock of tokens_per_sec
    training.training_log                    metrics: iteration, lm_loss, lr, grad_norm, tokens_per_sec
    training.evaluate                        captures the loss dict of each evaluation
    training.evaluate_and_print_results      metrics per split (valid / test), then --delta-heldout-data-path
                                             and the routing statistics beside every validation
    checkpointing.save_checkpoint (+ training's name for it)
                                             first: no NaN / inf parameter (checkpoint/finite.py); SIGINT held
                                             until the save has finished
    checkpointing.get_checkpoint_tracker_filename
                                             run_config.json into iter_NNNNNNN/ (and its hash into
                                             integrity.json) before the tracker names it
    """

    def __init__(self, args):
        self.args = args
        self.model = self.optimizer = self.scheduler = None
        self.metrics = None
        self.last_rank = args.rank == args.world_size - 1  # holds the loss (last pipeline stage)
        self.datasets = {}  # "valid", "heldout": for the extra evaluations
        self.carried = {}  # HF provenance of a loaded checkpoint, carried into this run's checkpoints
        self.saving = None  # (iteration, optimizer) while upstream's save_checkpoint runs
        self.saved = []  # iteration directories written
        self.results = {}  # split -> last lm loss
        self.routing = None  # last routing statistics
        self._captured = []
        self._clock = None
        self._saved = []
        self.lock = None  # checkpoint.save_lock.SaveDirLock of --save (rank 0)

    def _replace(self, module, name, value):
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def __enter__(self):
        from megatron.training import checkpointing as ckpt
        from megatron.training import training as mt

        from megatron_delta.platform import patches

        args = self.args
        written_for, why = patches.applies(patches.entry("trainer_hooks"))
        if not written_for and args.rank == 0:
            print(f" warning: the trainer's hooks into megatron.training are untested here: {why}", flush=True)
        if args.delta_metrics_file and self.last_rank:
            os.makedirs(os.path.dirname(os.path.abspath(args.delta_metrics_file)), exist_ok=True)
            self.metrics = args.delta_metrics_file
        # Replaces training.get_megatron_optimizer_config: Megatron's config and standard overrides,
        # plus the routers' own group (lr x --delta-router-lr-mult, no weight decay).
        original_opt_config = mt.get_megatron_optimizer_config

        def get_megatron_optimizer_config(a):
            config, overrides = original_opt_config(a)
            return config, router_overrides(a, overrides)

        self._replace(mt, "get_megatron_optimizer_config", get_megatron_optimizer_config)
        # Wraps training.setup_model_and_optimizer: keeps the model for the iteration-0 save.
        original_setup = mt.setup_model_and_optimizer

        def setup_model_and_optimizer(*a, **k):
            if self.args.save:  # one writer per --save directory, before anything is built or loaded
                from megatron_delta.checkpoint.save_lock import acquire_on_rank0

                self.lock = acquire_on_rank0(self.args.save)
                if self.lock is not None and self.lock.message:
                    print(f" {self.lock.message}", flush=True)
            self.print_payload()
            self.model, self.optimizer, self.scheduler = original_setup(*a, **k)
            from megatron_delta.core.source_cache import link_chunks

            link_chunks(self.model)  # the rank's chunks share one pipeline source cache (interleaved schedule)
            return self.model, self.optimizer, self.scheduler

        self._replace(mt, "setup_model_and_optimizer", setup_model_and_optimizer)
        # Wraps training.load_checkpoint: the model-flag check of run_config.json first (one line naming
        # the flags instead of a shape error deep in dist_checkpointing), the HF provenance to carry on.
        original_load = mt.load_checkpoint

        def load_checkpoint(*a, **k):
            from megatron_delta.checkpoint.integrity import verify_before_load
            from megatron_delta.checkpoint.run_config import check_load

            self.announce_fresh_start()
            ckpt = self.checkpoint_to_load()
            # its files (run_config.json included) verified before anything of it is read (every rank: rank 0
            # hashes, the others learn its answer); upstream's load then does not hash them again
            note = verify_before_load(ckpt, self.args.verify_integrity) if ckpt else None
            if note and torch_rank() == 0:
                print(f" {note}", flush=True)
            self.carried = check_load(self.args)
            verify, self.args.verify_integrity = self.args.verify_integrity, False
            try:
                return original_load(*a, **k)
            finally:
                self.args.verify_integrity = verify

        self._replace(mt, "load_checkpoint", load_checkpoint)
        # Wraps checkpointing.save_checkpoint (and training's import of it): notes which iteration is being saved.
        original_save = ckpt.save_checkpoint

        def save_checkpoint(iteration, model, optimizer, *a, **k):
            from megatron_delta.checkpoint.finite import check_before_save

            check_before_save(iteration, model, self.args.save)  # a NaN / inf is never saved (every rank)
            with sigint_deferred(iteration):  # Ctrl-C during the save: the save finishes first
                self.saving = (iteration, optimizer)
                try:
                    return original_save(iteration, model, optimizer, *a, **k)
                finally:
                    self.saving = None

        self._replace(ckpt, "save_checkpoint", save_checkpoint)
        self._replace(mt, "save_checkpoint", save_checkpoint)
        # Wraps checkpointing.get_checkpoint_tracker_filename: run_config.json goes in before the tracker names the
        # save.
        original_tracker = ckpt.get_checkpoint_tracker_filename

        def get_checkpoint_tracker_filename(checkpoints_path):
            # upstream save_checkpoint asks for it on rank 0 after the data is written and before it
            # writes the tracker: run_config.json goes in now
            if self.saving is not None and torch_rank() == 0:
                iteration, optimizer = self.saving
                from megatron_delta.checkpoint.integrity import add_to_manifest
                from megatron_delta.checkpoint.run_config import RUN_CONFIG, write_run_config

                self.saved.append(write_run_config(
                    checkpoints_path, iteration, self.args,
                    has_optimizer=optimizer is not None and not self.args.no_save_optim, carried=self.carried))
                # a synchronous save has written integrity.json already: run_config.json's hash goes in (an
                # asynchronous one writes it later, over every file, this one included)
                add_to_manifest(self.saved[-1], RUN_CONFIG)
            return original_tracker(checkpoints_path)

        self._replace(ckpt, "get_checkpoint_tracker_filename", get_checkpoint_tracker_filename)
        # Wraps training.train: starts the clock of tokens_per_sec.
        original_train = mt.train

        def train(*a, **k):
            self._clock = (time.time(), self.args.iteration)
            return original_train(*a, **k)

        self._replace(mt, "train", train)
        # Wraps training.training_log: one metrics line per iteration (--delta-metrics-file).
        original_log = mt.training_log

        def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                         report_memory_flag, skipped_iter, grad_norm, *a, **k):
            if not skipped_iter:
                self.record_train(loss_dict, learning_rate, iteration, grad_norm)
            return original_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                report_memory_flag, skipped_iter, grad_norm, *a, **k)

        self._replace(mt, "training_log", training_log)
        # Wraps training.evaluate: captures each evaluation's loss dict for the metrics.
        original_eval = mt.evaluate

        def evaluate(*a, **k):
            out = original_eval(*a, **k)
            self._captured.append(out[0])
            return out

        self._replace(mt, "evaluate", evaluate)
        # Wraps training.evaluate_and_print_results: metrics per split, then the held-out set and the routing
        # statistics.
        original_eapr = mt.evaluate_and_print_results

        def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                                       process_non_loss_data_func, config, verbose=False,
                                       write_to_tensorboard=True, non_loss_data_func=None, pg_collection=None,
                                       p2p_communicator=None):
            split = "test" if "on test set" in prefix else "valid"
            final = "on validation set" in prefix or "on test set" in prefix
            comm = dict(pg_collection=pg_collection, p2p_communicator=p2p_communicator)
            self._captured = []
            original_eapr(prefix, forward_step_func, data_iterator, model, iteration, process_non_loss_data_func,
                          config, verbose, write_to_tensorboard, non_loss_data_func, **comm)
            self.record_eval(split, iteration, final)
            if split != "valid":
                return
            consumed_valid = self.args.consumed_valid_samples  # upstream's evaluate counts every sample
            try:
                heldout = self.datasets.get("heldout")
                if heldout is not None:
                    from megatron_delta.evaluation.in_training import fresh_iterator

                    self._captured = []
                    where = prefix.replace(" on validation set", "")
                    original_eapr(f"{where} on heldout set", forward_step_func, fresh_iterator(heldout, len(model)),
                                  model, iteration, process_non_loss_data_func, config, verbose, False,
                                  non_loss_data_func, **comm)
                    self.record_eval("heldout", iteration, final)
                if self.args.residual != BASELINE and self.datasets.get("valid") is not None:
                    from megatron_delta.evaluation.in_training import routing_statistics

                    self.record_routing(iteration, routing_statistics(
                        original_eval, forward_step_func, self.datasets["valid"], model, config, **comm))
            finally:
                self.args.consumed_valid_samples = consumed_valid

        self._replace(mt, "evaluate_and_print_results", evaluate_and_print_results)
        return self

    def __exit__(self, *exc):
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved.clear()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def checkpoint_to_load(self):
        """The iteration directory upstream's load will read (None: nothing to load). A tracker that cannot be
        read, or an iteration directory that does not exist, is a CheckpointError naming it, with the complete
        checkpoints on disk."""
        from megatron_delta.checkpoint.errors import CheckpointError, resume_advice
        from megatron_delta.checkpoint.run_config import TRACKER, iteration_dir, read_tracker

        load = self.args.load
        if not load or not os.path.isdir(load):
            return None
        step = getattr(self.args, "ckpt_step", None)
        named_by = "--ckpt-step"
        if step is None:
            step, named_by = read_tracker(load), os.path.join(load, TRACKER)
            if step is None:
                return None
        ckpt = iteration_dir(load, step)
        if not os.path.isdir(ckpt):
            raise CheckpointError(f"cannot load the checkpoint of iteration {step}: {ckpt} does not exist "
                                  f"({named_by} names it). " + resume_advice(load, step))
        return ckpt

    def announce_fresh_start(self):
        """--load given, nothing there to load: one line on stderr with the path (upstream's two WARNING lines
        are lost among the start-up output). --save X --load X then starts fresh, as it should."""
        from megatron_delta.checkpoint.run_config import TRACKER

        load = self.args.load
        if not load or getattr(self.args, "ckpt_step", None) is not None or torch_rank() != 0:
            return
        if not os.path.isdir(load):
            why = "does not exist"
        elif not os.path.isfile(os.path.join(load, TRACKER)):
            why = f"holds no checkpoint (no {TRACKER})"
        else:
            return
        print(f"{PROG}: warning: --load {load} {why}: this run STARTS FROM SCRATCH (random weights, iteration 0)",
              file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- records (last rank writes)
    def _write(self, record):
        if self.metrics:
            with open(self.metrics, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _print(self, line):
        if self.last_rank:
            print(line, flush=True)

    def print_payload(self):
        """Start-up lines of routed modes with PP > 1: what crosses each pipeline boundary (describe_stage_payloads)."""
        args = self.args
        if args.residual == BASELINE or args.pipeline_model_parallel_size == 1:
            return
        from megatron_delta.core.payload import describe_stage_payloads
        from megatron_delta.trainer.provider import transformer_config

        for line in describe_stage_payloads(transformer_config(args), args.seq_length, args.micro_batch_size):
            self._print(line)

    def record_train(self, loss_dict, lr, iteration, grad_norm):
        loss = loss_dict.get("lm loss")
        start, first = self._clock or (time.time(), iteration - 1)
        tokens = self.args.global_batch_size * self.args.seq_length * (iteration - first)
        self._write({"iteration": int(iteration), "lm_loss": None if loss is None else float(loss),
                     "lr": None if lr is None else float(lr),
                     "grad_norm": None if grad_norm is None else float(grad_norm),
                     "tokens_per_sec": tokens / max(time.time() - start, 1e-9)})

    def record_eval(self, split, iteration, final):
        import math

        captured = [c for c in self._captured if c]
        self._captured = []
        if not captured or "lm loss" not in captured[-1]:
            return
        loss = float(captured[-1]["lm loss"])
        ppl = math.exp(min(loss, 50.0))
        self.results[split] = loss
        tag = " (final)" if final else ""
        self._print(f" validation{tag} [{split}] at iteration {iteration} | lm loss {loss:.4f} | ppl {ppl:.3f}")
        self._write({"iteration": int(iteration), "split": split, "lm_loss": loss, "ppl": ppl})

    def record_routing(self, iteration, routing):
        if routing is None:
            return
        self.routing = routing["stats"]
        self._print(routing["text"])
        self._write({"iteration": int(iteration), "routing": routing["stats"]})


class sigint_deferred:
    """SIGINT (Ctrl-C) during a save is held until the save has finished, then raised as KeyboardInterrupt: the
    checkpoint being written is completed and its tracker written. A second SIGINT stops at once (leaving that
    save unfinished: it is never loaded, the tracker still names the previous one)."""

    def __init__(self, iteration):
        self.iteration = iteration
        self.received = False
        self.previous = None

    def _handler(self, signum, frame):
        if self.received:
            raise KeyboardInterrupt
        self.received = True  # quietly: the run's one line comes when it ends (trainer/main.py)

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, exc_type, exc, tb):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if self.received and exc_type is None:
            raise KeyboardInterrupt
        return False


def torch_rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def router_overrides(args, overrides):
    """Megatron's overrides + the routers' param group: lr x --delta-router-lr-mult, no weight decay."""
    if getattr(args, "residual", BASELINE) == BASELINE:
        return overrides
    from megatron.core.optimizer import ParamGroupOverride, ParamKey

    overrides = dict(overrides or {})
    min_lr = args.min_lr if args.min_lr is not None else 0.0
    if args.delta_router_lr_mult == 1.0:
        # The same override as Megatron's no-weight-decay group, so the routers join that group:
        # two groups with equal settings are confused when an optimizer checkpoint is loaded
        # (torch's load_state_dict: "parameter group that doesn't match the size").
        overrides[ParamKey(attr="is_delta_router")] = ParamGroupOverride(wd_mult=0.0)
    else:
        overrides[ParamKey(attr="is_delta_router")] = ParamGroupOverride(
            max_lr=args.lr * args.delta_router_lr_mult, min_lr=min_lr * args.delta_router_lr_mult, wd_mult=0.0)
    return overrides
