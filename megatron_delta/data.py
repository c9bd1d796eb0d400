"""Tokenizers and datasets: text -> SentencePiece -> Megatron indexed dataset -> GPTDataset.

Library API (used by pretrain_gpt.py):
  build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)      -> Megatron-Core tokenizer
  build_gpt_datasets(data_path, split, seq_length, seed, num_samples, tokenizer, mock=False,
                     cache_dir=None, valid_data_path=None, test_data_path=None) -> (train, valid, test)
  ensure_default_data(cache_dir="runs/cache")                       -> dict of paths (bundled corpora)

Building blocks, also used by the command-line tools in tools/:
  iter_records / iter_documents  read .txt (one document per line) or .jsonl, optionally .xz/.bz2/.gz
  split_sentences                sentence splitting for tokenizer training
  train_sentencepiece            tools/train_tokenizer.py
  preprocess_to_indexed          tools/preprocess_data.py

Megatron-Core is imported lazily, so the text helpers are cheap to import.
All user-facing errors are ValueError with a message naming the flag or file and what to do.
"""
from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import tempfile
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence

__all__ = [
    "build_tokenizer",
    "build_gpt_datasets",
    "ensure_default_data",
    "iter_records",
    "iter_documents",
    "split_sentences",
    "train_sentencepiece",
    "preprocess_to_indexed",
    "indexed_prefix",
    "validate_indexed_prefix",
    "SENTENCEPIECE_TYPES",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED_DATA_DIR = os.path.join(REPO_ROOT, "data")

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + ("NullTokenizer",)

_TRAIN_TOKENIZER_HINT = "train one with tools/train_tokenizer.py"
_PREPROCESS_HINT = "build it with tools/preprocess_data.py"


def _print(msg: str) -> None:
    print(msg, flush=True)


# =============================================================================== reading text
def open_text(path: str):
    """Open a UTF-8 text file for reading; .xz, .bz2 and .gz are decompressed on the fly."""
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.endswith(".bz2"):
        return bz2.open(path, "rt", encoding="utf-8")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _check_input_file(path: str, flag: str = "--input") -> None:
    if not path:
        raise ValueError(f"{flag}: no input file given")
    if not os.path.exists(path):
        raise ValueError(f"{flag}: {path} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: {path} is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag}: {path} is not readable")


def detect_format(path: str) -> str:
    """'jsonl' or 'text'. By name (.jsonl/.json, before any compression suffix); otherwise by
    content: the first non-blank line is a JSON object -> 'jsonl' (the bundled data/*.txt.xz are
    JSON Lines), else 'text' (one document per line)."""
    base = re.sub(r"\.(xz|bz2|gz)$", "", path)
    if base.endswith((".jsonl", ".json")):
        return "jsonl"
    try:
        with open_text(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                if line.startswith("{"):
                    try:
                        return "jsonl" if isinstance(json.loads(line), dict) else "text"
                    except json.JSONDecodeError:
                        return "text"
                return "text"
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as e:
        raise ValueError(f"--input: cannot read {path}: {e}") from e
    return "text"


def _parse_record(line: str, path: str, lineno: int, json_keys: Sequence[str]) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"--input: {path}:{lineno}: not valid JSON ({e})") from e
    if not isinstance(rec, dict):
        raise ValueError(f"--input: {path}:{lineno}: expected a JSON object per line")
    for key in json_keys:
        if key not in rec:
            raise ValueError(
                f"--json-keys: {path}:{lineno} has no key {key!r} (keys: {sorted(rec)})")
        if not isinstance(rec[key], str):
            raise ValueError(f"--json-keys: {path}:{lineno}: {key!r} is not a string")
    return rec


def iter_records(path: str, json_keys: Sequence[str] = ("text",), input_format: str = "auto",
                 ) -> Iterator[dict]:
    """Yield one dict {key: text} per document. Text format: one document per non-blank line,
    exposed under every key in json_keys. JSONL: one JSON object per non-blank line."""
    _check_input_file(path)
    fmt = detect_format(path) if input_format == "auto" else input_format
    if fmt not in ("jsonl", "text"):
        raise ValueError(f"--input-format: unknown format {input_format!r} (auto, jsonl, text)")
    with open_text(path) as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if fmt == "jsonl":
                    rec = _parse_record(line, path, lineno, json_keys)
                    yield {k: rec[k] for k in json_keys}
                else:
                    text = line.rstrip("\n")
                    yield {k: text for k in json_keys}
        except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as e:
            raise ValueError(f"--input: cannot read {path}: {e}") from e


def iter_documents(path: str, json_keys: Sequence[str] = ("text",), input_format: str = "auto",
                   ) -> Iterator[str]:
    """Yield each document's text (several JSON keys are joined with a newline)."""
    for rec in iter_records(path, json_keys, input_format):
        yield "\n".join(rec[k] for k in json_keys)


# A sentence ends with . ! or ? (optionally followed by closing quotes/brackets) and whitespace.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'\u201d\u2019)\]]))\s+")


def split_sentences(text: str) -> list[str]:
    """Split a document into lines, then into sentences (a regex heuristic, good enough for
    tokenizer training)."""
    out = []
    for line in text.splitlines():
        for sent in _SENTENCE_END.split(line):
            sent = sent.strip()
            if sent:
                out.append(sent)
    return out


# =============================================================================== tokenizer training
def train_sentencepiece(inputs: Sequence[str], model_prefix: str, vocab_size: int = 8000,
                        model_type: str = "bpe", json_keys: Sequence[str] = ("text",),
                        input_format: str = "auto", byte_fallback: bool = True,
                        character_coverage: float = 0.9999, num_threads: int = 2,
                        documents: Optional[Iterable[str]] = None,
                        log: Callable[[str], None] = _print) -> str:
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


# =============================================================================== preprocessing
def indexed_prefix(output_prefix: str, key: str = "text") -> str:
    """Megatron-LM's naming: tools/preprocess_data.py writes <output_prefix>_<key>_document.{bin,idx}
    and that path (without extension) is what --data-path takes."""
    return f"{output_prefix}_{key}_document"


_worker_state: dict = {}


def _init_worker(tokenizer_type, tokenizer_model, vocab_size, json_keys, fmt, append_eod, path,
                 tokenizer=None):
    _worker_state.update(
        tokenizer=tokenizer or build_tokenizer(tokenizer_type, tokenizer_model, vocab_size),
        json_keys=json_keys, fmt=fmt, append_eod=append_eod, path=path)


def _encode_line(item):
    """(lineno, line) -> (list of token-id lists per key, bytes) or None for a blank line."""
    lineno, line = item
    st = _worker_state
    if not line.strip():
        return None
    if st["fmt"] == "jsonl":
        rec = _parse_record(line, st["path"], lineno, st["json_keys"])
        texts = [rec[k] for k in st["json_keys"]]
    else:
        texts = [line.rstrip("\n")] * len(st["json_keys"])
    tok = st["tokenizer"]
    out = []
    for text in texts:
        ids = list(tok.tokenize(text))
        if ids and st["append_eod"]:
            ids.append(tok.eod)
        out.append(ids)
    return out, len(line.encode("utf-8"))


def preprocess_to_indexed(input_path: str, output_prefix: str, tokenizer_type: str,
                          tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                          json_keys: Sequence[str] = ("text",), append_eod: bool = True,
                          workers: int = 1, input_format: str = "auto", log_interval: int = 1000,
                          log: Callable[[str], None] = _print, _fail_after_docs: int = -1,
                          ) -> dict[str, str]:
    """Tokenize a text/JSONL file (one document per line, .xz/.bz2/.gz accepted) into Megatron
    indexed datasets, one per JSON key: <output_prefix>_<key>_document.{bin,idx}. Each line is
    encoded separately; the EOD token follows each document when append_eod. Documents without
    tokens are skipped. Outputs are written under temporary names and renamed at the very end
    (.bin first, .idx last), so an interrupted run leaves no dataset that looks complete.
    Returns {key: prefix}. `_fail_after_docs` exists for tests (simulated crash)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    import numpy as np

    _check_input_file(input_path)
    json_keys = list(json_keys) or ["text"]
    fmt = detect_format(input_path) if input_format == "auto" else input_format
    if fmt not in ("jsonl", "text"):
        raise ValueError(f"--input-format: unknown format {input_format!r} (auto, jsonl, text)")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output-prefix: directory {out_dir} does not exist")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)  # validates early
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    workers = max(1, int(workers or 1))
    log(f"[preprocess_data] {input_path} ({fmt}) -> {indexed_prefix(output_prefix, '<key>')}, "
        f"keys {json_keys}, {tokenizer_type} vocab {tokenizer.vocab_size}, "
        f"eod {tokenizer.eod if append_eod else 'not appended'}, {workers} worker(s)")

    finals = {k: indexed_prefix(output_prefix, k) for k in json_keys}
    tag = f".tmp-{os.getpid()}"
    tmps = {k: p + tag for k, p in finals.items()}
    builders = {}
    pool = None
    try:
        for k in json_keys:
            builders[k] = IndexedDatasetBuilder(tmps[k] + ".bin", dtype=dtype)
        init_args = (tokenizer_type, tokenizer_model, vocab_size, json_keys, fmt, append_eod,
                     input_path)
        t0 = time.time()
        with open_text(input_path) as f:
            lines = enumerate(f, 1)
            if workers > 1:
                import multiprocessing as mp
                # fork (as Megatron-LM's tool): workers inherit the loaded tokenizer instantly;
                # spawn would re-import Megatron-Core in every worker (seconds each).
                method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
                pool = mp.get_context(method).Pool(
                    workers, _init_worker, init_args + ((tokenizer,) if method == "fork" else ()))
                results = pool.imap(_encode_line, lines, chunksize=8)
            else:
                _init_worker(*init_args, tokenizer=tokenizer)
                results = map(_encode_line, lines)
            docs = skipped = ntokens = nbytes = 0
            for res in results:
                if res is None:
                    continue
                per_key, size = res
                nbytes += size
                if all(len(ids) == 0 for ids in per_key):
                    skipped += 1
                    continue
                for k, ids in zip(json_keys, per_key):
                    if ids:
                        builders[k].add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
                    ntokens += len(ids)
                docs += 1
                if docs == _fail_after_docs:
                    raise RuntimeError(f"simulated failure after {docs} documents")
                if log_interval and docs % log_interval == 0:
                    el = max(time.time() - t0, 1e-9)
                    log(f"[preprocess_data] {docs} docs, {ntokens} tokens, "
                        f"{nbytes / el / 1e6:.2f} MB/s")
        for k in json_keys:
            builders[k].finalize(tmps[k] + ".idx")
        if docs == 0:
            raise ValueError(f"--input: {input_path} contains no non-empty documents")
        # Commit: drop any old .idx first so no stale pair survives, then .bin, then .idx.
        for k in json_keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(finals[k] + ".idx")
            os.replace(tmps[k] + ".bin", finals[k] + ".bin")
            os.replace(tmps[k] + ".idx", finals[k] + ".idx")
        el = max(time.time() - t0, 1e-9)
        log(f"[preprocess_data] done: {docs} docs ({skipped} empty skipped), {ntokens} tokens, "
            f"{nbytes / 1e6:.1f} MB in {el:.1f} s ({nbytes / el / 1e6:.2f} MB/s); "
            f"--data-path {' '.join(finals.values())}")
        return finals
    except UnicodeDecodeError as e:
        raise ValueError(f"--input: {input_path} is not UTF-8 text ({e})") from e
    except (EOFError, lzma.LZMAError) as e:
        raise ValueError(f"--input: cannot read {input_path}: {e}") from e
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for b in builders.values():
            with contextlib.suppress(Exception):
                b.data_file.close()
        for t in tmps.values():
            for ext in (".bin", ".idx"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(t + ext)


# =============================================================================== datasets
def _check_idx_header(idx_path: str) -> Optional[str]:
    """Check the .idx header and size before Megatron's reader sees it (its reader asserts, and a
    half-built IndexedDataset also raises again in __del__). Returns a problem or None."""
    import struct
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(34)
    if len(head) < 34:
        return f"{size} bytes, shorter than the 34-byte header"
    if head[:9] != _INDEX_HEADER:
        return "bad magic header"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        return f"unsupported version {version}"
    try:
        DType.dtype_from_code(code)
    except Exception:
        return f"unknown dtype code {code}"
    expected = 34 + n_seq * (4 + 8) + n_doc * 8
    if size not in (expected, expected + n_seq):          # + n_seq: multimodal sequence modes
        return f"{size} bytes but the header describes {n_seq} sequences / {n_doc - 1} documents " \
               f"({expected} bytes): truncated or overwritten"
    return None


def validate_indexed_prefix(prefix: str, flag: str = "--data-path") -> int:
    """Check that <prefix>.bin/.idx exist, the .idx parses and matches the .bin size.
    Returns the number of documents; raises ValueError naming the flag and file."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if prefix.endswith((".bin", ".idx")):
        raise ValueError(f"{flag}: {prefix}: give the prefix without .bin/.idx "
                         f"(e.g. {prefix[:-4]})")
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        what = f"{prefix}.bin/.idx" if len(missing) == 2 else missing[0]
        raise ValueError(f"{flag}: {what} not found; {_PREPROCESS_HINT}")
    idx_problem = _check_idx_header(prefix + ".idx")
    if idx_problem:
        raise ValueError(f"{flag}: {prefix}.idx is corrupted or not a Megatron index file "
                         f"({idx_problem}); rebuild it with tools/preprocess_data.py")
    try:
        ds = IndexedDataset(prefix, mmap=True)
        n_docs = len(ds.document_indices) - 1
        n_seq = len(ds)
        if n_seq:
            itemsize = ds.index.dtype_size
            end = int(ds.index.sequence_pointers[-1]) + int(ds.index.sequence_lengths[-1]) * itemsize
        else:
            end = 0
    except Exception as e:
        raise ValueError(f"{flag}: {prefix}.idx is corrupted or not a Megatron index file "
                         f"({type(e).__name__}: {e}); rebuild it with tools/preprocess_data.py"
                         ) from e
    bin_size = os.path.getsize(prefix + ".bin")
    if end != bin_size:
        raise ValueError(f"{flag}: {prefix}.bin ({bin_size} bytes) does not match {prefix}.idx "
                         f"(expects {end} bytes): truncated or from another run; "
                         f"rebuild it with tools/preprocess_data.py")
    if n_seq == 0:
        raise ValueError(f"{flag}: {prefix} contains no documents; {_PREPROCESS_HINT}")
    return n_docs


