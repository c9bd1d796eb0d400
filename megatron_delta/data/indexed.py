"""Megatron indexed datasets (.bin / .idx): preprocessing of text into them (tools/preprocess_data.py) and
the validation of a --data-path prefix before Megatron's reader sees it (its reader asserts).
"""
from __future__ import annotations

import contextlib
import lzma
import os
import time
from typing import Callable, Optional, Sequence

from megatron_delta.data.text import _check_input_file, _parse_record, detect_format, open_text, print_flush
from megatron_delta.data.tokenizers import build_tokenizer

_PREPROCESS_HINT = "build it with tools/preprocess_data.py"


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
                          log: Callable[[str], None] = print_flush, _fail_after_docs: int = -1,
                          ) -> dict[str, str]:
    """Tokenize a text/JSONL file (one document per line, .xz/.bz2/.gz accepted) into Megatron
    indexed datasets, one per JSON key: <output_prefix>_<key>_document.{bin,idx}. Each line is
    encoded separately; the EOD token follows each document when append_eod. Documents without
    tokens are skipped. Outputs are written under temporary names and renamed at the very end
    (.bin first, .idx last), so an interrupted run leaves no dataset that looks complete.
    Returns {key: prefix}. `_fail_after_docs` exists for tests (simulated crash)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

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


# =============================================================================== validation
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


