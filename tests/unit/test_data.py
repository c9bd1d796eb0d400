"""Data pipeline: tokenizer training, preprocessing to indexed datasets, GPT datasets, errors.

Small inputs only (a few SOTU speeches cut into short documents); everything under tmp_path.
"""
import importlib.util
import itertools
import json
import lzma
import os
import shutil
import threading
import time

import numpy as np
import pytest

from megatron_delta.data import corpus as bundled_corpus  # noqa: E402
from megatron_delta.data.corpus import BUNDLED_DATA_DIR  # noqa: E402
from megatron_delta.data.datasets import build_gpt_datasets  # noqa: E402
from megatron_delta.data.indexed import preprocess_to_indexed, validate_indexed_prefix  # noqa: E402
from megatron_delta.data.text import split_sentences  # noqa: E402
from megatron_delta.data.tokenizers import build_tokenizer, train_sentencepiece  # noqa: E402
from tests.helpers import REPO_ROOT as ROOT

VOCAB = 512


# ----------------------------------------------------------------------------- fixtures / helpers
def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sentences(n_speeches=6):
    """Sentences of the first few speeches of the bundled corpus (reads only the start of the xz)."""
    with lzma.open(os.path.join(BUNDLED_DATA_DIR, "sotu.txt.xz"), "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, n_speeches)]
    return [s for t in texts for s in split_sentences(t)]


def _make_docs(sents, n_docs, per_doc, offset=0):
    return [" ".join(sents[offset + i * per_doc: offset + (i + 1) * per_doc]) for i in range(n_docs)]


def _write_jsonl_xz(path, docs, **extra):
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d, **extra}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    sents = _sentences()
    docs_a = _make_docs(sents, 30, 4) + ["Café “quoted” text — with unicode ½ and Ωmega."]
    docs_b = _make_docs(sents, 20, 3, offset=200)
    return {
        "dir": d,
        "sents": sents,
        "docs_a": docs_a,
        "docs_b": docs_b,
        "jsonl_a": _write_jsonl_xz(d / "a.jsonl.xz", docs_a),
        "jsonl_b": _write_jsonl_xz(d / "b.txt.xz", docs_b),   # JSON Lines detected by content
    }


@pytest.fixture(scope="module")
def sp_model(corpus):
    return train_sentencepiece([corpus["jsonl_a"], corpus["jsonl_b"]],
                                 str(corpus["dir"] / "tok"), VOCAB, "bpe", log=lambda m: None)


@pytest.fixture(scope="module")
def tokenizer(sp_model):
    return build_tokenizer("SentencePieceTokenizer", sp_model, None)


@pytest.fixture(scope="module")
def datasets(corpus, sp_model):
    out = corpus["dir"] / "ds"
    out.mkdir()
    a = preprocess_to_indexed(corpus["jsonl_a"], str(out / "a"), "SentencePieceTokenizer",
                                sp_model, log=lambda m: None)["text"]
    b = preprocess_to_indexed(corpus["jsonl_b"], str(out / "b"), "SentencePieceTokenizer",
                                sp_model, log=lambda m: None)["text"]
    return {"a": a, "b": b}


def _doc_tokens(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(prefix)
    assert list(ds.document_indices) == list(range(len(ds) + 1))   # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def _is_sublist(small, big):
    n = len(small)
    return n == 0 or any(big[i:i + n] == small for i in range(len(big) - n + 1))


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_train_and_round_trip(corpus, sp_model, tokenizer):
    assert os.path.isfile(sp_model) and os.path.isfile(sp_model[:-6] + ".vocab")
    assert not [p for p in os.listdir(corpus["dir"]) if p.startswith(".tmp")]
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.eod == 2
    text = "Fellow-Citizens of the Senate and House of Representatives: the Congress met."
    ids = tokenizer.tokenize(text)
    assert ids and all(isinstance(i, int) and 0 <= i < VOCAB for i in ids)
    assert tokenizer.eod not in ids
    assert tokenizer.detokenize(ids) == text
    # byte fallback: characters never seen in training survive the round trip
    assert tokenizer.detokenize(tokenizer.tokenize("Zürich Ωmega")) == "Zürich Ωmega"


def test_train_tokenizer_cli(corpus, tmp_path, capsys):
    tool = _load_tool("train_tokenizer")
    txt = tmp_path / "plain.txt"
    txt.write_text("\n".join(corpus["docs_a"]) + "\n", encoding="utf-8")
    assert tool.main(["--input", str(txt), "--model-prefix", str(tmp_path / "u"),
                      "--vocab-size", "400", "--model-type", "unigram"]) == 0
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "u.model"), None)
    assert tok.vocab_size == 400
    with pytest.raises(SystemExit):
        tool.main(["--input", str(tmp_path / "missing.txt"), "--model-prefix", str(tmp_path / "v")])
    assert f"--input: {tmp_path / 'missing.txt'} does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--vocab-size 100000 is too large"):
        train_sentencepiece([str(txt)], str(tmp_path / "w"), 100000, log=lambda m: None)
    with pytest.raises(ValueError, match="--vocab-size 100 is too small for this input: at least"):
        train_sentencepiece([str(txt)], str(tmp_path / "w"), 100, log=lambda m: None)
    assert not list(tmp_path.glob("w.*")) and not list(tmp_path.glob(".tmp*"))


