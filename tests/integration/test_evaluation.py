"""Evaluation tools: held-out perplexity of a checkpoint (tools/perplexity.py) and the
offline last-word cloze task run with lm-evaluation-harness (tools/cloze_eval.py).

Both are checked against independent computations on a tiny model trained on the bundled corpus and
exported to transformers: the perplexity against the exported model run on SentencePiece tokens of the
raw held-out text; the harness's per-example log-likelihoods, greedy flags, accuracy and perplexity
against a direct transformers computation over the same examples (with examples whose target is the
model's own greedy word, so accuracy is not trivially 0).
"""
import json
import lzma
import math
import os
import subprocess
import sys

import pytest

from megatron_delta.data.corpus import BUNDLED_DATA_DIR
from tests.helpers import REPO_ROOT
from tests.helpers.flags import tiny

TINY = tiny(num_layers=2, hidden=64, heads=4, groups=2, seq=64, mbs=4, mock=False) + ["--save-interval", "1000"]
SEQ = 64


def _run(script, *argv, timeout=600, check=True):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(REPO_ROOT, script), *argv], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, f"{script} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _errors(p):
    """The error lines a failed tool printed (no traceback)."""
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return [line for line in p.stderr.splitlines() if "error:" in line]


# ------------------------------------------------------------------------------ tiny trained model
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer delta_block model trained 100 iterations on the SOTU training speeches, and its export."""
    from megatron_delta.data.corpus import ensure_default_data

    paths = ensure_default_data(os.path.join(REPO_ROOT, "runs", "cache"))
    d = tmp_path_factory.mktemp("evalrun")
    _run("pretrain_gpt.py", *TINY, "--residual", "delta_block", "--delta-num-blocks", "2",
         "--train-data-path", paths["train_data_path"][0], "--valid-data-path", paths["sotu_valid_data_path"],
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", paths["tokenizer_model"],
         "--train-iters", "100", "--eval-iters", "1", "--eval-interval", "100", "--lr", "3e-3",
         "--save", str(d / "ckpt"))
    _run("tools/convert_checkpoint.py", "export", "--load", str(d / "ckpt"), "--output", str(d / "hf"))
    return {"dir": d, "ckpt": str(d / "ckpt"), "hf": str(d / "hf"), "paths": paths}


def _hf_model(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(hf_dir)


# ------------------------------------------------------------------------------------ perplexity
def _raw_held_out_docs():
    """The held-out documents straight from the bundled corpus files (no project code)."""
    with lzma.open(os.path.join(BUNDLED_DATA_DIR, "sotu.txt.xz"), "rt", encoding="utf-8") as f:
        sotu = [json.loads(line)["text"] for line in f if line.strip()]
    with lzma.open(os.path.join(BUNDLED_DATA_DIR, "wiki.txt.xz"), "rt", encoding="utf-8") as f:
        wiki = [json.loads(line)["text"] for line in f if line.strip()]
    return {"sotu_valid": [d for i, d in enumerate(sotu) if i % 10 == 9], "wiki": wiki}


@pytest.mark.slow
def test_perplexity_tool_matches_transformers_on_raw_text(tiny, tmp_path):
    import sentencepiece
    import torch
    import torch.nn.functional as F

    max_tokens = 3 * SEQ + 17  # three full windows and a short one
    out = tmp_path / "ppl.json"
    text = _run("tools/perplexity.py", "--load", tiny["ckpt"], "--max-tokens", str(max_tokens),
                "--batch-size", "2", "--output", str(out)).stdout
    rep = json.load(open(out))
    assert set(rep["datasets"]) == {"sotu_valid", "wiki"} and rep["seq_length"] == SEQ and rep["iteration"] == 100
    assert "[sotu_valid]" in text and "[wiki]" in text

    sp = sentencepiece.SentencePieceProcessor(model_file=tiny["paths"]["tokenizer_model"])
    model, _ = _hf_model(tiny["hf"])
    for name, docs in _raw_held_out_docs().items():
        ids = sp.encode(docs[0])[:max_tokens]  # the first held-out document is longer than max_tokens
        assert len(ids) == max_tokens
        nll, n, start = 0.0, 0, 0
        with torch.no_grad():
            while start + 1 < len(ids):
                x = torch.tensor([ids[start:start + SEQ + 1]])
                logits = model(x[:, :-1]).logits.double()
                nll += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
                n += x.shape[1] - 1
                start += SEQ
        got = rep["datasets"][name]
        assert got["predicted_tokens"] == n == max_tokens - 1 and got["windows"] == 4
        assert got["nll"] == pytest.approx(nll, rel=1e-5)
        assert got["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
        assert 1.0 < got["ppl"] < sp.get_piece_size()  # trained: better than uniform over the vocabulary


def test_perplexity_windows_predict_every_token_once():
    from megatron_delta.evaluation.perplexity import windows

    for n, s in ((2, 4), (5, 4), (9, 4), (10, 4), (100, 7)):
        spans = windows(n, s)
        predicted = [t for a, b in spans for t in range(a + 1, b)]
        assert predicted == list(range(1, n)) and all(b - a <= s + 1 for a, b in spans)
    assert windows(1, 4) == [] and windows(0, 4) == []


# ------------------------------------------------------------------------------------ cloze examples
def test_cloze_examples_are_deterministic_and_held_out():
    from megatron_delta.evaluation import cloze

    docs = _raw_held_out_docs()
    with lzma.open(os.path.join(BUNDLED_DATA_DIR, "sotu.txt.xz"), "rt", encoding="utf-8") as f:
        train_text = " ".join(" ".join(json.loads(line)["text"].split()) for i, line in enumerate(f) if i % 10 != 9)
    for source in cloze.SOURCES:
        a = cloze.build_examples(source, max_examples=50)
        assert a == cloze.build_examples(source, max_examples=50) and len(a) == 50
        assert len({e["id"] for e in a}) == 50
        held = "\n".join(" ".join(d.split()) for d in docs[source])
        for e in a:
            words = (e["context"] + " " + e["target"]).split()
            assert 20 <= len(words) <= 60 and e["target"].isalpha() and len(e["target"]) >= 3
            assert e["context"] + " " + e["target"] in held  # a verbatim passage of the held-out text
        for e in a[:10]:  # and never of the training speeches
            assert e["context"] not in train_text


def test_cloze_bad_input_is_one_line(tmp_path):
    p = _run("tools/cloze_eval.py", "--hf", str(tmp_path / "nope"), check=False)
    assert p.returncode == 2 and _errors(p) == [f"cloze_eval.py: error: --hf: {tmp_path / 'nope'} is not a directory "
                                                f"(export one with tools/convert_checkpoint.py export)"]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    p = _run("tools/cloze_eval.py", "--hf", str(tmp_path / "hf"), "--data-dir", str(tmp_path / "nodata"), check=False)
    assert p.returncode == 2 and len(_errors(p)) == 1 and "--data-dir:" in _errors(p)[0]
    assert "sotu_valid.jsonl is missing" in _errors(p)[0]
    p = _run("tools/cloze_eval.py", "--hf", str(tmp_path / "hf"), "--limit", "1", check=False)
    assert p.returncode == 2 and len(_errors(p)) == 1
    assert _errors(p)[0].startswith(f"cloze_eval.py: error: --hf: {tmp_path / 'hf'} could not be loaded as a "
                                    f"transformers model")


def test_cloze_missing_lm_eval_message(tmp_path, monkeypatch, capsys):
    from megatron_delta.evaluation import cloze_eval

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert cloze_eval.main(["--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cloze_eval.py: error: lm-eval is not installed")
    assert "make setup" in err[0]


def test_perplexity_bad_input_is_one_line(tmp_path):
    p = _run("tools/perplexity.py", "--load", str(tmp_path / "nope"), check=False)
    assert p.returncode == 2 and _errors(p) == [f"perplexity.py: error: --load: {tmp_path / 'nope'} does not exist"]
    p = _run("tools/perplexity.py", "--load", str(tmp_path), check=False)  # a directory, but no checkpoint
    assert p.returncode == 2 and len(_errors(p)) == 1
    assert _errors(p)[0].startswith(f"perplexity.py: error: --load: {tmp_path} holds no complete checkpoint")


# ------------------------------------------------------------------------------------ cloze vs direct
def _direct_cloze(model, tok, examples, max_length):
    """lambada_openai's definition, computed directly: the target word's log-likelihood after the context
    (left-truncated to max_length tokens with the target) and whether it is the greedy continuation."""
    import torch

    out = []
    with torch.no_grad():
        for e in examples:
            ctx = tok.encode(e["context"], add_special_tokens=False)
            whole = tok.encode(e["context"] + " " + e["target"], add_special_tokens=False)
            cont = whole[len(ctx):]
            inp = (ctx + cont)[-(max_length + 1):][:-1]
            logp = torch.log_softmax(model(torch.tensor([inp])).logits[0, -len(cont):].double(), -1)
            ll = sum(logp[i, t].item() for i, t in enumerate(cont))
            out.append({"id": e["id"], "ll": ll, "greedy": logp.argmax(-1).tolist() == cont})
    return out


def _greedy_word_examples(model, tok, examples, n):
    """Examples whose target is the model's own greedy next word (a single whole-word token)."""
    import torch

    made = []
    with torch.no_grad():
        for e in examples:
            ctx = tok.encode(e["context"], add_special_tokens=False)
            top = int(model(torch.tensor([ctx[-SEQ:]])).logits[0, -1].argmax())
            piece = tok.convert_ids_to_tokens(top)
            word = piece[1:] if piece.startswith("\u2581") else ""
            if word.isalpha() and tok.encode(e["context"] + " " + word, add_special_tokens=False) == ctx + [top]:
                made.append({"id": e["id"] + "-greedy", "source": e["source"], "context": e["context"],
                             "target": word})
            if len(made) == n:
                break
    return made


