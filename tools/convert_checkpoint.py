#!/usr/bin/env python
"""Convert checkpoints between megatron-delta (torch_dist) and Hugging Face transformers.

  export: python tools/convert_checkpoint.py export --load RUN_OR_ITER_DIR --output HF_DIR [--dtype fp32|bf16]
      baseline -> stock Qwen3ForCausalLM (LlamaForCausalLM without qk-layernorm), no remote code;
      routed modes -> DeltaQwen3ForCausalLM (AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)).
      The run's SentencePiece tokenizer (run_config.json tokenizer_model) is exported as tokenizer.json.
      Works for a checkpoint saved under any TP/PP/VPP layout (it is resharded to TP1/PP1 in-process).
      The checkpoint's files are verified against its integrity.json first (--no-verify-integrity skips it):
      a damaged checkpoint is one error line, and nothing is written.
  import: python tools/convert_checkpoint.py import --hf HF_DIR --save CKPT_DIR --residual MODE
              [--delta-gate scalar] [--delta-null-source] [--delta-num-blocks K] [--delta-sources exact]
              [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]
      Qwen3 / Llama -> iteration-0 model-only checkpoint; train from it with
      `pretrain_gpt.py --finetune --load CKPT_DIR --tokenizer-type NullTokenizer --vocab-size <V> ...`
      and the model flags in CKPT_DIR/iter_0000000/run_config.json. torch_dist checkpoints are layout
      independent, so the checkpoint is written under TP1/PP1 and loads under any TP/PP; T only sets the
      vocabulary padding (a multiple of 128 x T, as pretrain_gpt computes it).
"""
import argparse
import os
import sys

from megatron_delta.checkpoint.integrity import add_verify_integrity_argument
from megatron_delta.platform.patches import known_warnings_quieted

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_delta.core.modes import BASELINE, BLOCK_MODES, GATES, RESIDUAL_MODES, SOURCE_DEFINITIONS


@known_warnings_quieted()
def main(argv=None):
    p = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="Megatron checkpoint -> HF directory")
    e.add_argument("--load", required=True)
    e.add_argument("--output", required=True)
    e.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    add_verify_integrity_argument(e)
    i = sub.add_parser("import", help="HF Qwen3/Llama directory -> Megatron checkpoint")
    i.add_argument("--hf", required=True)
    i.add_argument("--save", required=True)
    i.add_argument("--residual", choices=RESIDUAL_MODES, default=BASELINE)
    i.add_argument("--delta-gate", choices=GATES, default=GATES[0])
    i.add_argument("--delta-null-source", action="store_true")
    i.add_argument("--delta-num-blocks", type=int, default=None,
                   help=f"K blocks of L/K layers ({', '.join(BLOCK_MODES)}); default 4 (L when L <= 4); "
                        "needed when 4 does not divide L")
    i.add_argument("--delta-sources", choices=SOURCE_DEFINITIONS, default=SOURCE_DEFINITIONS[0])
    i.add_argument("--tensor-model-parallel-size", type=int, default=1)
    i.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    i.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    i.add_argument("--overwrite", action="store_true",
                   help="replace a --save directory that already holds files (refused otherwise)")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)

    from megatron_delta.checkpoint.errors import CheckpointError, ConversionError
    from megatron_delta.convert.hf_checkpoint import export_checkpoint, import_checkpoint
    from megatron_delta.platform.distributed import destroy_distributed

    try:
        if a.cmd == "export":
            export_checkpoint(a.load, a.output, a.dtype, verify_integrity=a.verify_integrity)
        else:
            import_checkpoint(a.hf, a.save, a.residual, a.delta_num_blocks, a.delta_null_source, a.delta_gate,
                              a.delta_sources, a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                              a.make_vocab_size_divisible_by, overwrite=a.overwrite)
    except (ConversionError, CheckpointError) as err:
        print(f"convert_checkpoint.py {a.cmd}: error: {err}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