def test_sentence_split():
    assert split_sentences('He said "Go." Then we left! Why? Mr. Smith\nNext line') == [
        'He said "Go."', "Then we left!", "Why?", "Mr.", "Smith", "Next line"]


# ----------------------------------------------------------------------------- preprocessing
def test_preprocess_round_trip(corpus, datasets, tokenizer):
    docs = _doc_tokens(datasets["a"])
    assert len(docs) == len(corpus["docs_a"])
    for toks, text in zip(docs, corpus["docs_a"]):
        assert toks == tokenizer.tokenize(text) + [tokenizer.eod]
        assert toks.count(tokenizer.eod) == 1
    assert tokenizer.detokenize(docs[0][:-1]) == corpus["docs_a"][0]
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    assert IndexedDataset(datasets["a"]).index.dtype == np.uint16
    assert validate_indexed_prefix(datasets["a"]) == len(corpus["docs_a"])


def test_preprocess_cli_text_format_and_workers(corpus, datasets, sp_model, tmp_path, capsys):
    """Plain text (one document per line) through the CLI gives the same tokens as the JSONL."""
    tool = _load_tool("preprocess_data")
    txt = tmp_path / "a.txt"
    txt.write_text("\n".join(corpus["docs_a"]) + "\n\n", encoding="utf-8")   # blank line skipped
    assert tool.main(["--input", str(txt), "--output-prefix", str(tmp_path / "t"),
                      "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
                      "--append-eod", "--log-interval", "10", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "docs" in out and "tokens" in out and "MB/s" in out
    assert _doc_tokens(str(tmp_path / "t_text_document")) == _doc_tokens(datasets["a"])
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "t_text_document.bin", "t_text_document.idx"]
    # --no-append-eod: no EOD tokens at all
    preprocess_to_indexed(str(txt), str(tmp_path / "n"), "SentencePieceTokenizer", sp_model,
                            append_eod=False, log=lambda m: None)
    noeod = _doc_tokens(str(tmp_path / "n_text_document"))
    assert [d + [2] for d in noeod] == _doc_tokens(datasets["a"])


def test_preprocess_interrupted_leaves_no_dataset(corpus, sp_model, tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(RuntimeError, match="simulated failure"):
        preprocess_to_indexed(corpus["jsonl_a"], prefix, "SentencePieceTokenizer", sp_model,
                                log=lambda m: None, _fail_after_docs=3)
    assert os.listdir(tmp_path) == []
    # a bad line in the middle of the input: clear error naming file and line, nothing left behind
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "good one."}\n{"text": "good two."}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"--input: {bad}:3: not valid JSON"):
        preprocess_to_indexed(str(bad), prefix, "SentencePieceTokenizer", sp_model,
                                log=lambda m: None)
    missing_key = tmp_path / "nokey.jsonl"
    missing_key.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--json-keys: .*nokey.jsonl:1 has no key 'text'"):
        preprocess_to_indexed(str(missing_key), prefix, "SentencePieceTokenizer", sp_model,
                                log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "nokey.jsonl"]
    with pytest.raises(ValueError, match=r"--input: .*nope.txt does not exist"):
        preprocess_to_indexed(str(tmp_path / "nope.txt"), prefix, "SentencePieceTokenizer",
                                sp_model, log=lambda m: None)


# ----------------------------------------------------------------------------- GPT datasets
def test_gpt_dataset_samples(datasets, tokenizer, tmp_path):
    seq = 16
    train, valid, test = build_gpt_datasets([datasets["a"]], "80,20,0", seq, 1234, (40, 8, 0),
                                              tokenizer, cache_dir=str(tmp_path / "cache"))
    assert test is None
    assert len(train) >= 40 and len(valid) >= 8
    docs = _doc_tokens(datasets["a"])
    for ds in (train, valid):
        for i in (0, 1, len(ds) - 1):
            s = ds[i]
            assert s["tokens"].shape == (seq,) and s["labels"].shape == (seq,)
            assert s["tokens"][1:].tolist() == s["labels"][:-1].tolist()
            window = s["tokens"].tolist() + s["labels"][-1:].tolist()     # seq_length + 1 tokens
            # split at EOD: every piece comes from one document, contiguously
            pieces, cur = [], []
            for t in window:
                cur.append(t)
                if t == tokenizer.eod:
                    pieces.append(cur)
                    cur = []
            pieces.append(cur)
            for p in pieces:
                assert any(_is_sublist(p, d) for d in docs), p
    assert os.listdir(tmp_path / "cache")          # indices were cached where asked
    # the same seed gives the same samples (cache hit), another seed others
    again = build_gpt_datasets([datasets["a"]], "80,20,0", seq, 1234, (40, 8, 0), tokenizer,
                                 cache_dir=str(tmp_path / "cache"))[0]
    assert again[3]["tokens"].tolist() == train[3]["tokens"].tolist()


