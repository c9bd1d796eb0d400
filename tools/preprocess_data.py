#!/usr/bin/env python3
"""Tokenize text into a Megatron indexed dataset (.bin/.idx), with Megatron-LM's flag names.

  python tools/preprocess_data.py --input megatron_delta/data/bundled/sotu.txt.xz --output-prefix runs/data/sotu \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model runs/tok/sotu_bpe.model \
      --json-keys text --append-eod --workers 2
  -> runs/data/sotu_text_document.bin/.idx; train with --data-path runs/data/sotu_text_document

Input: one document per line, either plain text or JSON Lines (the text under --json-keys;
detected from the name or the content), optionally .xz/.bz2/.gz compressed. Each line is encoded
separately; the EOD token follows every document (on by default, unlike Megatron-LM; --no-append-eod
turns it off). Output naming follows Megatron-LM: <output-prefix>_<key>_document.{bin,idx}, one
dataset per JSON key. Both files are written under temporary names and renamed at the end, so an
interrupted run leaves no dataset that looks complete.
"""
import argparse
import sys

from megatron_delta.data.indexed import preprocess_to_indexed
from megatron_delta.data.tokenizers import TOKENIZER_TYPES
from megatron_delta.platform.patches import known_warnings_quieted


@known_warnings_quieted()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="text or JSONL file (.xz/.bz2/.gz accepted)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    g.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=list(TOKENIZER_TYPES))
    g.add_argument("--tokenizer-model", help="SentencePiece .model (tools/train_tokenizer.py)")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer only")
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the EOD token after each document (default: on)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes <output-prefix>_<key>_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    args = p.parse_args(argv)
    try:
        preprocess_to_indexed(args.input, args.output_prefix, args.tokenizer_type,
                              args.tokenizer_model, args.vocab_size, json_keys=args.json_keys,
                              append_eod=args.append_eod, workers=args.workers,
                              input_format=args.input_format, log_interval=args.log_interval)
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
