"""Tokenizers: SentencePiece training (tools/train_tokenizer.py) and Megatron-Core's tokenizer of the
--tokenizer-type / --tokenizer-model flags, checked first (a missing or wrong model is one line naming the flag).
Megatron-Core is imported lazily.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Callable, Iterable, Optional, Sequence

from megatron_delta.data.text import _check_input_file, iter_documents, print_flush, split_sentences

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + ("NullTokenizer",)

_TRAIN_TOKENIZER_HINT = "train one with tools/train_tokenizer.py"


# =============================================================================== tokenizer training
def train_sentencepiece(inputs: Sequence[str], model_prefix: str, vocab_size: int = 8000,
                        model_type: str = "bpe", json_keys: Sequence[str] = ("text",),
                        input_format: str = "auto", byte_fallback: bool = True,
                        character_coverage: float = 0.9999, num_threads: int = 2,
                        documents: Optional[Iterable[str]] = None,
                        log: Callable[[str], None] = print_flush) -> str:
    """Train a SentencePiece model on the sentences of `inputs` (or of `documents`, an iterable of
    document texts). Writes `<model_prefix>.model` and `.vocab` (temp names, renamed at the end)
    and returns the .model path. Special pieces: <unk>=0, <s>=1, </s>=2 (the end-of-document
    token of the GPT datasets), no pad piece."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type: {model_type!r} is not one of bpe, unigram")
    if not vocab_size or vocab_size < 8:
        raise ValueError(f"--vocab-size: {vocab_size} is too small")
    if not model_prefix:
        raise ValueError("--model-prefix: empty")
    if documents is None:
        if not inputs:
            raise ValueError("--input: no input file given")
        for path in inputs:
            _check_input_file(path)
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--model-prefix: directory {out_dir} does not exist")

    t0 = time.time()
    sentences: list[str] = []
    nbytes = 0
    sources = [("documents", documents)] if documents is not None else [
        (p, iter_documents(p, json_keys, input_format)) for p in inputs]
    for name, docs in sources:
        ndocs = 0
        for doc in docs:
            ndocs += 1
            for s in split_sentences(doc):
                sentences.append(s)
                nbytes += len(s.encode("utf-8"))
        log(f"[train_tokenizer] {name}: {ndocs} documents, {len(sentences)} sentences so far")
    if not sentences:
        raise ValueError("--input: no text found in " + ", ".join(inputs or ["documents"]))
    log(f"[train_tokenizer] {len(sentences)} sentences, {nbytes / 1e6:.1f} MB read in "
        f"{time.time() - t0:.1f} s; training {model_type} vocab {vocab_size} ...")

    tmp_prefix = os.path.join(out_dir, f".tmp-{os.path.basename(model_prefix)}-{os.getpid()}")
    t1 = time.time()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_prefix=tmp_prefix, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage,
            byte_fallback=byte_fallback, num_threads=num_threads,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
        os.replace(tmp_prefix + ".vocab", model_prefix + ".vocab")
        os.replace(tmp_prefix + ".model", model_prefix + ".model")   # the .model appears last
    except RuntimeError as e:
        msg = str(e)
        m = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
        if m:
            hint = (f"--vocab-size {vocab_size} is too small for this input: at least {m.group(2)} "
                    f"pieces are needed (characters + special pieces"
                    f"{' + 256 byte-fallback pieces' if byte_fallback else ''}); raise "
                    f"--vocab-size or lower --character-coverage")
        elif "too high" in msg:
            hint = (f"--vocab-size {vocab_size} is too large for this input; use a smaller "
                    f"--vocab-size or more text")
        else:
            hint = f"--vocab-size {vocab_size} / --model-type {model_type}: training failed"
        raise ValueError(f"{hint} (sentencepiece: {msg.splitlines()[0][-200:]})") from e
    finally:
        for ext in (".model", ".vocab"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_prefix + ext)
    log(f"[train_tokenizer] wrote {model_prefix}.model ({time.time() - t1:.1f} s)")
    return model_prefix + ".model"


# =============================================================================== tokenizer
def _check_sentencepiece_model(path: Optional[str]) -> None:
    if not path:
        raise ValueError(f"--tokenizer-model is required with --tokenizer-type "
                         f"SentencePieceTokenizer; {_TRAIN_TOKENIZER_HINT}")
    if not os.path.exists(path):
        raise ValueError(f"--tokenizer-model: {path} does not exist; {_TRAIN_TOKENIZER_HINT}")
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ValueError(f"--tokenizer-model: {path} is not a readable file; "
                         f"{_TRAIN_TOKENIZER_HINT}")
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(path)
    except Exception as e:  # sentencepiece raises OSError/RuntimeError depending on the version
        raise ValueError(f"--tokenizer-model: {path} is not a valid SentencePiece model ({e}); "
                         f"{_TRAIN_TOKENIZER_HINT}") from e
    if sp.eos_id() < 0:
        raise ValueError(f"--tokenizer-model: {path} has no end-of-sentence piece (eos_id=-1), "
                         f"which is the end-of-document token; {_TRAIN_TOKENIZER_HINT}")


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                    vocab_size: Optional[int] = None):
    """Megatron-Core's own tokenizer (megatron.core.tokenizers, a MegatronTokenizerBase), with
    .vocab_size, .eod, .pad, .tokenize(text) -> list[int], .detokenize(ids) -> str and the
    .unique_identifiers GPTDataset needs.

    SentencePieceTokenizer (alias GPTSentencePieceTokenizer): needs tokenizer_model (a
      sentencepiece .model); eod = the model's </s> id; vocab_size = number of pieces.
    NullTokenizer: needs vocab_size N; tokens are "1 2 3" strings; Megatron-Core's semantics (0.17+):
      .vocab_size = N and eod = N - 1.
    """
    if tokenizer_type in SENTENCEPIECE_TYPES:
        _check_sentencepiece_model(tokenizer_model)
        from megatron.core.tokenizers import MegatronTokenizer
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=tokenizer_model,
            metadata_path={"library": "sentencepiece", "model_type": "gpt"})
    if tokenizer_type == "NullTokenizer":
        try:
            n = int(vocab_size) if vocab_size is not None else 0
        except (TypeError, ValueError):
            n = 0
        if n <= 0:
            raise ValueError(f"--vocab-size: NullTokenizer needs a positive --vocab-size "
                             f"(got {vocab_size!r})")
        from megatron.core.tokenizers import MegatronTokenizer
        return MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text", "model_type": "gpt"}, vocab_size=n)
    raise ValueError(f"--tokenizer-type: unknown tokenizer type {tokenizer_type!r}; "
                     f"use one of {', '.join(TOKENIZER_TYPES)}")
