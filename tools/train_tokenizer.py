#!/usr/bin/env python3
"""Train a SentencePiece tokenizer for megatron-delta.

  python tools/train_tokenizer.py --input megatron_delta/data/bundled/sotu.txt.xz --model-prefix runs/tok/sotu_bpe \
      --vocab-size 4096 --model-type bpe

Inputs: .txt (one document per line) or .jsonl (one JSON object per line, text under --json-keys),
optionally .xz/.bz2/.gz compressed; several files may be given. The format is detected from the
name (.jsonl/.json) or the content (the bundled data/*.txt.xz are JSON Lines). Documents are split
into lines and sentences before training. Writes PREFIX.model and PREFIX.vocab (temp names, renamed
when done). Special pieces: <unk>=0, <s>=1, </s>=2 (used as end-of-document token), no pad.
Use the model with --tokenizer-type SentencePieceTokenizer --tokenizer-model PREFIX.model.
"""
import argparse
import sys

from megatron_delta.data.tokenizers import train_sentencepiece
from megatron_delta.platform.patches import known_warnings_quieted


@known_warnings_quieted()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="training text file(s)")
    p.add_argument("--model-prefix", required=True, help="output PREFIX (.model/.vocab)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys to read (default: text)")
    p.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                   help="map unseen characters to <unk> instead of UTF-8 byte pieces")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    try:
        train_sentencepiece(args.input, args.model_prefix, args.vocab_size, args.model_type,
                            json_keys=args.json_keys, input_format=args.input_format,
                            byte_fallback=args.byte_fallback,
                            character_coverage=args.character_coverage, num_threads=args.threads)
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
