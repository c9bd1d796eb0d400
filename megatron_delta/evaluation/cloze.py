"""An offline LAMBADA-style last-word cloze task on held-out text, run with lm-evaluation-harness.

Examples are built, deterministically, from text that training never sees (megatron_delta.data): the
SOTU validation speeches (every 10th speech) and the Wikipedia sample. Each paragraph is split into
sentences, consecutive sentences are packed into passages of `min_words`..`max_words` words, and a
passage is kept when its last word is alphabetic and at least `min_target_chars` long. The context is
the passage up to that word; the target is the word (LAMBADA style: the model must produce it after
`context + " "`). Up to `max_examples` passages per source are kept (an evenly spaced, seeded choice).

`ensure_cloze_data(cache_dir)` writes `<cache_dir>/cloze-<hash>/{sotu_valid,wiki}.jsonl` once (the hash
covers the corpus files and the settings). `run_cloze_eval(hf_dir, data_dir)` evaluates an exported
transformers model on them through the local lm-eval task definitions in `lm_eval_tasks/` beside this module (a
`loglikelihood` task: accuracy = the whole target word is the greedy continuation, perplexity = exp of
minus the mean log-likelihood of the target word), with the Hugging Face hub and datasets offline;
`sample_records(out)` lists its per-example results (tools/cloze_eval.py --samples-file).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile

from megatron_delta.data.corpus import BUNDLED_DATA_DIR, DEFAULT_VALID_EVERY
from megatron_delta.data.text import iter_records, split_sentences

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")  # package data
SOURCES = ("sotu_valid", "wiki")
TASK_OF = {"sotu_valid": "delta_cloze_sotu", "wiki": "delta_cloze_wiki"}
_FORMAT_VERSION = 1
_WORD = re.compile(r"^(?P<word>[A-Za-z]+)[.!?,;:\"')\]\u201d\u2019]*$")


class ClozeError(ValueError):
    """Bad input or missing dependency; the message names the flag, file or package."""


# ------------------------------------------------------------------------------------ building examples
def held_out_paragraphs(source: str) -> list[str]:
    """Paragraphs of the held-out text: SOTU validation speeches (one paragraph each: the corpus has no
    paragraph breaks) or the Wikipedia sample's lines."""
    if source == "sotu_valid":
        docs = [r["text"] for r in iter_records(os.path.join(BUNDLED_DATA_DIR, "sotu.txt.xz"), ("text",), "jsonl")]
        return [d for i, d in enumerate(docs) if i % DEFAULT_VALID_EVERY == DEFAULT_VALID_EVERY - 1]
    if source == "wiki":
        out = []
        for r in iter_records(os.path.join(BUNDLED_DATA_DIR, "wiki.txt.xz"), ("text",), "jsonl"):
            out += [line for line in r["text"].splitlines() if line.strip()]
        return out
    raise ClozeError(f"unknown source {source!r} (one of {', '.join(SOURCES)})")


def passages(paragraph: str, min_words: int, max_words: int) -> list[str]:
    """Consecutive sentences packed greedily into passages of at most max_words words (at least
    min_words); a sentence longer than max_words ends the current passage and is skipped."""
    out, cur, n = [], [], 0
    for sent in split_sentences(paragraph):
        w = len(sent.split())
        if w > max_words:
            if n >= min_words:
                out.append(" ".join(cur))
            cur, n = [], 0
            continue
        if n + w > max_words:
            if n >= min_words:
                out.append(" ".join(cur))
            cur, n = [], 0
        cur.append(sent)
        n += w
    if n >= min_words:
        out.append(" ".join(cur))
    return out


def cloze_example(passage: str, min_target_chars: int = 3):
    """{"context", "target"} for a passage whose last word is alphabetic, else None."""
    words = passage.split()
    m = _WORD.match(words[-1]) if len(words) > 1 else None
    if not m or len(m.group("word")) < min_target_chars:
        return None
    return {"context": " ".join(words[:-1]), "target": m.group("word")}


def build_examples(source: str, max_examples: int = 500, min_words: int = 20, max_words: int = 60,
                   min_target_chars: int = 3, seed: int = 1234) -> list[dict]:
    """Deterministic cloze examples of one source (see the module docstring)."""
    cands = []
    for pi, para in enumerate(held_out_paragraphs(source)):
        for k, psg in enumerate(passages(para, min_words, max_words)):
            ex = cloze_example(psg, min_target_chars)
            if ex:
                cands.append({"id": f"{source}-{pi}-{k}", "source": source, **ex})
    if max_examples and len(cands) > max_examples:
        keep = sorted(random.Random(seed).sample(range(len(cands)), max_examples))
        cands = [cands[i] for i in keep]
    return cands


def _settings(max_examples, min_words, max_words, min_target_chars, seed):
    return {"format": _FORMAT_VERSION, "max_examples": max_examples, "min_words": min_words,
            "max_words": max_words, "min_target_chars": min_target_chars, "seed": seed,
            "valid_every": DEFAULT_VALID_EVERY}


