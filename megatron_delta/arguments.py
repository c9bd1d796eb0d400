"""The former project-specific parser of pretrain_gpt.py's flags (pretrain_gpt.py now takes Megatron-LM's parser,
megatron_delta/trainer/). Nothing of the project uses it: models are built from their fields
(megatron_delta/model_config.py). Kept only while tests/test_patches.py and tests/test_refusals.py still build
their models through it; delete it with them. Its flags map to a model through model_config (one mapping).
"""

import argparse
import os

from megatron_delta.core.modes import RESIDUAL_MODES, SOURCE_DEFINITIONS


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message names the flag and what to do."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Megatron-Core GPT pretraining with Delta Attention Residuals.",
        allow_abbrev=False,
    )

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 3 x hidden (SwiGLU)")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true", default=True)
    g.add_argument("--no-group-query-attention", dest="group_query_attention", action="store_false")
    g.add_argument("--num-query-groups", type=int, default=2)
    g.add_argument("--kv-channels", type=int, default=None, help="default: hidden / heads")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute", "none"], default="rope")
    g.add_argument("--rotary-base", type=int, default=1000000)
    g.add_argument("--swiglu", action="store_true", default=True)
    g.add_argument("--no-swiglu", dest="swiglu", action="store_false")
    g.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], default="RMSNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-6)
    g.add_argument("--qk-layernorm", action="store_true", default=True)
    g.add_argument("--no-qk-layernorm", dest="qk_layernorm", action="store_false")
    g.add_argument("--disable-bias-linear", action="store_true", default=True)
    g.add_argument("--add-bias-linear", dest="disable_bias_linear", action="store_false")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=False)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")

    g = p.add_argument_group("residual routing (megatron-delta)")
    g.add_argument("--residual", choices=RESIDUAL_MODES, default="baseline")
    g.add_argument("--delta-num-blocks", type=int, default=None,
                   help="K blocks of L/K layers (delta_block, attnres); default 4 (or L if L < 4)")
    g.add_argument("--delta-null-source", action="store_true", help="a learnable zero-initialised null source")
    g.add_argument("--delta-gate", choices=["none", "scalar"], default="none",
                   help="scalar gate u = x + a*r, a=0 at init (additive modes only)")
    g.add_argument("--delta-sources", choices=SOURCE_DEFINITIONS, default="exact")
    g.add_argument("--delta-router-eps", type=float, default=None, help="default: --norm-epsilon")
    g.add_argument("--delta-router-kernels", choices=["auto", "c", "torch", "fla"], default="auto",
                   help="auto: fused C kernels for fp32 CPU tensors, built on first use (a warning and "
                        "PyTorch ops if that fails); c: the same, a failed build is an error; torch: PyTorch ops")
    g.add_argument("--router-lr-mult", type=float, default=1.0,
                   help="router parameters get lr x M and no weight decay")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro x data-parallel")
    g.add_argument("--train-iters", type=int, default=None, help="default: 200 in the embedded default run, else 100")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=None, help="default: 5%% of --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    # FP8 (Transformer Engine, GPU only): Megatron-LM's flags and defaults.
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="train the TE linears in FP8 (hybrid: e4m3 forward, e5m2 gradients); "
                        "needs --transformer-impl transformer_engine and --bf16")
    g.add_argument("--fp8-recipe", choices=["delayed", "tensorwise", "mxfp8", "blockwise"], default="delayed",
                   help="FP8 scaling recipe (mxfp8 needs Blackwell)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed scaling: number of steps of amax history")
    g.add_argument("--fp8-amax-compute-algo", choices=["max", "most_recent"], default="most_recent",
                   help="delayed scaling: how the scale is computed from the amax history")
    g.add_argument("--time-limit-minutes", type=float, default=None,
                   help="stop training (then validate and save) after this much wall time")
    g.add_argument("--delta-cpu-allocator", choices=["cache", "system"], default="cache",
                   help="CPU runs: cache = glibc keeps freed tensor memory for reuse, as the CUDA caching "
                        "allocator does (no page faults on every new activation); system = malloc as configured")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="[weight] prefix [weight prefix ...], Megatron-LM blend syntax; "
                        "default: the bundled State of the Union corpus")
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--valid-data-path", nargs="*", default=None,
                   help="validation data (Megatron-LM: then --data-path is all training data)")
    g.add_argument("--heldout-data-path", nargs="*", default=None,
                   help="another distribution, evaluated beside validation (default run: the Wikipedia sample)")
    g.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "NullTokenizer"], default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=0)

    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--metrics-file", type=str, default=None, help="append JSON lines of metrics here")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; reset iteration, optimizer and scheduler")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    return p


