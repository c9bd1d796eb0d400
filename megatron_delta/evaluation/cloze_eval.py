"""Offline LAMBADA-style last-word cloze on held-out text, run with lm-evaluation-harness.

    python tools/convert_checkpoint.py export --load runs/default-delta_block --output hf/delta_block
    python tools/cloze_eval.py --hf hf/delta_block --output cloze.json
    python tools/cloze_eval.py --build-only                 # only build the task data (runs/cache/cloze-*)

The examples (megatron_delta/evaluation/cloze.py) come from text training never sees: the SOTU validation speeches
and the Wikipedia sample. Passages of 20-60 words, cut at sentence boundaries; the target is the last
word (alphabetic, >= 3 letters), the context everything before it. They are built deterministically
once and cached under --cache-dir as JSONL; the lm-eval task definitions are local
(megatron_delta/evaluation/lm_eval_tasks/delta_cloze/*.yaml), the model is the exported transformers directory
(`--model hf`, trust_remote_code for the routed modes), and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are
set: nothing is downloaded.

Printed and written per source: accuracy (the target word is exactly the greedy continuation) and
last-word perplexity (exp of minus the mean log-likelihood of the target word), as lm-eval's
lambada_openai defines them. The contexts are left-truncated to the model's max_position_embeddings.
The same evaluation through lm-eval's own CLI:

    lm_eval --model hf --model_args pretrained=hf/delta_block,trust_remote_code=True,add_bos_token=False \\
        --include_path megatron_delta/evaluation/lm_eval_tasks --tasks delta_cloze_sotu,delta_cloze_wiki \\
        --metadata '{"cloze_data_dir": "runs/cache/cloze-<hash>"}'
"""
import argparse
import json
import os
import sys
import time

PROG = "cloze_eval.py"


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--hf", default=None, help="an exported transformers model directory (tools/convert_checkpoint.py)")
    p.add_argument("--output", default=None, help="write accuracy and perplexity per source as JSON here")
    p.add_argument("--sources", nargs="+", default=["sotu_valid", "wiki"], choices=["sotu_valid", "wiki"])
    p.add_argument("--max-examples", type=int, default=500, help="examples per source (0 = all candidates)")
    p.add_argument("--min-words", type=int, default=20)
    p.add_argument("--max-words", type=int, default=60)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples of each source")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=None,
                   help="context window in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--samples-file", default=None,
                   help="also write per-example results (JSON lines: source, id, target, log-likelihood, greedy)")
    p.add_argument("--cache-dir", default=os.path.join("runs", "cache"))
    p.add_argument("--data-dir", default=None,
                   help="evaluate prebuilt examples (DIR/sotu_valid.jsonl, DIR/wiki.jsonl: one JSON object per line "
                        "with 'id', 'context', 'target') instead of building them")
    p.add_argument("--build-only", action="store_true", help="build the task data, print its directory and stop")
    return p


def main(argv=None):
    opts = build_parser().parse_args(argv)
    from megatron_delta.evaluation.cloze import ClozeError

    try:
        return _run(opts)
    except (ClozeError, FileNotFoundError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


def _run(opts):
    from megatron_delta.evaluation import cloze

    if opts.limit is not None and opts.limit < 1:
        raise cloze.ClozeError(f"--limit must be >= 1, got {opts.limit}")
    if opts.batch_size < 1:
        raise cloze.ClozeError(f"--batch-size must be >= 1, got {opts.batch_size}")
    if not opts.build_only:
        if opts.hf is None:
            raise cloze.ClozeError("--hf is required (an exported model directory), unless --build-only")
        cloze.check_hf_dir(opts.hf)
        cloze.import_lm_eval()
    if opts.data_dir:
        if opts.build_only:
            raise cloze.ClozeError("--build-only builds the default examples; it does not take --data-dir")
        data_dir = os.path.abspath(opts.data_dir)
        for s in opts.sources:
            cloze.read_examples(data_dir, s, flag="--data-dir")
    else:
        data_dir = cloze.ensure_cloze_data(opts.cache_dir, opts.max_examples, opts.min_words, opts.max_words)
    if opts.build_only:
        print(data_dir)
        return 0
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.time()
    try:
        out = cloze.run_cloze_eval(opts.hf, data_dir, opts.sources, opts.batch_size, opts.limit, opts.max_length)
    except (OSError, ValueError) as err:  # transformers cannot load the directory
        if isinstance(err, cloze.ClozeError):
            raise
        msg = " ".join(str(err).split())
        raise cloze.ClozeError(f"--hf: {opts.hf} could not be loaded as a transformers model: "
                               f"{type(err).__name__}: {msg[:300]}") from err
    summary = out["summary"]
    for s, r in summary.items():
        print(f" [{s}] {r['n']} examples | last-word accuracy {r['acc']:.4f} | last-word perplexity {r['ppl']:.2f}")
    print(f" lm-eval {time.time() - t0:.1f} s, data {data_dir}")
    result = {"hf": os.path.abspath(opts.hf), "data_dir": data_dir, "lm_eval_version": cloze.lm_eval_version(),
              "limit": opts.limit, "sources": summary}
    if opts.output:
        os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
        with open(opts.output, "w") as f:
            json.dump(result, f, indent=1)
        print(f" wrote {opts.output}")
    if opts.samples_file:
        with open(opts.samples_file, "w") as f:
            for record in cloze.sample_records(out):
                f.write(json.dumps(record) + "\n")
        print(f" wrote {opts.samples_file}")
    return 0