def _init_gloo(tmp_path):
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    return True


def test_weighted_blend_with_and_without_distributed(datasets, tokenizer, tmp_path):
    import torch.distributed as dist
    blend = ["0.25", datasets["a"], "0.75", datasets["b"]]
    train, valid, test = build_gpt_datasets(blend, "100,0,0", 8, 7, (200, 0, 0), tokenizer)
    assert valid is None and test is None
    assert type(train).__name__ == "BlendedDataset" and len(train) == 200
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert abs(counts[0] - 50) <= 2 and abs(counts[1] - 150) <= 2, counts
    assert train[5]["tokens"].shape == (8,)

    # torch.distributed initialised (as in pretrain_gpt.py): the cache directory is used
    started = _init_gloo(tmp_path)
    try:
        cache = tmp_path / "cache"
        tr2 = build_gpt_datasets(blend, "100,0,0", 8, 7, (200, 0, 0), tokenizer,
                                   cache_dir=str(cache))[0]
        assert np.array_equal(np.asarray(tr2.dataset_index), np.asarray(train.dataset_index))
        assert any("BlendedDataset" in p for p in os.listdir(cache))
        # separate valid path (blend_per_split): all of data_path is train, all of valid is valid
        tr3, va3, te3 = build_gpt_datasets([datasets["a"]], "ignored", 8, 7, (10, 10, 0),
                                             tokenizer, cache_dir=str(cache),
                                             valid_data_path=datasets["b"])
        assert te3 is None and len(tr3) >= 10 and len(va3) >= 10
    finally:
        if started:
            dist.destroy_process_group()


def test_mock_data():
    tok = build_tokenizer("NullTokenizer", None, 100)
    assert tok.vocab_size == 100 and tok.eod == 99
    assert tok.tokenize("3 4 5") == [3, 4, 5] and tok.detokenize([3, 4]) == "3 4"
    train, valid, test = build_gpt_datasets(None, "99,1,0", 16, 1, (10, 2, 0), tok, mock=True)
    assert test is None and train[0]["tokens"].shape == (16,)
    assert int(train[0]["tokens"].max()) <= 99


# ----------------------------------------------------------------------------- errors
def test_error_missing_data_path(datasets, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"--data-path: /x/foo\.bin/\.idx not found; build it with "
                                         r"tools/preprocess_data\.py"):
        build_gpt_datasets(["/x/foo"], "99,1,0", 16, 1, (10, 1, 0), tokenizer)
    with pytest.raises(ValueError, match=r"--valid-data-path: /x/v\.bin/\.idx not found"):
        build_gpt_datasets([datasets["a"]], "99,1,0", 16, 1, (10, 1, 0), tokenizer,
                             valid_data_path=["/x/v"])
    with pytest.raises(ValueError, match=r"--data-path: no data path given"):
        build_gpt_datasets(None, "99,1,0", 16, 1, (10, 1, 0), tokenizer)
    with pytest.raises(ValueError, match=r"--data-path: .*without \.bin/\.idx"):
        build_gpt_datasets(["/x/foo.bin"], "99,1,0", 16, 1, (10, 1, 0), tokenizer)


def test_error_bad_blend(datasets, tokenizer):
    with pytest.raises(ValueError, match=r"--data-path: .*weight"):
        build_gpt_datasets(["0.5", datasets["a"], datasets["b"]], "99,1,0", 16, 1, (10, 1, 0),
                             tokenizer)


def _copy_prefix(src, dst):
    for ext in (".bin", ".idx"):
        shutil.copyfile(src + ext, dst + ext)
    return dst


