"""`pretrain_gpt.py` on Megatron-LM's trainer: ``main(argv=None) -> int``.

    python -c "import sys; from megatron_delta.trainer.main import main; sys.exit(main())" --help
    torchrun --nproc-per-node 2 -m megatron_delta.trainer --tensor-model-parallel-size 2 ...

Flags are Megatron-LM's (megatron.training.arguments) plus the project's (trainer/arguments.py).
One call is one run; several runs may follow each other in one process: torch.distributed stays up
between runs, everything else megatron.training keeps globally is torn down at the end of each run
(training.destroy_global_state, the RNG tracker).

What this adds around ``megatron.training.pretrain`` (each a thin hook, installed for one run and then
removed; the trainer itself is upstream's; the list is RunHooks' docstring (trainer/hooks.py)):
- the router param group (``--delta-router-lr-mult``): get_megatron_optimizer_config returns Megatron's
  standard ``config_overrides``; a routed run adds ParamKey(attr="is_delta_router");
- ``--delta-metrics-file``: JSON lines - per iteration {"iteration", "lm_loss",
  "lr", "grad_norm", "tokens_per_sec"}, per evaluation {"iteration", "split", "lm_loss", "ppl"} with
  split "valid" / "heldout" ("test" for upstream's test split), per evaluation of a routed mode
  {"iteration", "routing": {...}}; the lines ` validation[ (final)] [split] at iteration N | lm loss
  | ppl` and the routing table are printed;
- ``--delta-heldout-data-path`` and the routing statistics beside every validation (evaluation/in_training.py);
- routed modes with PP > 1: the start-up payload lines and the PayloadP2PCommunicator (shape
  exchange safe for PP=2 + VPP);
- ``run_config.json`` in every iter_NNNNNNN/ saved, before the tracker names it, and the model-flag
  check of ``--load`` (checkpoint/run_config.py);
- ``--train-iters 0 --save DIR`` writes the initial model (upstream saves only at iteration != 0);
- the lock of ``--save`` (checkpoint/save_lock.py), taken before the model is built: one writer per directory;
- ``--load`` with nothing to load: one warning line with the path; a checkpoint without integrity.json loads
  unverified with a line (integrity checking is on by default: checkpoint/integrity.py);
- no data flags: the embedded default run (trainer/embedded.py);
- data / tokenizer / checkpoint errors after start-up: ``pretrain_gpt.py: error: ...``, exit code 1
  (checkpoint/errors: a damaged checkpoint file named by describe_load_failure, a full --save
  filesystem by describe_save_failure, schedule flags that differ from the checkpoint's by
  describe_schedule_mismatch; a file failing its integrity hash: checkpoint/integrity.describe_mismatch);
- a NaN / inf parameter before a save: one line (checkpoint/finite.py), nothing saved, the tracker unmoved;
- SIGINT (Ctrl-C): a save under way finishes first, then one line naming the last complete checkpoint, from
  global rank 0, exit status 130;
- argument errors: one line (argparse's after a short usage, not Megatron-LM's usage of every flag), printed
  once per launch (global rank 0).

These hooks, like every other change of upstream behaviour (the CPU adaptation, the fixes of the distributed
optimizer over torch's Adam on every device), are entries of the registry megatron_delta.platform.patches
(``trainer_hooks``, ``checkpoint_hint``, ``p2p_shape_exchange``). Known upstream warnings are silenced only
around the upstream calls that emit them (patches.known_warnings_quieted); no process-wide filter is added.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from typing import Optional, Sequence

from megatron_delta.trainer.arguments import (
    PROG,
    TrainerArgumentError,
    add_delta_args,
    check_paths,
    resolve_pp_source_cache,
    validate_delta_args,
)
from megatron_delta.trainer.hooks import RunHooks, torch_rank

# An argparse error, without Megatron-LM's usage of its ~850 flags
SHORT_USAGE = f"usage: {PROG} [FLAGS ...]   ({PROG} --help lists Megatron-LM's flags and the project's)"


def _error(msg: str, code: int) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
    return code


# How long a rank that does not print an argument error waits before it exits with its status: torchrun stops
# every rank once one exits, so a silent rank that exited first could stop rank 0 before it had printed the error
# (seen: the launch ended with no error line). Rank 0 exits at once; torchrun then stops the waiting ranks.
SILENT_RANK_EXIT_DELAY_S = 10.0


def _prints_start_up_errors() -> bool:
    """An argument error is the same on every rank of a launch: global rank 0 prints it once (RANK, else
    LOCAL_RANK, 0 or unset), the others only exit with its status (after SILENT_RANK_EXIT_DELAY_S)."""
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    return rank.strip() in ("", "0")


class ArgparseError(TrainerArgumentError):
    """argparse's own error (unknown flag, bad choice / type): printed after SHORT_USAGE."""


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

    # argparse prints Megatron-LM's whole usage before its error line: kept aside, the error line is kept
    captured = io.StringIO()
    with _argv(argv):
        try:
            with contextlib.redirect_stderr(captured):
                args = megatron_parse_args(extra_args_provider=add_delta_args)
        except SystemExit as e:
            if e.code in (0, None):
                raise
            prefix = f"{PROG}: error: "
            lines = [ln for ln in captured.getvalue().splitlines() if ln.startswith(prefix)]
            if not lines:
                sys.stderr.write(captured.getvalue())
                raise
            raise ArgparseError(lines[-1][len(prefix):]) from None
    sys.stderr.write(captured.getvalue())  # anything else the parser said
    validate_delta_args(args)
    check_paths(args)  # before validate_args prints the arguments
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
    except (ValueError, OSError, KeyError, TypeError) as e:
        # validate_model_config_args_from_heterogeneous_config reads the file and compares the flags with it
        if not getattr(args, "heterogeneous_layers_config_path", None):
            raise
        raise TrainerArgumentError(f"--heterogeneous-layers-config-path {args.heterogeneous_layers_config_path}: "
                                   f"{e} (Megatron-LM validate_args); pass flags that match the file") from None
    resolve_pp_source_cache(args)
    check_config_class_builds(args)
    return args


