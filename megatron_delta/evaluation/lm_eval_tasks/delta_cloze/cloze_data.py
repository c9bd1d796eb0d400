"""Loader of the local cloze examples for lm-evaluation-harness (custom_dataset of the delta_cloze tasks)."""
import glob
import json
import os


def _default_dir():
    """The newest build under runs/cache of the current directory (ensure_cloze_data's default cache)."""
    found = sorted(glob.glob(os.path.join("runs", "cache", "cloze-*", "manifest.json")),
                   key=os.path.getmtime)
    if not found:
        raise FileNotFoundError("no cloze data under runs/cache: build it with `python tools/cloze_eval.py "
                                "--build-only`, or pass --metadata '{\"cloze_data_dir\": DIR}'")
    return os.path.dirname(found[-1])


def load(source, cloze_data_dir=None, **_):
    import datasets

    path = os.path.join(cloze_data_dir or _default_dir(), f"{source}.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"cloze data {path} is missing: "
                                "build it with `python tools/cloze_eval.py --build-only`")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
