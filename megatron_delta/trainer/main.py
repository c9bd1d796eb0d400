"""`pretrain_gpt.py` on Megatron-LM's trainer: ``main(argv=None) -> int``.

    python -c "import sys; from megatron_delta.trainer.main import main; sys.exit(main())" --help
    torchrun --nproc-per-node 2 -m megatron_delta.trainer --tensor-model-parallel-size 2 ...

Flags are Megatron-LM's (megatron.training.arguments) plus the project's (trainer/arguments.py).
One call is one run; several runs may follow each other in one process: torch.distributed stays up
between runs, everything else megatron.training keeps globally is torn down at the end of each run
(training.destroy_global_state, the RNG tracker).

What this adds around ``megatron.training.pretrain`` (each a thin hook, installed for one run and then
removed; the trainer itself is upstream's):
- the router param group (``--router-lr-mult``): get_megatron_optimizer_config returns Megatron's
  standard ``config_overrides``; a routed run adds ParamKey(attr="is_delta_router");
- ``--metrics-file``: JSON lines of what training_log / evaluate already computed;
- ``--train-iters 0 --save DIR`` writes the initial model (upstream saves only at iteration != 0);
- routed modes with PP > 1: the PayloadP2PCommunicator (shape exchange safe for PP=2 + VPP).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Optional, Sequence

from megatron_delta.trainer.arguments import PROG, TrainerArgumentError, add_delta_args, validate_delta_args


def _quiet_known_warnings():
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    warnings.filterwarnings("ignore", message=".*It is recommended to use a ModelConfig.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def _error(msg: str, code: int) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    return code


@contextlib.contextmanager
def _argv(argv: Optional[Sequence[str]]):
    """megatron.training.arguments.parse_args reads sys.argv; prog is pretrain_gpt.py in messages."""
    saved = sys.argv
    sys.argv = [PROG] + list(sys.argv[1:] if argv is None else argv)
    try:
        yield
    finally:
        sys.argv = saved


def parse_args(argv: Optional[Sequence[str]] = None):
    """Megatron-LM's parser + our flags; our validation, then Megatron's (validate_args)."""
    from megatron.training.arguments import parse_args as megatron_parse_args
    from megatron.training.arguments import validate_args

    with _argv(argv):
        args = megatron_parse_args(extra_args_provider=add_delta_args)
    validate_delta_args(args)
    if args.train_iters == 0:
        # Nothing to train: no optimizer (upstream's scheduler needs train iters); the initial model
        # is saved after pretrain (see _save_initial_model).
        args.skip_train = True
    try:
        validate_args(args, {})
    except AssertionError as e:  # upstream validates with asserts, many without a message
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        detail = str(e) or where.line
        raise TrainerArgumentError(f"{detail} (Megatron-LM validate_args, "
                                   f"{os.path.basename(where.filename)}:{where.lineno})") from None
    return args


def _ensure_env():
    """A plain `python` launch is a one-process world (env:// needs an address)."""
    import torch

    if torch.distributed.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        from megatron_delta.cpu_platform import free_port

        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())


# ------------------------------------------------------------------------------------------ hooks
class _Run:
    """The hooks of one run into megatron.training.training (module attributes it looks up by name)."""

    def __init__(self, args):
        self.args = args
        self.model = self.optimizer = self.scheduler = None
        self.metrics = None
        self._saved = []

    def _replace(self, module, name, value):
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def __enter__(self):
        from megatron.training import training as mt

        args = self.args
        if args.metrics_file:
            if args.rank == args.world_size - 1:  # the last rank holds the loss (last pipeline stage)
                os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
                self.metrics = args.metrics_file
        # Replaces training.get_megatron_optimizer_config: Megatron's config and standard overrides,
        # plus the routers' own group (lr x --router-lr-mult, no weight decay).
        original_opt_config = mt.get_megatron_optimizer_config

        def get_megatron_optimizer_config(a):
            config, overrides = original_opt_config(a)
            return config, router_overrides(a, overrides)

        self._replace(mt, "get_megatron_optimizer_config", get_megatron_optimizer_config)
        # Wraps training.setup_model_and_optimizer: keeps the model for the iteration-0 save.
        original_setup = mt.setup_model_and_optimizer

        def setup_model_and_optimizer(*a, **k):
            self.model, self.optimizer, self.scheduler = original_setup(*a, **k)
            return self.model, self.optimizer, self.scheduler

        self._replace(mt, "setup_model_and_optimizer", setup_model_and_optimizer)
        if self.metrics:
            original_log = mt.training_log

            def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                             report_memory_flag, skipped_iter, grad_norm, *a, **k):
                self.record_train(loss_dict, learning_rate, iteration, grad_norm, skipped_iter)
                return original_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                    report_memory_flag, skipped_iter, grad_norm, *a, **k)

            self._replace(mt, "training_log", training_log)
            original_eval = mt.evaluate

            def evaluate(*a, **k):
                out = original_eval(*a, **k)
                if out[0] is not None:
                    self.record_eval(out[0])
                return out

            self._replace(mt, "evaluate", evaluate)
        return self

    def __exit__(self, *exc):
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved.clear()

    def _write(self, record):
        with open(self.metrics, "a") as f:
            f.write(json.dumps(record) + "\n")

    def record_train(self, loss_dict, lr, iteration, grad_norm, skipped):
        loss = loss_dict.get("lm loss")
        self._write({"iteration": int(iteration), "lm_loss": None if loss is None else float(loss),
                     "lr": None if lr is None else float(lr),
                     "grad_norm": None if grad_norm is None else float(grad_norm), "skipped": int(skipped)})

    def record_eval(self, loss_dict):
        from megatron.training import get_args

        loss = loss_dict.get("lm loss")
        if loss is not None:
            self._write({"iteration": int(get_args().curr_iteration), "split": "valid", "lm_loss": float(loss)})