def _flatten_paths(paths) -> Optional[list[str]]:
    if paths is None:
        return None
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        if isinstance(p, (list, tuple)):
            out.extend(str(q) for q in p)
        else:
            out.append(str(p))
    return out or None


def _parse_blend(paths, flag: str):
    """Megatron-LM's blend list -> (prefixes, weights|None), every prefix validated."""
    from megatron.core.datasets.utils import get_blend_from_list

    paths = _flatten_paths(paths)
    if not paths:
        return None
    numeric = []
    for p in paths:
        try:
            float(p)
            numeric.append(True)
        except ValueError:
            numeric.append(False)
    if len(paths) % 2 == 0 and any(numeric):
        if numeric[0::2] != [True] * (len(paths) // 2) or any(numeric[1::2]):
            raise ValueError(f"{flag}: {' '.join(paths)}: expected 'PREFIX [PREFIX ...]' or "
                             f"'WEIGHT PREFIX [WEIGHT PREFIX ...]'")
    elif any(numeric):
        raise ValueError(f"{flag}: {' '.join(paths)}: a weighted blend needs a weight before "
                         f"every prefix ('WEIGHT PREFIX [WEIGHT PREFIX ...]')")
    prefixes, weights = get_blend_from_list(paths)
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise ValueError(f"{flag}: blend weights must be non-negative with a positive sum "
                         f"(got {weights})")
    for p in prefixes:
        validate_indexed_prefix(p, flag)
    return list(prefixes), (list(weights) if weights is not None else None)


def _check_split(split: str) -> str:
    s = "" if split is None else str(split).strip()
    parts = re.split(r"[,/]", s) if s else []
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        vals = None
    if not vals or len(vals) > 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ValueError(f"--split: {split!r} is not valid; expected up to three comma-separated "
                         f"non-negative weights for train,valid,test with a positive sum, "
                         f"e.g. '969,30,1' or '90,10,0'")
    return ",".join(parts)


def _check_splits_have_documents(blend, split_matrix, sizes, split_arg):
    """Megatron loops forever building samples from a split with no documents: refuse it first."""
    for i, name in enumerate(("train", "valid", "test")):
        if sizes[i] == 0 or split_matrix[i] is None:
            continue
        for prefix in blend[0]:
            n = validate_indexed_prefix(prefix)
            # The same rounding as Megatron's BlendedMegatronDatasetBuilder.
            docs = int(round(split_matrix[i][1] * n)) - int(round(split_matrix[i][0] * n))
            if docs == 0:
                raise ValueError(f"--split {split_arg}: the {name} split of {prefix} ({n} documents) gets no "
                                 f"document; give it a larger share or use more data")


def build_gpt_datasets(data_path, split: str, seq_length: int, seed: int,
                       num_samples: tuple[int, int, int], tokenizer, mock: bool = False,
                       cache_dir: Optional[str] = None, valid_data_path=None, test_data_path=None,
                       is_built_on_rank: Optional[Callable[[], bool]] = None,
                       **gpt_config_kwargs):
    """(train, valid, test) Megatron GPT datasets via BlendedMegatronDatasetBuilder.

    data_path: Megatron-LM's --data-path list: ["prefA"] or ["0.3", "prefA", "0.7", "prefB"]
      (prefixes of .bin/.idx pairs). Split into train/valid/test by `split` ("969,30,1").
    valid_data_path / test_data_path (optional, same format): use these for valid/test instead; then
      data_path is entirely train (blend_per_split; `split` is ignored) and a split without a path
      is None.
    mock: MockGPTDataset (no data needed; use with NullTokenizer).
    num_samples: samples per split (Megatron builds whole epochs, so len(ds) >= this); 0 for a
      split -> None returned for it (so is a split without data, e.g. weight 0 in `split`).
    cache_dir: where the sample indices are cached. Without torch.distributed initialised and with a
      blend of several prefixes, Megatron's BlendedDataset cannot use a cache (it queries the rank),
      so then no cache path is passed and GPTDataset caches next to the data (<prefix>/cache/);
      with torch.distributed initialised (pretrain_gpt.py) cache_dir is used as given. Every rank
      must call this function (Megatron builds on rank 0, barrier, then the other ranks).
    is_built_on_rank: Megatron's predicate (default: every rank builds).
    gpt_config_kwargs: passed to GPTDatasetConfig (e.g. eod_mask_loss=True,
      create_attention_mask=False); defaults: reset_position_ids/reset_attention_mask/eod_mask_loss
      False.
    Each sample is a dict of torch tensors: tokens and labels (seq_length each, from seq_length+1
    consecutive tokens), loss_mask, position_ids and (unless create_attention_mask=False)
    attention_mask.
    """
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if not isinstance(seq_length, int) or seq_length <= 0:
        raise ValueError(f"--seq-length: must be a positive integer (got {seq_length!r})")
    sizes = [int(x) for x in num_samples]
    if len(sizes) != 3 or any(x < 0 for x in sizes):
        raise ValueError(f"num_samples: expected three non-negative sample counts (train, valid, "
                         f"test), got {num_samples!r}")
    if tokenizer is None:
        raise ValueError("tokenizer: required (build_tokenizer(...))")

    blend = blend_per_split = None
    split_arg: Optional[str] = None
    if mock:
        split_arg = _check_split(split or "969,30,1")
    elif valid_data_path is not None or test_data_path is not None:
        blend_per_split = [_parse_blend(data_path, "--data-path"),
                           _parse_blend(valid_data_path, "--valid-data-path"),
                           _parse_blend(test_data_path, "--test-data-path")]
        if blend_per_split[0] is None:
            raise ValueError("--data-path: required (training data prefixes); "
                             f"{_PREPROCESS_HINT}, or use mock data")
    else:
        split_arg = _check_split(split)
        blend = _parse_blend(data_path, "--data-path")
        if blend is None:
            raise ValueError(f"--data-path: no data path given; {_PREPROCESS_HINT}, "
                             f"or use mock data (--mock-data)")

    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    path_to_cache = cache_dir
    blends = [blend] if blend is not None else [b for b in (blend_per_split or []) if b]
    if not dist and any(len(b[0]) > 1 for b in blends):
        path_to_cache = None      # BlendedDataset + cache path calls torch.distributed.get_rank()
    if path_to_cache:
        os.makedirs(path_to_cache, exist_ok=True)

    cfg = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    cfg.update(gpt_config_kwargs)
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=seq_length, blend=blend,
        blend_per_split=blend_per_split, split=split_arg, path_to_cache=path_to_cache,
        tokenizer=tokenizer, **cfg)
    if mock:
        assert config.mock
    cls = MockGPTDataset if mock else GPTDataset
    if blend is not None and config.split_matrix is not None:
        # Megatron builds every split with a positive --split weight, even one asked for 0 samples,
        # and loops forever on a split without documents: do not build the splits nobody reads.
        # (split_matrix holds absolute bounds, so the other splits keep exactly their documents.)
        config.split_matrix = [None if n == 0 else bounds for n, bounds in zip(sizes, config.split_matrix)]
        _check_splits_have_documents(blend, config.split_matrix, sizes, split_arg)
    try:
        datasets = BlendedMegatronDatasetBuilder(
            cls, sizes, is_built_on_rank or (lambda: True), config).build()
    except IndexError as e:
        raise ValueError(f"num_samples {tuple(sizes)}: Megatron could not draw the requested "
                         f"samples from --data-path ({e})") from e
    return tuple(None if n == 0 else ds for n, ds in zip(sizes, datasets))