def check_config_class_builds(args) -> None:
    """--multi-latent-attention, --heterogeneous-layers-config-path: build the config once at start-up, so that what
    MLATransformerConfig / HeterogeneousTransformerConfig refuses (e.g. its output gate, --cache-mla-latents with
    RoPE fusion, a block config it cannot read) is Megatron's line before the distributed start-up, not a
    traceback from the model provider."""
    if not (getattr(args, "multi_latent_attention", False) or getattr(args, "heterogeneous_layers_config_path", None)):
        return
    from megatron_delta.trainer.provider import transformer_config

    try:
        transformer_config(args)
    except (ValueError, AssertionError, NotImplementedError, KeyError) as e:
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        raise TrainerArgumentError(f"{' '.join(str(e).split()) or where.line} (Megatron-Core "
                                   f"{os.path.basename(where.filename)}:{where.lineno})") from None


_OWN_ADDRESS = None  # the (MASTER_ADDR, MASTER_PORT) _ensure_env set for a one-process world


def _ensure_env():
    """A plain `python` launch is a one-process world (env:// needs an address). Returns the store it meets in
    (None: the launcher's rendezvous at MASTER_ADDR:MASTER_PORT)."""
    import torch

    global _OWN_ADDRESS
    if torch.distributed.is_initialized():
        return None
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        from megatron_delta.platform.distributed import free_port

        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        _OWN_ADDRESS = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == _OWN_ADDRESS and os.environ.get("WORLD_SIZE") == "1":
        # In memory, not a TCP store on that port: a port found free can be taken by another process on this host
        # before the store binds it (EADDRINUSE), and one process has no one to meet.
        return torch.distributed.HashStore()
    return None


def _save_initial_model(run: RunHooks):
    """`--train-iters 0 --save DIR`: the initial model (upstream pretrain saves only at iteration != 0)."""
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    args = get_args()
    if args.save and args.train_iters == 0 and run.model is not None and args.iteration == 0:
        save_checkpoint(0, run.model, run.optimizer, run.scheduler, 0)


