"""What the fork server of tests/helpers/dist_utils.py prepares before it forks ranks: what every rank of the suite
imports first (torch, Megatron-Core, Megatron-LM through megatron_delta.platform.patches.import_megatron, which quiets
their import-time notices as the trainer does, and the rank-side test code), and Megatron's compiled helpers, compiled.
Nothing here creates a process group or leaves a thread or a child process running: the server forks from here.

Why compile here: Megatron-Core torch.compile's a few small helpers (the SwiGLU fusion and its backward, the MoE
experts' weighted SwiGLU, the fused bias-dropout-add) and Megatron-LM's initialize compiles two of them at start-up
(set_jit_fusion_options' warm-up). Each process that trains traces and compiles them again: ~3 CPU-seconds a rank
(inductor's FX graph cache spares only the C++ build), a few hundred ranks a session. Compiled here once, for the
argument patterns the trainer uses (requires_grad, grad mode, fp32 and bf16) at two shapes each - so that dynamo
keeps a dynamic-shape graph for any size - every forked rank finds them compiled: the same functions, the same
generated code for every rank and the session's TP1 reference alike. On CPU, inductor first probes which vector
instruction sets the host C++ compiler builds (~4 s): done here too, and inherited.
"""
from torch._inductor import cpu_vec_isa

from megatron_delta.platform.patches import import_megatron

import_megatron(training=True)

import megatron.core.tokenizers.text  # noqa: E402,F401  (transformers: every run builds its tokenizer)
import megatron.core.transformer.moe.moe_layer  # noqa: E402,F401

import megatron_delta.trainer.main  # noqa: E402,F401
import tests.helpers.dist_utils  # noqa: E402,F401
import tests.helpers.rank_runner  # noqa: E402,F401

cpu_vec_isa.valid_vec_isa_list()


def compile_megatron_helpers() -> None:
    """Call each compiled helper the model calls inside its autograd Functions (grad mode off; MLP's bias_swiglu_impl
    and the experts' weighted_bias_swiglu_impl: forward in training and in evaluation, and the backward's helper), in
    fp32 and bf16, at two shapes. Only these: compiling a helper with grad mode on (Megatron-LM's start-up warm-up of
    bias_swiglu and bias_dropout_add) starts autograd's device threads, and a process must not fork after that.
    Inductor compiles without its pool of worker processes here (compile_threads = 1) for the same reason."""
    import torch
    from megatron.core.fusions.fused_bias_swiglu import swiglu, swiglu_back, weighted_swiglu, weighted_swiglu_back
    from torch._inductor import config as inductor_config

    threads = inductor_config.compile_threads
    inductor_config.compile_threads = 1
    try:
        with torch.no_grad():
            for dtype in (torch.float32, torch.bfloat16):
                for tokens, ffn in ((64, 192), (45, 56)):
                    for grad in (True, False):  # training (the input requires grad) and evaluation
                        y = torch.rand(tokens, 2 * ffn, dtype=dtype, requires_grad=grad)
                        probs = torch.rand(tokens, 1, dtype=torch.float32, requires_grad=grad)
                        swiglu(y)
                        weighted_swiglu(y, probs)
                    g = torch.rand(tokens, ffn, dtype=dtype)
                    swiglu_back(g, y.requires_grad_())
                    weighted_swiglu_back(g, y, probs.requires_grad_())
    finally:
        inductor_config.compile_threads = threads


compile_megatron_helpers()


def _stop_tqdm_monitor() -> None:
    """Inductor's FX interpreter opens a (disabled) tqdm bar while it compiles a graph its cache does not hold - on a
    fresh machine, every helper above - and tqdm starts its monitor thread for the first bar, a thread that runs
    until told to stop. Stop it (a rank that opens a bar starts its own), so that the server can fork."""
    from tqdm import std as tqdm_std

    monitor = getattr(tqdm_std.tqdm, "monitor", None)
    if monitor is not None:
        monitor.exit()
        tqdm_std.tqdm.monitor = None


_stop_tqdm_monitor()


def _wait_for_one_thread(seconds: float = 10.0) -> None:
    """The server forks from its one thread: wait for any helper thread the compilation left (it ends on its own),
    and refuse to serve if one stays (a forked rank could inherit a lock it held)."""
    import os
    import time

    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):  # not Linux
        return
    deadline = time.monotonic() + seconds
    while len(os.listdir(tasks)) > 1:
        if time.monotonic() > deadline:
            names = [open(os.path.join(tasks, t, "comm")).read().strip() for t in os.listdir(tasks)]
            raise RuntimeError(f"tests/helpers/rank_preload.py: the fork server still runs threads {names} after "
                               "preloading")
        time.sleep(0.05)


_wait_for_one_thread()