# =============================================================================== default data
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_VALID_EVERY = 10          # every 10th speech (index % 10 == 9) is validation
_DEFAULT_FORMAT_VERSION = 1


def _file_digest(paths: Sequence[str], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def _write_jsonl(path: str, texts: Iterable[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")


def _default_paths(root: str) -> dict:
    return {
        "tokenizer_model": os.path.join(root, "sotu_bpe.model"),
        "train_data_path": [indexed_prefix(os.path.join(root, "sotu_train"))],
        "sotu_valid_data_path": indexed_prefix(os.path.join(root, "sotu_valid")),
        "heldout_data_path": indexed_prefix(os.path.join(root, "wiki")),
    }


def _default_complete(root: str) -> bool:
    paths = _default_paths(root)
    files = [paths["tokenizer_model"], os.path.join(root, "manifest.json")]
    for p in paths["train_data_path"] + [paths["sotu_valid_data_path"], paths["heldout_data_path"]]:
        files += [p + ".bin", p + ".idx"]
    return all(os.path.isfile(f) for f in files)


def _build_default(root_tmp: str, sotu: str, wiki: str, log) -> None:
    docs = [rec["text"] for rec in iter_records(sotu, ("text",), "jsonl")]
    train = [d for i, d in enumerate(docs) if i % DEFAULT_VALID_EVERY != DEFAULT_VALID_EVERY - 1]
    valid = [d for i, d in enumerate(docs) if i % DEFAULT_VALID_EVERY == DEFAULT_VALID_EVERY - 1]
    log(f"[default data] SOTU: {len(train)} train / {len(valid)} valid speeches "
        f"(every {DEFAULT_VALID_EVERY}th speech is valid)")
    _write_jsonl(os.path.join(root_tmp, "sotu_train.jsonl"), train)
    _write_jsonl(os.path.join(root_tmp, "sotu_valid.jsonl"), valid)
    model = train_sentencepiece([], os.path.join(root_tmp, "sotu_bpe"), DEFAULT_VOCAB_SIZE, "bpe",
                                documents=train, log=log)
    for name, src in (("sotu_train", os.path.join(root_tmp, "sotu_train.jsonl")),
                      ("sotu_valid", os.path.join(root_tmp, "sotu_valid.jsonl")),
                      ("wiki", wiki)):
        preprocess_to_indexed(src, os.path.join(root_tmp, name), "SentencePieceTokenizer", model,
                              json_keys=("text",), append_eod=True, workers=1,
                              input_format="jsonl", log_interval=100, log=log)
    for name in ("sotu_train.jsonl", "sotu_valid.jsonl"):
        os.unlink(os.path.join(root_tmp, name))


def ensure_default_data(cache_dir: str = "runs/cache") -> dict:
    """Build (once) and return the default tokenizer and datasets from the bundled corpora.

    Returns {"tokenizer_model": <.model path>, "tokenizer_type": "SentencePieceTokenizer",
    "vocab_size": <pieces>, "train_data_path": [<SOTU train prefix>] (for --data-path),
    "sotu_valid_data_path": <SOTU valid prefix>, "heldout_data_path": <Wikipedia prefix>,
    "root": <directory>}.

    First call: trains a BPE tokenizer (vocab 4096) on the SOTU training speeches and builds
    indexed datasets for SOTU train / valid (split by speech: every 10th speech is valid) and the
    Wikipedia sample (held out; another distribution) -- about 15 s. Everything goes to a temp
    directory that is renamed to <cache_dir>/default_data-<hash> when complete (the hash covers the
    corpus files and build settings, so a changed corpus rebuilds). Later calls only check that the
    files exist. Concurrent callers (several ranks or processes on one machine) are serialised by an
    fcntl lock on <cache_dir>/default_data.lock: one builds, the others wait and reuse it.
    """
    import fcntl

    sotu = os.path.join(BUNDLED_DATA_DIR, "sotu.txt.xz")
    wiki = os.path.join(BUNDLED_DATA_DIR, "wiki.txt.xz")
    for p in (sotu, wiki):
        if not os.path.isfile(p):
            raise ValueError(f"bundled corpus {p} is missing; rebuild it with "
                             f"tools/fetch_corpus.py")
    settings = f"v{_DEFAULT_FORMAT_VERSION} bpe{DEFAULT_VOCAB_SIZE} valid%{DEFAULT_VALID_EVERY}"
    os.makedirs(cache_dir, exist_ok=True)
    digest = _file_digest([sotu, wiki], settings)
    root = os.path.abspath(os.path.join(cache_dir, f"default_data-{digest}"))

    def result() -> dict:
        out = _default_paths(root)
        with open(os.path.join(root, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        out.update(tokenizer_type="SentencePieceTokenizer", vocab_size=manifest["vocab_size"],
                   root=root)
        return out

    if _default_complete(root):
        return result()
    with open(os.path.join(cache_dir, "default_data.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _default_complete(root):          # someone else built it while we waited
                return result()
            t0 = time.time()
            _print(f"[default data] building {root} (tokenizer + indexed datasets, once) ...")
            tmp = tempfile.mkdtemp(prefix=".tmp-default_data-", dir=cache_dir)
            try:
                _build_default(tmp, sotu, wiki, _print)
                import sentencepiece as spm
                sp = spm.SentencePieceProcessor(model_file=os.path.join(tmp, "sotu_bpe.model"))
                with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
                    json.dump({"settings": settings, "corpus_digest": digest,
                               "vocab_size": sp.get_piece_size(),
                               "sotu": os.path.relpath(sotu, REPO_ROOT),
                               "wiki": os.path.relpath(wiki, REPO_ROOT)}, f, indent=1)
                os.chmod(tmp, 0o755)             # mkdtemp makes it private
                if os.path.exists(root):         # incomplete leftover of an older layout
                    shutil.rmtree(root)
                os.replace(tmp, root)
            finally:
                if os.path.exists(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
            _print(f"[default data] ready in {time.time() - t0:.1f} s: {root}")
            return result()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