def _elastic_attempt_store(args):
    """torchrun --max-restarts: a restarted worker group meets the agent's TCPStore with the failed attempt's
    keys still in it (torch/distributed/rendezvous.py:186-195 adds no per-attempt prefix), and gloo then
    dials the dead worker's address. Each attempt gets a store of its own (pretrain passes `store` to
    init_process_group, megatron/training/initialize.py:337). None outside an elastic agent."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime

    import torch

    agent = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), args.world_size,
                                       is_master=False,
                                       timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    return torch.distributed.PrefixStore(f"attempt_{attempt}", agent)


def _p2p_kwargs(args, store=None) -> dict:
    """Routed modes with PP > 1: PayloadP2PCommunicator with the process groups pretrain would use.
    The groups must exist first, so Megatron's own initialize_megatron runs before pretrain (which
    finds torch.distributed and the model-parallel state initialised and keeps them)."""
    from megatron_delta.trainer.provider import needs_variable_payload, transformer_config

    if not needs_variable_payload(args):
        return {}
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training.initialize import initialize_megatron

    from megatron_delta.core.payload import schedule_communication_kwargs

    initialize_megatron(store=store)
    destroy_rerun_state_machine()  # pretrain's initialize_megatron builds it again (and asserts it is unset)
    return schedule_communication_kwargs(transformer_config(args))


def reset_global_state():
    """What megatron.training keeps globally, torn down so that another run can follow in-process."""
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.training import global_vars
    from megatron.training.training import destroy_global_state

    if global_vars._GLOBAL_SIGNAL_HANDLER is not None:  # --exit-signal-handler: give SIGTERM back
        global_vars._GLOBAL_SIGNAL_HANDLER.release()  # (upstream's teardown only drops the reference)
    from megatron_delta.platform.distributed import release_model_parallel

    destroy_global_state()
    release_model_parallel()  # destroy_global_state leaves each group registered, with its gloo threads
    global_vars.unset_global_variables()
    mp_random.initialize_rng_tracker(force_reset=True)
    MTPLossLoggingHelper.tracker.clear()  # its loss tensors are sized by the first run's --mtp-num-layers


_ATEXIT = []
LAST_RUN: Optional[RunHooks] = None


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
    from megatron.training import training as mt
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.global_vars import set_global_variables

    from megatron_delta.platform.cpu import is_cpu_platform, set_cpu_allocator
    from megatron_delta.platform.patches import known_warnings_quieted
    from megatron_delta.trainer.provider import forward_step, model_provider, train_valid_test_datasets_provider

    if is_cpu_platform():
        line = set_cpu_allocator(args.delta_cpu_allocator)
        if args.rank == 0:
            print(" " + line, flush=True)
    one_process_store = _ensure_env()
    try:
        if args.tokenizer_type == "SentencePieceTokenizer":
            from megatron_delta.data.tokenizers import _check_sentencepiece_model

            _check_sentencepiece_model(args.tokenizer_model)  # ValueError naming --tokenizer-model
        set_global_variables(args)  # builds the tokenizer
        with known_warnings_quieted():  # model_config_recommended
            cfg = pretrain_cfg_container_from_args(args)
        with RunHooks(args) as hooks:
            global LAST_RUN
            LAST_RUN = hooks  # the model and optimizer of the last run (tests look at them)
            store = _elastic_attempt_store(args) or one_process_store
            kwargs = _p2p_kwargs(args, store)
            # --exit-duration-in-mins counts from this run's start (upstream's clock starts at import)
            mt.set_startup_timestamps(program_start=time.time())
            with known_warnings_quieted():  # all_gather_into_tensor, sharded_tensor, no_pin_memory: upstream's
                pretrain(cfg, _datasets_provider(hooks, train_valid_test_datasets_provider),
                         ModelType.encoder_or_decoder, forward_step, model_provider=model_provider, store=store,
                         **kwargs)
                _save_initial_model(hooks)
    finally:
        _destroy_at_exit()
        reset_global_state()


def _datasets_provider(hooks: RunHooks, provider):
    """Upstream's datasets provider, keeping the validation dataset and building --delta-heldout-data-path's
    beside it (every rank, once) for the extra evaluations of RunHooks."""

    def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
        train, valid, test = provider(train_val_test_num_samples, vp_stage=vp_stage)
        hooks.datasets["valid"] = valid
        args = hooks.args
        if args.delta_heldout_data_path and "heldout" not in hooks.datasets:
            from megatron.training import get_tokenizer

            from megatron_delta.evaluation.in_training import build_heldout_dataset

            hooks.datasets["heldout"] = build_heldout_dataset(args, get_tokenizer())
        return train, valid, test

    train_valid_test_datasets_provider.is_distributed = getattr(provider, "is_distributed", False)
    return train_valid_test_datasets_provider


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_delta.platform.cpu import activate_cpu_platform
    from megatron_delta.platform.patches import import_megatron

    import_megatron(training=True)  # its import-time notices quieted (patches.KNOWN_WARNINGS)
    activate_cpu_platform()  # every-device fixes; on CPU before Megatron's validate_args asks the GPU (TP > 1)
    from megatron_delta.trainer.embedded import EmbeddedRunError, embedded_argv, is_embedded

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if is_embedded(argv):
            argv = embedded_argv(argv)
        args = parse_args(argv)
    except SystemExit as e:  # argparse: --help (0)
        return e.code if isinstance(e.code, int) else 0
    except (TrainerArgumentError, EmbeddedRunError) as e:
        if not _prints_start_up_errors():
            time.sleep(SILENT_RANK_EXIT_DELAY_S)  # rank 0 prints first (torchrun stops this rank once it exits)
            return 2
        if isinstance(e, ArgparseError):
            print(SHORT_USAGE, file=sys.stderr)
        return _error(str(e), 2)
    from megatron_delta.checkpoint.finite import NonFiniteState
    from megatron_delta.checkpoint.integrity import describe_mismatch, is_integrity_failure
    from megatron_delta.checkpoint.save_lock import SaveDirInUse

    interrupted = _SigintSeen()
    try:
        with interrupted:
            run(args)
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(e, SystemExit) and e.code == 0:  # --exit-interval / -duration / signal: saved, done
            return 0
        # SIGINT (Ctrl-C) on every rank of the job; rank 0 says it. A rank interrupted inside a collective may
        # end with its peer's failure (a closed connection) instead of KeyboardInterrupt: the signal decides.
        if isinstance(e, KeyboardInterrupt) or interrupted.seen:
            # Under megatron_delta.trainer.launch a worker exits 0 and the launcher exits 130: torchrun's agent
            # stops every rank (SIGTERM) as soon as one exits non-zero, before rank 0 - maybe still in a collective
            # until its peers have left - has finished a save under way or printed the line.
            status = 0 if os.environ.get(LAUNCHED_BY) == "1" else SIGINT_STATUS
            if torch_rank() == 0:
                return _error(interrupted_message(args), status)
            if status:
                time.sleep(SILENT_RANK_EXIT_DELAY_S)  # rank 0 prints first (torchrun stops this rank once it exits)
            return status
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if isinstance(e, (SaveDirInUse, NonFiniteState)):  # every rank raises it; rank 0 says it
            return _error(str(e), 1) if torch_rank() == 0 else 1
        if is_integrity_failure(e):  # rank 0 verified and broadcast the failure: every rank raised it
            if torch_rank() != 0:
                return 1
            message = describe_mismatch(e, args.load, args.ckpt_step)  # the damaged file, the last good checkpoint
            if message is not None:
                return _error(message, 1)
        from megatron_delta.checkpoint.errors import (
            describe_load_failure,
            describe_save_failure,
            describe_schedule_mismatch,
        )

        message = (describe_load_failure(e, args.load, args.ckpt_step)  # a damaged checkpoint file
                   or describe_save_failure(e, args.save))  # --save's filesystem full
        if message is not None:
            return _error(message, 1)
        message = describe_schedule_mismatch(e, args)  # schedule flags differ from --load's checkpoint
        if message is not None:  # the same flags on every rank: every rank raised it; rank 0 says it
            return _error(message, 1) if torch_rank() == 0 else 1
        if isinstance(e, _run_errors()) or _WRONG_HINT in str(e):  # data / tokenizer / checkpoint flags
            return _error(run_error_message(e), 1)
        raise  # anything else keeps its traceback
    if LAST_RUN is not None and LAST_RUN.saved and args.rank == 0:
        print(f" saved checkpoint {LAST_RUN.saved[-1]}", flush=True)
    return 0


SIGINT_STATUS = 130  # 128 + SIGINT, as a shell reports a job stopped by Ctrl-C
LAUNCHED_BY = "MEGATRON_DELTA_LAUNCH"  # "1" in the workers of megatron_delta.trainer.launch (it sets it)


class _SigintSeen:
    """SIGINT raises KeyboardInterrupt, as Python's default handler does, and is remembered (``seen``) for the run."""

    def __init__(self):
        self.seen = False
        self.previous = None

    def _handler(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False


def interrupted_message(args) -> str:
    """The line of a run stopped by SIGINT: the last complete checkpoint, which the tracker names (a save under
    way when the signal came was finished first: hooks.sigint_deferred)."""
    from megatron_delta.checkpoint.finite import last_complete

    good = last_complete(args.save)
    if good is not None:
        return (f"interrupted (SIGINT): the last complete checkpoint is iteration {good[0]} ({good[1]}), which "
                f"{good[2]} names; resume with --load {args.save}")
    if args.save:
        return f"interrupted (SIGINT): no checkpoint was saved in {args.save}"
    return "interrupted (SIGINT): nothing was saved (no --save)"


def _run_errors():
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from megatron_delta.checkpoint.errors import CheckpointError

    return (CheckpointError, CheckpointingException, ValueError, FileNotFoundError, OSError)


# training/checkpointing.py:2251 (0.19.2): a distributed-optimizer checkpoint loaded into another TP/PP
# layout; its RuntimeError names --ckpt-fully-parallel-save, which does not choose the loadable format (registry
# entry checkpoint_hint of megatron_delta.platform.patches)
_WRONG_HINT = "Please use `--ckpt-fully-parallel-save` flag during checkpoint saving"


def run_error_message(e: BaseException) -> str:
    """One line for the data / tokenizer / checkpoint errors after start-up (``pretrain_gpt.py: error: ...``)."""
    msg = " ".join(str(e).split()) or type(e).__name__
    msg = msg.replace(_WRONG_HINT, "Save the checkpoint with --dist-ckpt-optim-fully-reshardable, or load it "
                                   "with --no-load-optim")
    if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in msg:
        msg = f"{msg}: {e.filename}"
    return msg


if __name__ == "__main__":  # dist_checkpointing starts a multiprocessing manager: keep the guard.
    sys.exit(main())