def ensure_cloze_data(cache_dir: str = os.path.join("runs", "cache"), max_examples: int = 500, min_words: int = 20,
                      max_words: int = 60, min_target_chars: int = 3, seed: int = 1234, log=print) -> str:
    """Build (once) the cloze JSONL files; returns their directory."""
    if max_examples < 0 or min_words < 1 or max_words < min_words:
        raise ClozeError(f"--max-examples >= 0 and 1 <= --min-words <= --max-words are needed (got "
                         f"{max_examples}, {min_words}, {max_words})")
    settings = _settings(max_examples, min_words, max_words, min_target_chars, seed)
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for name in ("sotu.txt.xz", "wiki.txt.xz"):
        path = os.path.join(BUNDLED_DATA_DIR, name)
        if not os.path.isfile(path):
            raise ClozeError(f"bundled corpus {path} is missing; rebuild it with tools/fetch_corpus.py")
        with open(path, "rb") as f:
            h.update(f.read())
    root = os.path.abspath(os.path.join(cache_dir, f"cloze-{h.hexdigest()[:12]}"))
    if all(os.path.isfile(os.path.join(root, f"{s}.jsonl")) for s in SOURCES):
        return root
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-cloze-", dir=cache_dir)
    try:
        counts = {}
        for s in SOURCES:
            rows = build_examples(s, max_examples, min_words, max_words, min_target_chars, seed)
            counts[s] = len(rows)
            with open(os.path.join(tmp, f"{s}.jsonl"), "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"settings": settings, "examples": counts}, f, indent=1)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, root)
        except OSError:  # another process built it meanwhile (a non-empty target is not replaced)
            if not all(os.path.isfile(os.path.join(root, f"{s}.jsonl")) for s in SOURCES):
                raise
        log(f"[cloze] built {root}: " + ", ".join(f"{s} {n} examples" for s, n in counts.items()))
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def read_examples(data_dir: str, source: str, flag: str = "cloze data") -> list[dict]:
    """The examples of one source; a clear error when the file is missing or malformed."""
    path = os.path.join(data_dir, f"{source}.jsonl")
    if not os.path.isfile(path):
        raise ClozeError(f"{flag}: {path} is missing; build the examples with tools/cloze_eval.py --build-only")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ClozeError(f"{flag}: {path}:{lineno}: not valid JSON ({err})") from err
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) and row.get(k)
                                                    for k in ("id", "context", "target")):
                raise ClozeError(f"{flag}: {path}:{lineno}: expected an object with non-empty 'id', 'context', "
                                 f"'target' strings")
            rows.append(row)
    if not rows:
        raise ClozeError(f"{flag}: {path} holds no examples")
    return rows


# ------------------------------------------------------------------------------------ lm-eval
def offline_environment():
    """Nothing below may reach the network: the model, tokenizer and data are local."""
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[k] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def check_hf_dir(hf_dir: str) -> None:
    if not hf_dir or not os.path.isdir(hf_dir):
        raise ClozeError(f"--hf: {hf_dir} is not a directory (export one with tools/convert_checkpoint.py export)")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ClozeError(f"--hf: {hf_dir} has no config.json: not a transformers model directory "
                         f"(export one with tools/convert_checkpoint.py export)")


def import_lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.tasks import TaskManager  # noqa: F401
    except ImportError as err:
        raise ClozeError(f"lm-eval is not installed ({err}); run `make setup` (requirements-lock.txt pins "
                         f"lm-eval) or `pip install lm-eval==0.4.13`") from err
    import lm_eval

    return lm_eval


def run_cloze_eval(hf_dir: str, data_dir: str, sources=SOURCES, batch_size: int = 8, limit=None,
                   max_length=None) -> dict:
    """lm-eval's simple_evaluate on the local tasks; returns {source: {"acc", "ppl", "n"}} and the raw results."""
    offline_environment()
    check_hf_dir(hf_dir)
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    for s in sources:
        read_examples(data_dir, s)  # clear error before the harness starts
    model_args = {"pretrained": os.path.abspath(hf_dir), "trust_remote_code": True, "add_bos_token": False,
                  "dtype": "float32", "device": "cpu"}
    if max_length:
        model_args["max_length"] = int(max_length)
    tm = TaskManager(include_path=TASKS_DIR, include_defaults=False,
                     metadata={"cloze_data_dir": os.path.abspath(data_dir)})
    tasks = [TASK_OF[s] for s in sources]
    res = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks, task_manager=tm,
                                  batch_size=batch_size, limit=limit, num_fewshot=0, log_samples=True,
                                  bootstrap_iters=0, random_seed=1234, numpy_random_seed=1234,
                                  torch_random_seed=1234, fewshot_random_seed=1234)
    summary = {}
    for s in sources:
        r = res["results"][TASK_OF[s]]
        samples = res["samples"][TASK_OF[s]]
        summary[s] = {"acc": r["acc,none"], "ppl": r["perplexity,none"], "n": len(samples),
                      "task": TASK_OF[s]}
    return {"summary": summary, "results": res}


def sample_records(out: dict):
    """run_cloze_eval's per-example results, per source in document order: {"source", "id", "target",
    "loglikelihood", "greedy"} (lm-eval's log-likelihood of the target word and whether it is the greedy
    continuation)."""
    for s, r in out["summary"].items():
        for smp in sorted(out["results"]["samples"][r["task"]], key=lambda x: x["doc_id"]):
            ll, greedy = smp["resps"][0][0]
            yield {"source": s, "id": smp["doc"]["id"], "target": smp["doc"]["target"], "loglikelihood": float(ll),
                   "greedy": bool(greedy)}


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")