@pytest.mark.parametrize("damage", ["garbled_header", "truncated_idx", "truncated_bin"])
def test_error_corrupted_dataset(datasets, tokenizer, tmp_path, damage):
    p = _copy_prefix(datasets["a"], str(tmp_path / "c"))
    if damage == "garbled_header":
        with open(p + ".idx", "r+b") as f:
            f.write(b"GARBAGE!!")
        pattern = rf"--data-path: {p}\.idx is corrupted"
    elif damage == "truncated_idx":
        size = os.path.getsize(p + ".idx")
        with open(p + ".idx", "r+b") as f:
            f.truncate(size // 2)
        pattern = rf"--data-path: {p}\.idx is corrupted"
    else:
        size = os.path.getsize(p + ".bin")
        with open(p + ".bin", "r+b") as f:
            f.truncate(size - 10)
        pattern = rf"--data-path: {p}\.bin .* does not match {p}\.idx"
    with pytest.raises(ValueError, match=pattern):
        build_gpt_datasets([p], "99,1,0", 16, 1, (10, 1, 0), tokenizer)


def test_error_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"--tokenizer-model: /x/y\.model does not exist; train one "
                                         r"with tools/train_tokenizer\.py"):
        build_tokenizer("SentencePieceTokenizer", "/x/y.model", None)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00\x01 this is not a sentencepiece model")
    with pytest.raises(ValueError, match=rf"--tokenizer-model: {junk} is not a valid SentencePiece"):
        build_tokenizer("SentencePieceTokenizer", str(junk), None)
    with pytest.raises(ValueError, match=r"--tokenizer-model is required"):
        build_tokenizer("SentencePieceTokenizer", None, None)
    with pytest.raises(ValueError, match=r"--tokenizer-type: unknown tokenizer type 'GPT3'"):
        build_tokenizer("GPT3", None, None)
    with pytest.raises(ValueError, match=r"--vocab-size"):
        build_tokenizer("NullTokenizer", None, None)


@pytest.mark.parametrize("split", ["abc", "1,2,3,4", "0,0,0", "-1,2", "", None])
def test_error_bad_split(datasets, tokenizer, split):
    with pytest.raises(ValueError, match=r"--split: .* is not valid"):
        build_gpt_datasets([datasets["a"]], split, 16, 1, (10, 1, 0), tokenizer)


# ----------------------------------------------------------------------------- default data
def test_ensure_default_data_builds_once_and_is_shared(corpus, tmp_path, monkeypatch):
    """Small stand-in corpora: the real ones take ~15-40 s. Two concurrent callers: one builds."""
    bundled = tmp_path / "bundled"
    bundled.mkdir()
    speeches = _make_docs(corpus["sents"], 20, 6)
    _write_jsonl_xz(bundled / "sotu.txt.xz", speeches, year=1900)
    _write_jsonl_xz(bundled / "wiki.txt.xz", corpus["docs_b"][:5], title="T")
    monkeypatch.setattr(bundled_corpus, "BUNDLED_DATA_DIR", str(bundled))
    monkeypatch.setattr(bundled_corpus, "DEFAULT_VOCAB_SIZE", 400)
    cache = str(tmp_path / "cache")

    results, errors = [], []

    def call():
        try:
            results.append(bundled_corpus.ensure_default_data(cache))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0] == results[1]
    d = results[0]
    assert set(d) >= {"tokenizer_model", "train_data_path", "heldout_data_path",
                      "sotu_valid_data_path"}
    assert isinstance(d["train_data_path"], list)
    assert d["vocab_size"] == 400
    tok = build_tokenizer("SentencePieceTokenizer", d["tokenizer_model"], None)
    n_train = validate_indexed_prefix(d["train_data_path"][0])
    n_valid = validate_indexed_prefix(d["sotu_valid_data_path"])
    assert (n_train, n_valid) == (18, 2)                      # split by speech: every 10th is valid
    assert validate_indexed_prefix(d["heldout_data_path"]) == 5
    valid_docs = _doc_tokens(d["sotu_valid_data_path"])
    assert valid_docs[0] == tok.tokenize(speeches[9]) + [tok.eod]
    # exactly one build directory, no temp leftovers
    assert sorted(p for p in os.listdir(cache) if not p.endswith(".lock")) == [
        os.path.basename(d["root"])]
    t0 = time.time()
    assert bundled_corpus.ensure_default_data(cache) == d
    assert time.time() - t0 < 1.0


def test_unused_split_without_documents_is_not_built(datasets, tokenizer):
    """--split 969,30,1 on a small corpus leaves the test split without documents. Megatron builds
    every split with a positive weight and loops forever on an empty one; a split asked for no
    samples is not built at all, and the others keep exactly their documents."""
    p = datasets["a"]
    n = validate_indexed_prefix(p)
    assert round(0.999 * n) == n  # the test share (1/1000) of this corpus is empty
    train, valid, test = build_gpt_datasets([p], "969,30,1", 16, 1, (10, 1, 0), tokenizer)
    assert test is None and len(train) >= 10 and len(valid) >= 1
    # the train documents are the first round(0.969 n), as with the test split built
    assert set(int(i) for i in train.document_index) == set(range(round(0.969 * n)))
    with pytest.raises(ValueError, match=r"--split 969,30,1: the test split of .* gets no document"):
        build_gpt_datasets([p], "969,30,1", 16, 1, (10, 1, 1), tokenizer)
