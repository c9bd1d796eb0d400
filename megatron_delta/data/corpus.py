"""The bundled default corpus: the run with no data flags trains on it (trainer/embedded.py). Built once
into a cache directory (tokenizer + indexed datasets) from the compressed texts shipped beside this module
(bundled/: sotu.txt.xz, wiki.txt.xz and their licences, NOTICE.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Iterable, Sequence

from megatron_delta.data.indexed import indexed_prefix, preprocess_to_indexed
from megatron_delta.data.text import iter_records, print_flush
from megatron_delta.data.tokenizers import train_sentencepiece

# The corpus ships with the package (package data), so an installed megatron-delta finds it too.
BUNDLED_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bundled")

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
            print_flush(f"[default data] building {root} (tokenizer + indexed datasets, once) ...")
            tmp = tempfile.mkdtemp(prefix=".tmp-default_data-", dir=cache_dir)
            try:
                _build_default(tmp, sotu, wiki, print_flush)
                import sentencepiece as spm
                sp = spm.SentencePieceProcessor(model_file=os.path.join(tmp, "sotu_bpe.model"))
                with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
                    json.dump({"settings": settings, "corpus_digest": digest,
                               "vocab_size": sp.get_piece_size(),
                               "sotu": os.path.basename(sotu), "wiki": os.path.basename(wiki)}, f, indent=1)
                os.chmod(tmp, 0o755)             # mkdtemp makes it private
                if os.path.exists(root):         # incomplete leftover of an older layout
                    shutil.rmtree(root)
                os.replace(tmp, root)
            finally:
                if os.path.exists(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
            print_flush(f"[default data] ready in {time.time() - t0:.1f} s: {root}")
            return result()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
