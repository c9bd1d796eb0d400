"""A Megatron checkpoint loaded for evaluation: one model in this process (load_megatron: TP1/PP1) or under the
checkpoint's own or another layout (load_megatron_parallel), computing as it was trained (as_trained /
precision.eval_in_bf16: --dtype auto), and its logits (megatron_logits, megatron_logits_parallel). The tools
(evaluate, perplexity, routing_report, convert_checkpoint export) read checkpoints through these, and these open
them through checkpoint/reader.py: the files verified against integrity.json first (``verify_integrity=False``: the
tools' --no-verify-integrity), every failure one CheckpointError line.
"""
import os

import torch

from megatron_delta.checkpoint.errors import ConversionError
from megatron_delta.checkpoint.run_config import _check_supported_run_config, checkpoint_args, model_fields
from megatron_delta.evaluation.precision import eval_in_bf16


def as_trained(chunks, config, bf16: bool) -> list:
    """The chunks as ``--bf16`` training holds them: each in Megatron-Core's Float16Module (bf16 model copy,
    fp32 logits out; the routers still compute in fp32, docs/design.md 2.5), else as built (fp32)."""
    if not bf16:
        return chunks
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(config, c) for c in chunks]


def build_megatron_model(run_config: dict, padded_vocab_size: int, where: str = "run_config.json",
                         bf16: bool = False):
    """One GPT model (TP1/PP1, this process; fp32, or bf16 in Float16Module) for the model keys of a
    run_config-like dict. Returns (model, args): args as checkpoint/store.py load / save read them (see
    checkpoint_args)."""
    from megatron_delta.checkpoint.model_config import model_config
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.platform.cpu import activate_cpu_platform
    from megatron_delta.platform.distributed import initialize_distributed

    fields = model_fields(run_config, where, padded_vocab_size=padded_vocab_size, bf16=bf16)
    args = checkpoint_args(fields)
    activate_cpu_platform()
    initialize_distributed(1, 1, seed=args.seed)
    config, options = model_config(fields)
    (model,) = as_trained(build_model_chunks(config, padded_vocab_size, **options), config, bf16)
    return model, args


def load_megatron(load: str, dtype: str = "fp32", verify_integrity: bool = True):
    """Load a checkpoint (any TP/PP/VPP layout) as one TP1/PP1 model computing in ``dtype``
    (precision.EVAL_DTYPES; the export reads weights in fp32). Returns (model, args, run_config)."""
    from megatron_delta.checkpoint.reader import open_checkpoint
    from megatron_delta.checkpoint.store import load_checkpoint

    ckpt_dir, _, rc, _, _ = open_checkpoint(load, verify_integrity)
    _check_supported_run_config(rc, f"--load {ckpt_dir}")
    bf16 = eval_in_bf16(rc, dtype)
    model, args = build_megatron_model(rc, rc["padded_vocab_size"], f"--load {ckpt_dir}", bf16=bf16)
    load_checkpoint(load, [model], None, None, args, load_optim=False, load_rng=False,
                    verify_integrity=verify_integrity)
    model.eval()
    return model, args, rc


def load_megatron_parallel(load: str, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                           dtype: str = "fp32", verify_integrity: bool = True):
    """Load a checkpoint (saved under any layout) split over TP x PP ranks of this torch.distributed world
    (torchrun's WORLD_SIZE; the remaining factor is data parallel), as training would hold it, computing in
    ``dtype`` (precision.EVAL_DTYPES). Returns (model chunks of this rank, args, run_config)."""
    from megatron_delta.checkpoint.model_config import model_config
    from megatron_delta.checkpoint.reader import open_checkpoint
    from megatron_delta.checkpoint.store import load_checkpoint
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.platform.cpu import activate_cpu_platform
    from megatron_delta.platform.distributed import initialize_distributed

    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ConversionError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs "
                              f"{tp * pp} ranks per model, but the world size is {world}: launch with "
                              f"`torchrun --nproc-per-node {tp * pp}` (or a multiple of it)")
    ckpt_dir, _, rc, _, _ = open_checkpoint(load, verify_integrity)
    _check_supported_run_config(rc, f"--load {ckpt_dir}")
    bf16 = eval_in_bf16(rc, dtype)
    padded = rc["padded_vocab_size"]
    if padded % tp:
        raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide the checkpoint's padded "
                              f"vocabulary ({padded})")
    # routed modes send a payload whose length differs by stage boundary (model_config sets
    # variable_seq_lengths for them under PP > 1, as training does)
    fields = model_fields(rc, f"--load {ckpt_dir}", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          bf16=bf16)
    args = checkpoint_args(fields, data_parallel_size=world // (tp * pp))
    activate_cpu_platform()
    initialize_distributed(tp, pp, seed=args.seed)
    config, options = model_config(fields)
    chunks = as_trained(build_model_chunks(config, padded, **options), config, bf16)
    load_checkpoint(load, chunks, None, None, args, load_optim=False, load_rng=False, verify_integrity=verify_integrity)
    for c in chunks:
        c.eval()
    return chunks, args, rc


def megatron_logits_parallel(chunks, ids) -> torch.Tensor | None:
    """One sequence through Megatron's pipeline schedule (forward only) on this rank's model chunks:
    [len(ids), padded_vocab] fp32 logits (gathered over TP) on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megatron_delta.core.payload import schedule_communication_kwargs

    tokens = torch.tensor([list(ids)], dtype=torch.long)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)

    def step(data_iterator, model):
        next(data_iterator)
        return model(tokens, pos, None), None  # no loss function: the schedule returns the logits

    its = [iter([None]) for _ in chunks]
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=its if len(chunks) > 1 else its[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1, seq_length=tokens.shape[1],
            micro_batch_size=1, forward_only=True, **schedule_communication_kwargs(get_model_config(chunks[0])))
        if not parallel_state.is_pipeline_last_stage():
            return None
        return tensor_parallel.gather_from_tensor_model_parallel_region(out[0])[0].float()


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] token ids -> [b, s, padded_vocab] fp32 logits of a TP1/PP1 model."""
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        return model(tokens, pos, None).float()