def _fail(msg: str):
    raise ArgumentError(msg)


def parse_args(argv=None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate. `argv=None` reads sys.argv; an empty list is the embedded default run."""
    args = build_parser().parse_args(argv)
    args.embedded_default = args.data_path is None and not args.mock_data
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    validate_args(args)
    return args


def validate_args(args: argparse.Namespace) -> None:
    """Fill derived defaults and reject unsupported combinations, naming the flags."""
    L, d, heads = args.num_layers, args.hidden_size, args.num_attention_heads
    for flag, value in [("--num-layers", L), ("--hidden-size", d), ("--num-attention-heads", heads),
                        ("--seq-length", args.seq_length), ("--micro-batch-size", args.micro_batch_size)]:
        if value is None or value <= 0:
            _fail(f"{flag} must be a positive integer (got {value})")
    if d % heads and args.kv_channels is None:
        _fail(f"--hidden-size {d} is not divisible by --num-attention-heads {heads}; set --kv-channels")
    if args.kv_channels is None:
        args.kv_channels = d // heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 3 * d if args.swiglu else 4 * d
    if not args.group_query_attention:
        args.num_query_groups = heads
    if heads % args.num_query_groups:
        _fail(f"--num-attention-heads {heads} is not divisible by --num-query-groups {args.num_query_groups}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
              f"{args.max_position_embeddings}; raise --max-position-embeddings or shorten --seq-length")

    # Parallel layout.
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if min(tp, pp, cp) < 1:
        _fail("--tensor-model-parallel-size, --pipeline-model-parallel-size and --context-parallel-size must be >= 1")
    if args.world_size % (tp * pp * cp):
        _fail(f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp} x "
              f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")
    args.data_parallel_size = args.world_size // (tp * pp * cp)
    if heads % tp:
        _fail(f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads {heads}")
    if args.num_query_groups % tp:
        _fail(f"--tensor-model-parallel-size {tp} does not divide --num-query-groups {args.num_query_groups}")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM does the same: SP is a no-op without TP.
    if args.sequence_parallel and args.seq_length % tp:
        _fail(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
              f"--tensor-model-parallel-size {tp}")
    if L % pp:
        _fail(f"--pipeline-model-parallel-size {pp} does not divide --num-layers {L}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = L // pp
        if pp < 2:
            _fail("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        if per_stage % args.num_layers_per_virtual_pipeline_stage:
            _fail(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} "
                  f"does not divide the {per_stage} layers of each pipeline stage")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None
    if cp > 1:
        _fail("--context-parallel-size > 1 is not supported by megatron-delta yet "
              "(Megatron-Core's context parallelism needs Transformer Engine attention)")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        _fail("--recompute-granularity full needs --recompute-method uniform|block")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        _fail("--recompute-method is only used with --recompute-granularity full")
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    if args.transformer_impl == "transformer_engine":
        import importlib.util

        import torch

        if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
            _fail("--transformer-impl transformer_engine needs a GPU and Transformer Engine "
                  "(`pip install megatron-delta[te]` on a GPU machine); use --transformer-impl local")
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 are mutually exclusive")
    if args.fp16:
        _fail("--fp16 is not supported (use --bf16): fp16 needs a loss scaler tested only on GPUs")
    if args.fp8_format is not None:
        if args.transformer_impl != "transformer_engine":
            _fail(f"--fp8-format {args.fp8_format} needs --transformer-impl transformer_engine "
                  "(FP8 GEMMs are Transformer Engine kernels; the local backend has none)")
        if not args.bf16:
            _fail(f"--fp8-format {args.fp8_format} needs --bf16 (FP8 GEMMs with BF16 weights and "
                  "activations, as in Megatron-LM)")
        if args.fp8_amax_history_len < 1:
            _fail(f"--fp8-amax-history-len must be >= 1 (got {args.fp8_amax_history_len})")

    # Batch sizes.
    dp_mbs = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = dp_mbs
    if args.global_batch_size % dp_mbs:
        _fail(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
              f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_microbatches = args.global_batch_size // dp_mbs
    if pp > 1 and args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp:
        _fail(f"the interleaved schedule needs the number of micro-batches ({args.num_microbatches}) "
              f"to be a multiple of --pipeline-model-parallel-size {pp}; raise --global-batch-size")

    # Schedule.
    if args.train_iters is None:
        args.train_iters = 200 if args.embedded_default else 100
    if args.embedded_default and args.time_limit_minutes is None:
        args.time_limit_minutes = 3.5  # the default run promises at most 5 minutes on 2 cores, data build included
    if args.train_iters < 0:
        _fail("--train-iters must be >= 0")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = max(args.train_iters, 1)
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = args.train_iters // 20
    if args.lr_warmup_iters >= args.lr_decay_iters:  # Megatron's scheduler asserts warmup < decay
        _fail(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
              f"(default: --train-iters)")
    if args.min_lr > args.lr:
        _fail(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.log_interval <= 0 or args.eval_interval <= 0:
        _fail("--log-interval and --eval-interval must be positive")

    # Data and tokenizer.
    if args.mock_data:
        if args.tokenizer_type is None:
            args.tokenizer_type = "NullTokenizer"
        if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
            args.vocab_size = 1024
    elif args.tokenizer_type is None:
        args.tokenizer_type = "SentencePieceTokenizer"
    if args.tokenizer_type == "SentencePieceTokenizer" and args.tokenizer_model is None and not args.embedded_default:
        _fail("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model (train one with "
              "tools/train_tokenizer.py)")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        _fail("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.embedded_default and (args.tokenizer_type != "SentencePieceTokenizer" or args.tokenizer_model):
        # The bundled corpus is tokenized with the bundled tokenizer; other token ids would index
        # past (or silently mis-read) the model's vocabulary.
        _fail(f"--tokenizer-type {args.tokenizer_type}"
              f"{' --tokenizer-model ' + args.tokenizer_model if args.tokenizer_model else ''} needs "
              f"--data-path (data tokenized with that tokenizer: tools/preprocess_data.py) or --mock-data; "
              f"without them the run uses the bundled corpus and its own tokenizer")
    if args.data_path is not None and len(args.data_path) == 0:
        _fail("--data-path needs at least one dataset prefix")

    # Checkpoints.
    if args.finetune and args.load is None:
        _fail("--finetune needs --load (the checkpoint to start from)")
    if args.embedded_default and args.save is None:
        args.save = os.path.join("runs", f"default-{args.residual}")
    if args.save_interval is not None and args.save_interval <= 0:
        _fail("--save-interval must be positive")

    # Residual modes: the config dataclass owns the rules; check them now so the error is early.
    validate_delta_flags(args)


def validate_delta_flags(args) -> None:
    """Argument-parser hook: resolve `--delta-num-blocks` and reject bad combinations early."""
    from megatron_delta.core import cpu_kernels
    from megatron_delta.core.config import RESIDUAL_FUSIONS, check_residual_fusions
    from megatron_delta.core.modes import check_delta_options

    try:
        args.delta_num_blocks = check_delta_options(
            args.residual, args.num_layers, args.delta_num_blocks, args.delta_null_source,
            args.delta_gate, args.delta_sources, args.router_lr_mult, args.delta_router_kernels)
        check_residual_fusions(args.residual, **{f: getattr(args, f, False) for f in RESIDUAL_FUSIONS})
        if args.residual != "baseline":
            cpu_kernels.check(args.delta_router_kernels)  # `c` must build, `fla` import: fail now, not at step 1
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if args.delta_router_eps is None:
        args.delta_router_eps = args.norm_epsilon


def model_fields_from_args(args) -> dict:
    """The model fields (megatron_delta.model_config) of parsed flags."""
    from megatron_delta.model_config import SMALL_CPU_MODEL

    return {k: getattr(args, k) for k in SMALL_CPU_MODEL if hasattr(args, k)}


def transformer_config_from_args(args, **overrides):
    """DeltaTransformerConfig of parsed flags: megatron_delta.model_config's mapping (the only one)."""
    from megatron_delta.model_config import model_config

    return model_config(model_fields_from_args(args), **overrides)[0]


def padded_vocab_size(vocab_size: int, args) -> int:
    """Megatron-LM's padding: a multiple of --make-vocab-size-divisible-by x TP."""
    from megatron_delta.model_config import padded_vocab_size as padded

    return padded(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def model_options(args) -> dict:
    """The GPTModel options of megatron_delta.core.model.gpt_model / build_model_chunks, from the flags."""
    from megatron_delta.model_config import model_config

    return model_config(model_fields_from_args(args))[1]