def router_overrides(args, overrides):
    """Megatron's overrides + the routers' param group: lr x --router-lr-mult, no weight decay."""
    if getattr(args, "residual", "baseline") == "baseline":
        return overrides
    from megatron.core.optimizer import ParamGroupOverride, ParamKey

    overrides = dict(overrides or {})
    min_lr = args.min_lr if args.min_lr is not None else 0.0
    if args.router_lr_mult == 1.0:
        # The same override as Megatron's no-weight-decay group, so the routers join that group:
        # two groups with equal settings are confused when an optimizer checkpoint is loaded
        # (torch's load_state_dict: "parameter group that doesn't match the size").
        overrides[ParamKey(attr="is_delta_router")] = ParamGroupOverride(wd_mult=0.0)
    else:
        overrides[ParamKey(attr="is_delta_router")] = ParamGroupOverride(
            max_lr=args.lr * args.router_lr_mult, min_lr=min_lr * args.router_lr_mult, wd_mult=0.0)
    return overrides


def _save_initial_model(run: _Run):
    """`--train-iters 0 --save DIR`: the initial model (upstream pretrain saves only at iteration != 0)."""
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    args = get_args()
    if args.save and args.train_iters == 0 and run.model is not None and args.iteration == 0:
        save_checkpoint(0, run.model, run.optimizer, run.scheduler, 0)


def _p2p_kwargs(args) -> dict:
    """Routed modes with PP > 1: PayloadP2PCommunicator with the process groups pretrain would use.
    The groups must exist first, so Megatron's own initialize_megatron runs before pretrain (which
    finds torch.distributed and the model-parallel state initialised and keeps them)."""
    from megatron_delta.trainer.provider import needs_variable_payload, transformer_config

    if not needs_variable_payload(args):
        return {}
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.initialize import initialize_megatron

    from megatron_delta.payload import _payload_p2p_communicator_class

    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    initialize_megatron()
    destroy_rerun_state_machine()  # pretrain's initialize_megatron builds it again (and asserts it is unset)
    config = transformer_config(args)
    comm = _payload_p2p_communicator_class()(pp_group=parallel_state.get_pipeline_model_parallel_group(),
                                             config=config)
    return {"p2p_communicator": comm, "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}


def reset_global_state():
    """What megatron.training keeps globally, torn down so that another run can follow in-process."""
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.training import global_vars
    from megatron.training.training import destroy_global_state

    destroy_global_state()
    global_vars.unset_global_variables()
    mp_random.initialize_rng_tracker(force_reset=True)


_ATEXIT = []
LAST_RUN: Optional[_Run] = None


def _destroy_at_exit():
    import atexit

    import torch

    if _ATEXIT:
        return

    def destroy():
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(destroy)
    _ATEXIT.append(destroy)


def run(args) -> None:
    """Everything after parsing: CPU adaptation, Megatron's globals, pretrain, the iteration-0 save."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.global_vars import set_global_variables

    from megatron_delta.cpu_platform import is_cpu_platform, set_cpu_allocator
    from megatron_delta.trainer.provider import forward_step, model_provider, train_valid_test_datasets_provider

    if is_cpu_platform():
        line = set_cpu_allocator(args.delta_cpu_allocator)
        if args.rank == 0:
            print(" " + line, flush=True)
    _ensure_env()
    set_global_variables(args)
    try:
        cfg = pretrain_cfg_container_from_args(args)
        with _Run(args) as hooks:
            global LAST_RUN
            LAST_RUN = hooks  # the model and optimizer of the last run (tests look at them)
            kwargs = _p2p_kwargs(args)
            pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                     model_provider=model_provider, **kwargs)
            _save_initial_model(hooks)
    finally:
        _destroy_at_exit()
        reset_global_state()


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_delta.cpu_platform import activate_cpu_platform

    _quiet_known_warnings()
    activate_cpu_platform()  # before Megatron's validate_args, which asks the GPU (TP > 1)
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else 0
    except TrainerArgumentError as e:
        return _error(str(e), 2)
    run(args)
    return 0


if __name__ == "__main__":  # dist_checkpointing starts a multiprocessing manager: keep the guard.
    sys.exit(main())