@pytest.mark.slow
def test_cloze_harness_matches_direct_transformers(tiny, tmp_path):
    from megatron_delta.evaluation import cloze

    model, tok = _hf_model(tiny["hf"])
    built = cloze.ensure_cloze_data(os.path.join(REPO_ROOT, "runs", "cache"), log=lambda *_: None)
    data = tmp_path / "cloze"
    data.mkdir()
    expected_greedy = set()
    for source in cloze.SOURCES:
        real = cloze.read_examples(built, source)
        greedy = _greedy_word_examples(model, tok, real[12:], 4)
        assert len(greedy) == 4, f"the tiny model has too few whole-word greedy predictions on {source}"
        expected_greedy |= {e["id"] for e in greedy}
        with open(data / f"{source}.jsonl", "w") as f:
            for e in real[:12] + greedy:
                f.write(json.dumps(e) + "\n")
    out, samples = tmp_path / "cloze.json", tmp_path / "samples.jsonl"
    text = _run("tools/cloze_eval.py", "--hf", tiny["hf"], "--data-dir", str(data), "--batch-size", "4",
                "--output", str(out), "--samples-file", str(samples)).stdout
    rep = json.load(open(out))
    assert "last-word accuracy" in text and rep["lm_eval_version"] == "0.4.13"
    got = {}
    for line in open(samples):
        r = json.loads(line)
        got[r["id"]] = r
    for source in cloze.SOURCES:
        examples = cloze.read_examples(str(data), source)
        direct = _direct_cloze(model, tok, examples, model.config.max_position_embeddings)
        for d in direct:
            assert got[d["id"]]["loglikelihood"] == pytest.approx(d["ll"], abs=1e-4)
            assert got[d["id"]]["greedy"] == d["greedy"]
            assert d["greedy"] or d["id"] not in expected_greedy
        acc = sum(d["greedy"] for d in direct) / len(direct)
        ppl = math.exp(-sum(d["ll"] for d in direct) / len(direct))
        r = rep["sources"][source]
        assert r["n"] == len(direct) == 16
        assert r["acc"] == acc and acc >= 4 / 16  # the greedy-word examples are hits
        assert r["ppl"] == pytest.approx(ppl, rel=1e-4)
