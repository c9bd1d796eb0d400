"""The precision the evaluation tools compute in (their --dtype flag), in one light module: it imports no torch,
so tools/evaluate.py, perplexity.py and routing_report.py declare the flag before their slow imports, and
loaders.py computes with the same choices."""
from megatron_delta.checkpoint.errors import ConversionError

# "auto" is the precision the checkpoint was trained in (run_config.json "bf16"), so evaluation reproduces
# training's numbers; "fp32" computes with the (possibly bf16) weights in fp32.
EVAL_DTYPES = ("auto", "fp32", "bf16")
DTYPE_HELP = "precision of the forward: auto = as the checkpoint was trained (run_config.json bf16)"


def add_dtype_argument(parser) -> None:
    """The tools' --dtype flag on an argparse parser."""
    parser.add_argument("--dtype", choices=EVAL_DTYPES, default="auto", help=DTYPE_HELP)


def eval_in_bf16(rc: dict, dtype: str, flag: str = "--dtype") -> bool:
    """Whether a tool computes in bf16 for ``dtype`` (one of EVAL_DTYPES) on a checkpoint of run_config ``rc``."""
    if dtype not in EVAL_DTYPES:
        raise ConversionError(f"{flag} must be one of {', '.join(EVAL_DTYPES)}, got {dtype!r}")
    return bool(rc.get("bf16")) if dtype == "auto" else dtype == "bf16"
