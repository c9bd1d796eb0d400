"""Reading text: .txt (one document per line) or .jsonl records, optionally .xz / .bz2 / .gz compressed, and
the sentence splitting of tokenizer training. Errors are ValueError naming the flag or file.
"""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import re
from typing import Iterator, Sequence


def print_flush(msg: str) -> None:
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
