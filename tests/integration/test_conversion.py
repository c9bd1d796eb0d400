"""Checkpoint conversion (tools/convert_checkpoint.py, tools/evaluate.py, megatron_delta.convert,
megatron_delta.evaluation.loaders).

(a) every residual mode: pretrain_gpt trains a tiny model 3 iterations under TP2+PP2 (4 gloo ranks, ONE
    launch trains all modes in sequence: tests/helpers/rank_runner.py train_all) -> export (resharded to one
    process) -> transformers logits == Megatron logits (tools/evaluate.py code), fp32, <= EXPORT_TOL (5e-6:
    fp32 round-off, measured 6e-7 .. 1.2e-6; a router query exported x1.0001 would pass 1e-4);
(b) HF -> Megatron -> HF is lossless (tiny Qwen3, tied Llama and Qwen3-MoE, built offline); the routed modes' HF
    model holds Qwen3-MoE's MLP; the export drops MTP depths with one line;
(c) importing with the scalar gate reproduces the HF logits in Megatron;
(d) clear errors: unknown architecture, missing tokenizer, mode / vocabulary mismatch.
CPU, offline, one thread.
"""
import dataclasses
import functools
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import safetensors  # noqa: E402,F401
import torch
import transformers  # noqa: E402,F401  (imported to fail early: required, pinned in requirements-lock.txt)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from megatron_delta.checkpoint import errors, run_config  # noqa: E402
from megatron_delta.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_delta.checkpoint.store import load_checkpoint  # noqa: E402
from megatron_delta.convert import hf_checkpoint, state_dict_adapter  # noqa: E402
from megatron_delta.evaluation import loaders  # noqa: E402
from megatron_delta.evaluation.token_nll import evaluate_tokens  # noqa: E402
from tests.helpers import REPO_ROOT as REPO
from tests.helpers import rank_runner  # noqa: E402
from tests.helpers.conversion import EXPORT_TOL, SEQS, finetune, hf_logits
from tests.helpers.dist_utils import run_distributed  # noqa: E402
from tests.helpers.flags import tiny

TOL = 1e-4
# name -> pretrain_gpt flags of the mode
MODES = {
    "baseline": ["--residual", "baseline"],
    "baseline_llama": ["--residual", "baseline", "--untie-embeddings-and-output-weights"],  # and no qk-layernorm
    "delta": ["--residual", "delta"],
    "delta_block": ["--residual", "delta_block", "--delta-num-blocks", "2", "--delta-gate", "scalar",
                    "--delta-null-source"],
    "attnres": ["--residual", "attnres", "--delta-num-blocks", "2", "--delta-null-source"],
    "full_attnres": ["--residual", "full_attnres"],
}
# TP2+PP2 (4 ranks, DP1): 2 micro-batches of 2 per iteration
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
COMMON = tiny(num_layers=4, hidden=64, heads=4, groups=2, seq=32, mbs=2, gbs=4, lr=3e-2, mock=False) + [
    "--mock-data", "--train-iters", "3", "--eval-iters", "1", "--eval-interval", "100", "--log-interval", "100",
    "--save-interval", "1000"] + LAYOUT


pytestmark = pytest.mark.usefixtures("offline_single_thread", "distributed_teardown")


def _spm_model(tmp):
    import sentencepiece as spm
    words = "the of and to in a is that union state congress nation people government year world".split()
    import random

    rnd = random.Random(0)
    text = "\n".join(" ".join(rnd.choice(words) for _ in range(rnd.randint(3, 12))).capitalize() + "."
                     for _ in range(500))
    (tmp / "corpus.txt").write_text(text)
    spm.SentencePieceTrainer.train(input=str(tmp / "corpus.txt"), model_prefix=str(tmp / "spm"), model_type="bpe",
                                   vocab_size=200, hard_vocab_limit=False, minloglevel=2)
    return str(tmp / "spm.model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train every mode 3 iterations under TP2+PP2 in one 4-rank launch; returns {name: checkpoint dir}."""
    tmp = tmp_path_factory.mktemp("trained")
    spm = _spm_model(tmp)
    runs, argvs = {}, []
    for name, flags in MODES.items():
        runs[name] = str(tmp / name)
        tok = (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm] if name == "baseline"
               else ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"])  # 256 tokens, EOD = 255
        common = [a for a in COMMON if a != "--qk-layernorm"] if name == "baseline_llama" else COMMON
        argvs.append(common + flags + tok + ["--save", runs[name]])
    results = run_distributed(rank_runner.train_all, 4, argvs, timeout=900)
    assert [r["iteration"] for r in results[-1]] == [3] * len(argvs)
    for name, ckpt in runs.items():  # really saved under the TP2+PP2 layout
        rc = json.load(open(os.path.join(ckpt, "iter_0000003", "run_config.json")))
        assert (rc["tensor_model_parallel_size"], rc["pipeline_model_parallel_size"]) == (2, 2), name
    return runs, spm, tmp


# ---------------------------------------------------------------------------------------------- (a)
@pytest.mark.slow
def test_export_every_mode_matches_megatron(trained):
    runs, spm, tmp = trained
    for name, ckpt in runs.items():
        out = str(tmp / f"hf_{name}")
        hf_checkpoint.export_checkpoint(ckpt, out, log=lambda *a: None)
        assert not [f for f in os.listdir(tmp) if f.startswith(f"hf_{name}.tmp-")]  # temp dir renamed away
        model, _, rc = loaders.load_megatron(ckpt)
        vocab = run_config.true_vocab_size(rc)
        seqs = [[t % vocab for t in s] for s in SEQS]
        result, meg_logits = evaluate_tokens(model, vocab, seqs)
        routed = name not in ("baseline", "baseline_llama")
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=routed).eval()
        want_cls = {"baseline": "Qwen3ForCausalLM", "baseline_llama": "LlamaForCausalLM"}.get(
            name, "DeltaQwen3ForCausalLM")
        assert type(hf).__name__ == want_cls, name
        if routed:  # trained routers really moved off their initial values
            assert any(p.abs().sum() > 0 for n, p in hf.named_parameters() if n.endswith("_router.query")), name
        total, worst = 0.0, 0.0
        for ids, ml, seq in zip(seqs, meg_logits, result["sequences"]):
            hl = hf_logits(hf, ids)
            assert hl.shape == ml.shape == (len(ids), vocab)
            diff = (hl - ml).abs().max().item()
            assert diff <= EXPORT_TOL, (name, diff)
            worst = max(worst, diff)
            assert seq["tokens"] == hl.argmax(-1).tolist()
            total += torch.nn.functional.cross_entropy(hl[:-1].double(), torch.tensor(ids[1:]),
                                                       reduction="sum").item()
        assert abs(total - result["total_nll"]) <= 1e-3, name
        assert result["total_tokens"] == sum(len(s) - 1 for s in seqs)
        print(f"[export parity, trained under TP2+PP2] {name}: max |HF - Megatron| logits {worst:.1e}")
    # the SentencePiece tokenizer travels with the export and encodes like training
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=spm)
    tok = AutoTokenizer.from_pretrained(str(tmp / "hf_baseline"))
    for text in ("The state of the union.", "  people   government\nyear", "nation café"):
        assert tok(text)["input_ids"] == sp.encode(text), text


@pytest.mark.slow
def test_evaluate_cli_and_missing_tokenizer(trained, tmp_path):
    runs, spm, tmp = trained
    (tmp_path / "toks.json").write_text(json.dumps([[1, 2, 3, 4], [5, 6]]))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "tools/evaluate.py", "--load", runs["delta"], "--tokens-file",
                           str(tmp_path / "toks.json"), "--output", str(tmp_path / "out.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["total_tokens"] == 4 and len(out["sequences"]) == 2
    assert len(out["sequences"][0]["tokens"]) == 4 and out["total_nll"] > 0
    # missing tokenizer: a clear error before anything is written
    os.rename(spm, spm + ".moved")
    try:
        with pytest.raises(errors.ConversionError, match="tokenizer model .* does not exist"):
            hf_checkpoint.export_checkpoint(runs["baseline"], str(tmp_path / "hf"))
        assert not os.path.exists(tmp_path / "hf")
    finally:
        os.rename(spm + ".moved", spm)


@pytest.mark.slow
def test_evaluate_under_tp2_pp2_matches_tp1(trained, tmp_path):
    """tools/evaluate.py under torchrun-style 4 ranks, TP2 x PP2 (routed mode: the payload crosses the stage
    boundary) gives TP1's NLL and greedy tokens; a layout that does not fit the world size is refused."""
    runs, _, _ = trained
    ckpt = runs["delta_block"]
    seqs = [[1, 5, 9, 200, 3, 3, 17, 255, 0, 42, 7], [250, 2, 64, 128], [3, 4], [7]]
    (tmp_path / "toks.json").write_text(json.dumps(seqs))
    model, _, rc = loaders.load_megatron(ckpt)
    tp1, tp1_logits = evaluate_tokens(model, run_config.true_vocab_size(rc), seqs)
    run_distributed("tools/evaluate.py", 4, "--load", ckpt, "--tokens-file", str(tmp_path / "toks.json"),
                    "--output", str(tmp_path / "out.json"), "--logits-file", str(tmp_path / "logits.pt"),
                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", timeout=600)
    par = json.loads((tmp_path / "out.json").read_text())
    diff = abs(par["total_nll"] - tp1["total_nll"])
    print(f"[evaluate TP2xPP2 vs TP1] delta_block total NLL {par['total_nll']:.6f} vs {tp1['total_nll']:.6f}: "
          f"diff {diff:.1e}")
    assert diff <= 1e-4, (par["total_nll"], tp1["total_nll"])
    assert par["total_tokens"] == tp1["total_tokens"] == sum(len(s) - 1 for s in seqs)
    for a, b in zip(par["sequences"], tp1["sequences"]):
        assert a["tokens"] == b["tokens"] and a["num_tokens"] == b["num_tokens"]
        assert abs(a["nll"] - b["nll"]) <= 1e-4
    for a, b in zip(torch.load(tmp_path / "logits.pt"), tp1_logits):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL
    proc = subprocess.run([sys.executable, "tools/evaluate.py", "--load", ckpt, "--tokens-file",
                           str(tmp_path / "toks.json"), "--output", str(tmp_path / "bad.json"),
                           "--tensor-model-parallel-size", "2"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 2 and not os.path.exists(tmp_path / "bad.json")
    assert "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 needs 2 ranks per model, but the " \
           "world size is 1" in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- (b), (c)
def _tiny(kind, **over):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
              rope_theta=10000.0)
    kw.update(over)
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, **kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **kw))
    with torch.no_grad():  # non-trivial norms so a swapped tensor would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("qk_layernorm,tied", [(True, False), (False, True)])
def test_one_rename_table_inverts_itself(qk_layernorm, tied):
    """HF -> Megatron -> HF through the one rename table gives back every tensor (every field of every router
    included: attention, MLP and final) and uses each Megatron name of the table."""
    L, nh, ng, hn, d, ffn, vocab = 2, 6, 2, 8, 32, 40, 100
    # every parameter a DepthRouter can have (router.py), with its shape
    ROUTER_FIELDS = {"query": (d,), "key_norm_weight": (d,), "null_source": (d,), "gate": (1,)}
    from megatron_delta.core.router import DepthRouter

    full = DepthRouter(d, null_source=True, gate=True, eps=1e-6, kernels="torch")
    assert {n: tuple(p.shape) for n, p in full.named_parameters()} == ROUTER_FIELDS
    g = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj.weight": (nh * hn, d), "self_attn.k_proj.weight": (ng * hn, d),
              "self_attn.v_proj.weight": (ng * hn, d), "self_attn.o_proj.weight": (d, nh * hn),
              "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
              "mlp.gate_proj.weight": (ffn, d), "mlp.up_proj.weight": (ffn, d), "mlp.down_proj.weight": (d, ffn),
              **{f"{r}.{field}": shape
                 for r in ("attn_router", "mlp_router") for field, shape in ROUTER_FIELDS.items()}}
    if qk_layernorm:
        shapes.update({"self_attn.q_norm.weight": (hn,), "self_attn.k_norm.weight": (hn,)})
    hf = {f"model.layers.{i}.{k}": torch.randn(*v, generator=g) for i in range(L) for k, v in shapes.items()}
    hf.update({"model.embed_tokens.weight": torch.randn(vocab, d, generator=g), "model.norm.weight": torch.ones(d),
               **{f"model.final_router.{field}": torch.randn(*shape, generator=g)
                  for field, shape in ROUTER_FIELDS.items()}})
    if not tied:
        hf["lm_head.weight"] = torch.randn(vocab, d, generator=g)
    kw = dict(num_layers=L, num_attention_heads=nh, num_query_groups=ng, kv_channels=hn, hidden_size=d,
              qk_layernorm=qk_layernorm, tied=tied)
    meg = state_dict_adapter.hf_to_megatron_state_dict(hf, padded_vocab_size=128, **kw)
    want = {state_dict_adapter.EMBEDDING[0], state_dict_adapter.FINAL_NORM[0], state_dict_adapter.OUTPUT[0]}
    want |= {f"decoder.layers.{i}.{m}" for i in range(L) for m, _, qk in state_dict_adapter.LAYER_RENAMES
             if qk_layernorm or not qk}
    want |= {f"decoder.layers.{i}.{m}" for i in range(L) for m, _ in state_dict_adapter.LAYER_FUSED}
    want |= {f"decoder.final_router.{field}" for field in ROUTER_FIELDS}
    want |= {f"decoder.layers.{i}.{r}.{field}" for i in range(L) for r in ("self_attention_router", "mlp_router")
             for field in ROUTER_FIELDS}
    assert set(meg) == want
    assert (meg[state_dict_adapter.EMBEDDING[0]].shape == (128, d)
            and not meg[state_dict_adapter.EMBEDDING[0]][vocab:].any())
    back = state_dict_adapter.megatron_to_hf_state_dict(meg, vocab_size=vocab, **kw)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_hf_megatron_hf_roundtrip_is_lossless(tmp_path, kind):
    hf = _tiny(kind)
    hf.save_pretrained(tmp_path / "src")
    hf_checkpoint.import_checkpoint(str(tmp_path / "src"), str(tmp_path / "meg"), "baseline",
                                 tensor_model_parallel_size=2, log=lambda *a: None)
    rc = json.load(open(tmp_path / "meg" / "iter_0000000" / "run_config.json"))
    assert rc["padded_vocab_size"] == 512 and rc["hf_vocab_size"] == 300  # padded for TP2 (128 x 2)
    hf_checkpoint.export_checkpoint(str(tmp_path / "meg"), str(tmp_path / "back"), log=lambda *a: None)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()  # no remote code
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 299]
    assert torch.equal(hf_logits(hf, ids), hf_logits(back, ids))


@pytest.mark.parametrize("kind,mode,extra", [
    ("qwen3", "delta_block", dict(delta_num_blocks=2, delta_gate="scalar", delta_null_source=True)),
    ("llama", "delta", dict(delta_gate="scalar")),
])
def test_import_with_gate_reproduces_hf_logits(tmp_path, kind, mode, extra):
    hf = _tiny(kind)
    hf.save_pretrained(tmp_path / "src")
    hf_checkpoint.import_checkpoint(str(tmp_path / "src"), str(tmp_path / "meg"), mode, log=lambda *a: None, **extra)
    model, _, rc = loaders.load_megatron(str(tmp_path / "meg"))
    assert rc["residual"] == mode and rc["delta_gate"] == "scalar"
    ids = [7, 3, 250, 299, 0, 12, 12, 44]
    meg = loaders.megatron_logits(model, torch.tensor([ids]))[0, :, :300]
    diff = (meg - hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, diff  # measured 1.8e-7 .. 2.4e-7 (logits ~0.5-0.9)
    # and the routed export of the imported model loads as remote code with the same logits
    hf_checkpoint.export_checkpoint(str(tmp_path / "meg"), str(tmp_path / "out"), log=lambda *a: None)
    delta = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True).eval()
    assert (hf_logits(delta, ids) - meg).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------- mixture of experts
def _tiny_moe(norm_topk_prob=True):
    """Tiny Qwen3-MoE: 4 experts, top-2, layer 1 dense (mlp_only_layers), untied, random non-trivial norms."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, mlp_only_layers=[1], num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_import_and_export_roundtrip(tmp_path, norm_topk_prob):
    """Qwen3-MoE -> Megatron's MoE layers (baseline): the HF logits (top-k renormalised = Megatron's softmax over
    the top-k logits; not renormalised = --moe-router-pre-softmax); -> stock Qwen3MoeForCausalLM: every tensor back."""
    hf = _tiny_moe(norm_topk_prob)
    hf.save_pretrained(tmp_path / "src")
    hf_checkpoint.import_checkpoint(str(tmp_path / "src"), str(tmp_path / "meg"), "baseline", log=lambda *a: None)
    model, _, rc = loaders.load_megatron(str(tmp_path / "meg"))
    assert (rc["num_experts"], rc["moe_router_topk"], rc["moe_ffn_hidden_size"], rc["moe_layer_freq"],
            rc["moe_router_pre_softmax"]) == (4, 2, 48, [1, 0, 1, 1], not norm_topk_prob)
    assert type(model.decoder.layers[0].mlp).__name__ == "MoELayer" and len(
        model.decoder.layers[0].mlp.experts.local_experts) == 4
    ids = [7, 3, 250, 299, 0, 12, 12, 44]
    meg = loaders.megatron_logits(model, torch.tensor([ids]))[0, :, :300]
    diff = (meg - hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, diff  # measured 1.8e-7 .. 2.1e-7 (logits ~0.65)
    hf_checkpoint.export_checkpoint(str(tmp_path / "meg"), str(tmp_path / "back"), log=lambda *a: None)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()  # no remote code
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(hf_logits(hf, ids), hf_logits(back, ids))


def test_routed_remote_code_model_holds_qwen3_moe_mlp(tmp_path):
    """The routed modes' HF model (remote code) has Qwen3-MoE's MLP where Qwen3-MoE has one, under its parameter
    names; with the scalar gate at zero it computes Qwen3-MoE's function, also once written and reloaded as
    remote code."""
    from megatron_delta.hf import DeltaQwen3ForCausalLM, write_remote_code_model

    hf = _tiny_moe()
    delta = DeltaQwen3ForCausalLM.from_backbone(hf, residual="delta_block", delta_num_blocks=2,
                                                delta_gate="scalar").eval()
    names = {k for k in delta.state_dict() if "_router." not in k}
    assert names == set(hf.state_dict())
    ids = [7, 3, 250, 299, 0, 12, 12, 44]
    # within 1e-6, not bitwise: transformers runs its own Qwen3-MoE's experts on its grouped_mm kernel and a
    # remote-code model's (built or loaded) on other kernels, whose sums associate differently (up to 2e-7 apart on
    # some CPUs; logits ~0.3)
    want = hf_logits(hf, ids)
    assert (hf_logits(delta, ids) - want).abs().max().item() <= 1e-6
    write_remote_code_model(delta, delta.config, str(tmp_path / "out"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True).eval()
    assert again.config.num_experts == 4 and again.config.mlp_only_layers == [1]
    assert (hf_logits(again, ids) - want).abs().max().item() <= 1e-6


@pytest.mark.parametrize("mode", ["delta_block", "delta", "attnres"])
def test_routed_moe_export_matches_megatron(tmp_path, mode):
    """A routed mode's MoE model (Qwen3-MoE's layout: Megatron's MoE layers inside DeltaTransformerLayers, layer 1
    dense) with random depth routers: the remote-code export gives Megatron's logits, as the dense models do."""
    from megatron_delta.checkpoint.model_config import padded_vocab_size
    from megatron_delta.checkpoint.store import save_checkpoint

    blocks = {"delta_num_blocks": 2} if mode in ("delta_block", "attnres") else {}
    rc = hf_checkpoint.model_config_from_hf(_tiny_moe().config, mode, **blocks)
    model, args = loaders.build_megatron_model(rc, padded_vocab_size(300))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # routers away from their zero start, so every source's weight matters
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    args.vocab_size, args.tokenizer_type = 300, "NullTokenizer"
    save_checkpoint(str(tmp_path / "meg"), 0, [model], None, None, 0, args, save_optim=False)
    loaded, _, rc = loaders.load_megatron(str(tmp_path / "meg"))
    assert rc["residual"] == mode and rc["num_experts"] == 4
    assert type(loaded.decoder.layers[0].mlp).__name__ == "MoELayer"
    hf_checkpoint.export_checkpoint(str(tmp_path / "meg"), str(tmp_path / "out"), log=lambda *a: None)
    out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True).eval()
    assert out.config.num_experts == 4 and out.config.mlp_only_layers == [1]
    ids = [7, 3, 250, 299, 0, 12, 12, 44]
    meg = loaders.megatron_logits(loaded, torch.tensor([ids]))[0, :, :300]
    assert (hf_logits(out, ids) - meg).abs().max().item() <= TOL


def test_export_drops_mtp_depths_with_one_line(tmp_path):
    """A checkpoint with MTP depths keeps them (the model built from its run_config has them); the export writes
    the main model only, says so in one line, and its logits are the Megatron main head's."""
    from megatron_delta.checkpoint.model_config import padded_vocab_size
    from megatron_delta.checkpoint.store import save_checkpoint

    rc = hf_checkpoint.model_config_from_hf(_tiny("qwen3").config, "attnres", delta_num_blocks=2)
    rc["mtp_num_layers"] = 1
    model, args = loaders.build_megatron_model(rc, padded_vocab_size(300))
    args.vocab_size, args.tokenizer_type = 300, "NullTokenizer"
    save_checkpoint(str(tmp_path / "meg"), 0, [model], None, None, 0, args, save_optim=False)
    loaded, _, rc = loaders.load_megatron(str(tmp_path / "meg"))
    assert rc["mtp_num_layers"] == 1 and any(k.startswith("mtp.layers.0.final_router") for k in loaded.state_dict())
    lines = []
    hf_checkpoint.export_checkpoint(str(tmp_path / "meg"), str(tmp_path / "out"), log=lines.append)
    assert lines[0] == (f"[export] the 1 multi-token prediction depth(s) (mtp.layers.*) are not exported: Hugging "
                        f"Face's Qwen3 has no MTP head; they stay in the Megatron checkpoint "
                        f"{tmp_path / 'meg' / 'iter_0000000'}")
    out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True).eval()
    ids = [7, 3, 250, 299, 0, 12, 12, 44]
    meg = loaders.megatron_logits(loaded, torch.tensor([ids]))[0, :, :300]
    assert (hf_logits(out, ids) - meg).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------- (d)
def test_unknown_architecture_is_refused(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(errors.ConversionError, match="unsupported architecture"):
        hf_checkpoint.import_checkpoint(str(tmp_path / "gpt2"), str(tmp_path / "meg"), "delta")
    with pytest.raises(errors.ConversionError, match="no config.json"):
        hf_checkpoint.import_checkpoint(str(tmp_path), str(tmp_path / "meg"), "delta")
    assert not os.path.exists(tmp_path / "meg")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(errors.ConversionError, match=r"^--save .*/run already holds files \(a trained run\?\): the "
                       r"import would replace them. Pass a new --save directory, or --overwrite to replace it$"):
        hf_checkpoint.import_checkpoint(str(tmp_path / "gpt2"), str(tmp_path / "run"), "delta")
    assert os.listdir(tmp_path / "run") == ["latest_checkpointed_iteration.txt"]  # nothing touched
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "import", "--hf", str(tmp_path / "gpt2"),
                           "--save", str(tmp_path / "meg"), "--residual", "delta"], cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unsupported architecture" in proc.stderr, proc.stderr[-2000:]


def test_import_of_a_block_mode_without_blocks_that_divide_is_refused(tmp_path):
    """A block mode on an HF model of 6 layers without --delta-num-blocks: the default, 4 blocks, does not
    divide 6 and no other K is chosen silently. Refused naming the flag and every K, before any weight is read
    (the directory holds only config.json) and without writing --save; the tool says it in one line."""
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(tmp_path / "src")
    assert os.listdir(tmp_path / "src") == ["config.json"]
    message = ("--residual attnres with --num-layers 6 needs --delta-num-blocks K with K dividing 6 (1, 2, 3, 6); "
               "the default, 4 blocks, does not divide 6")
    with pytest.raises(errors.ConversionError) as err:
        hf_checkpoint.import_checkpoint(str(tmp_path / "src"), str(tmp_path / "meg"), "attnres")
    assert str(err.value) == f"--hf {tmp_path / 'src'}: {message}"
    assert not os.path.exists(tmp_path / "meg")
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "import", "--hf", str(tmp_path / "src"),
                           "--save", str(tmp_path / "meg"), "--residual", "attnres"], cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"convert_checkpoint.py import: error: --hf {tmp_path / 'src'}: " \
                                                   f"{message}"


def test_mode_and_vocab_mismatch_are_refused(tmp_path):
    hf = _tiny("qwen3")
    hf_checkpoint.import_checkpoint(hf, str(tmp_path / "meg"), "delta", delta_gate="scalar", log=lambda *a: None)
    rc = json.load(open(tmp_path / "meg" / "iter_0000000" / "run_config.json"))
    # loading into a model of another residual mode / another padded vocabulary: named flag in the error
    other = dict(rc, residual="delta_block", delta_num_blocks=2)
    model, args = loaders.build_megatron_model(other, rc["padded_vocab_size"])
    with pytest.raises(CheckpointError, match="--residual: checkpoint 'delta', flags 'delta_block'"):
        load_checkpoint(str(tmp_path / "meg"), [model], None, None, args, load_optim=False, load_rng=False)
    model, args = loaders.build_megatron_model(rc, rc["padded_vocab_size"] + 128)
    with pytest.raises(CheckpointError, match="--padded-vocab-size"):
        load_checkpoint(str(tmp_path / "meg"), [model], None, None, args, load_optim=False, load_rng=False)
    # a gate in a replacement mode, and a vocabulary larger than the padding, are refused too
    with pytest.raises(Exception, match="scalar"):
        hf_checkpoint.import_checkpoint(hf, str(tmp_path / "bad"), "attnres", delta_num_blocks=2, delta_gate="scalar")
    sd = {"model.embed_tokens.weight": torch.zeros(300, 64), "model.norm.weight": torch.ones(64)}
    with pytest.raises(errors.ConversionError, match="exceeds the padded size"):
        state_dict_adapter.hf_to_megatron_state_dict(sd, num_layers=0, num_attention_heads=4, num_query_groups=2,
                                             kv_channels=16, hidden_size=64, qk_layernorm=True, tied=True,
                                             padded_vocab_size=256)


def test_bad_run_config_is_refused_naming_the_key():
    """A run_config.json whose model keys are missing, of the wrong type or inconsistent: one ConversionError naming
    where it was read and the key (with its pretrain_gpt.py flag), before any model is built."""
    from megatron_delta.checkpoint.model_config import ModelConfigError, resolve_model_fields

    rc = dict(num_layers=4, hidden_size=64, ffn_hidden_size=192, num_attention_heads=4, num_query_groups=2,
              kv_channels=16, norm_epsilon=1e-6, qk_layernorm=True, rotary_base=1000000, max_position_embeddings=32,
              residual="delta_block", delta_num_blocks=2, padded_vocab_size=256, iteration=3, tokenizer_type="x")
    fields = run_config.model_fields(rc)  # keys that are not the model's (iteration, tokenizer) are not read
    assert (fields["delta_num_blocks"], fields["delta_router_eps"], fields["seq_length"]) == (2, 1e-6, 32)
    for bad, message in [
        ({"num_layers": None}, "model field num_layers (--num-layers) is missing"),
        ({"num_layers": "4"}, "model field num_layers (--num-layers) must be an integer, got '4'"),
        ({"qk_layernorm": 1}, "model field qk_layernorm (--qk-layernorm) must be true or false, got 1"),
        ({"normalization": "rms"}, "model field normalization (--normalization) must be one of RMSNorm, LayerNorm, "
                                   "got 'rms'"),
        ({"num_query_groups": 3}, "model field num_attention_heads (--num-attention-heads) 4 is not divisible by "
                                  "num_query_groups 3"),
    ]:
        with pytest.raises(errors.ConversionError) as e:
            run_config.model_fields(dict(rc, **bad), "--load CKPT")
        assert str(e.value) == f"--load CKPT: {message}"
    with pytest.raises(errors.ConversionError, match=r"^--load CKPT: --delta-num-blocks 3 must be a positive "
                                                         r"divisor of --num-layers 4"):
        run_config.model_fields(dict(rc, delta_num_blocks=3), "--load CKPT")
    with pytest.raises(errors.ConversionError) as e:  # a longer sequence than the model's positions
        run_config.model_fields(rc, "--load CKPT", seq_length=64)
    assert str(e.value) == ("--load CKPT: model field seq_length (--seq-length) 64 exceeds max_position_embeddings 32")
    with pytest.raises(ModelConfigError, match=r"^unknown model field\(s\) num_layer; known: num_layers, "):
        resolve_model_fields({"num_layer": 4})


# Where the config conversion builds from a checkpoint's run_config.json may differ from the one the trainer built
# (trainer/provider.py: Megatron-LM's core_transformer_config_from_args), and why: none changes the function.
NOT_THE_FUNCTION = {
    "bias_activation_fusion": "a fused kernel for the same SwiGLU (Megatron-LM's --bias-swiglu-fusion default)",
    "deallocate_pipeline_outputs": "frees pipeline outputs after sending them: memory only",
    "tensor_parallel_num_weight_shards": "None means tensor_model_parallel_size (ModelParallelConfig)",
    "expert_tensor_parallel_num_weight_shards": "None means expert_tensor_parallel_size; no experts",
    "cp_comm_type": "context parallelism is not used (size 1)",
    "inference_sampling_seed": "Megatron-Core's sampling in generation, not the model",
    "delta_pp_source_cache": "which payload tensors travel between interleaved chunks (the trainer resolves it "
                             "to False without them): traffic only, the same function",
}


def _same(a, b):
    """Config values equal; the init methods (functools.partial objects built anew) by what they call."""
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return (a.func, a.args, a.keywords) == (b.func, b.args, b.keywords)
    return a == b


@pytest.mark.parametrize("name", list(MODES) + ["delta_without_gqa", "baseline_mla", "delta_block_mla"])
def test_run_config_rebuilds_the_trainers_config(name, monkeypatch):
    """The model conversion and the tools build from a checkpoint's run_config.json
    (megatron_delta.checkpoint.model_config) has the config the trainer built from its flags, field by field
    (NOT_THE_FUNCTION aside), and the trainer's GPTModel options; under the layout of the trained checkpoints
    (TP2 x PP2), as load_megatron_parallel builds."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    from megatron_delta.checkpoint.model_config import model_config, padded_vocab_size
    from megatron_delta.checkpoint.run_config import recorded_config, run_config_fields
    from megatron_delta.platform.cpu import activate_cpu_platform
    from megatron_delta.trainer.main import parse_args
    from megatron_delta.trainer.provider import transformer_config

    activate_cpu_platform()  # Megatron-LM's validate_args asks the GPU its architecture under TP > 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    common = [a for a in COMMON if a != "--qk-layernorm"] if name == "baseline_llama" else COMMON
    if name == "delta_without_gqa":  # Megatron-LM then builds one query group per head, whatever args hold
        common, name = [a for a in COMMON if a != "--group-query-attention"], "delta"
    if name.endswith("_mla"):  # multi-latent attention (DeltaMLATransformerConfig), YaRN rotary scaling
        from tests.helpers.rank_runner import MLA

        common = [a for a in COMMON if a != "--group-query-attention"] + MLA + ["--mscale", "0.9"]  # not a default
        name = name[:-len("_mla")]
    args = parse_args(common + MODES[name] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"])
    trained = transformer_config(args)
    # the vocabulary padding, as Megatron-LM's trainer computes it when it builds the tokenizer
    args.padded_vocab_size = calculate_padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                         args.tensor_model_parallel_size, logging_enabled=False)
    assert padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 2) == args.padded_vocab_size
    rc = json.loads(json.dumps(recorded_config(args)))  # as run_config.json holds it
    config, options = model_config(run_config_fields(rc, tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    differ = sorted(f.name for f in dataclasses.fields(trained)
                    if not _same(getattr(trained, f.name), getattr(config, f.name)))
    assert set(differ) <= set(NOT_THE_FUNCTION), [(f, getattr(trained, f), getattr(config, f)) for f in differ]
    assert options == dict(transformer_impl=args.transformer_impl, max_sequence_length=args.max_position_embeddings,
                           share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                           position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
    # and what the trainer passes beyond them is GPTModel's default
    assert (args.rotary_percent, args.use_rope_scaling, args.fp16_lm_cross_entropy) == (1.0, False, False)


# ---------------------------------------------------------------------------------------------- (e) fine-tuning
@pytest.mark.slow
def test_tiny_qwen3_import_finetune_export_keeps_tokenizer(tmp_path):
    """Qwen3 (built from a config) + its tokenizer -> import delta_block (scalar gate, null source) ->
    pretrain_gpt --finetune --delta-router-lr-mult 100 -> export: the fine-tuned checkpoint still carries the HF
    tokenizer, AutoTokenizer loads from the export and encodes like the original, the routers moved."""
    from megatron_delta.hf import export_sentencepiece_tokenizer

    spm = _spm_model(tmp_path)
    import sentencepiece

    vocab = sentencepiece.SentencePieceProcessor(model_file=spm).get_piece_size()
    hf = _tiny("qwen3", vocab_size=vocab)
    hf.save_pretrained(tmp_path / "src")
    export_sentencepiece_tokenizer(spm, str(tmp_path / "src"))
    src_tok = AutoTokenizer.from_pretrained(str(tmp_path / "src"))
    hf_checkpoint.import_checkpoint(str(tmp_path / "src"), str(tmp_path / "imported"), "delta_block",
                                    delta_num_blocks=2, delta_gate="scalar", delta_null_source=True,
                                    log=lambda *a: None)
    rc0 = json.load(open(tmp_path / "imported" / "iter_0000000" / "run_config.json"))
    assert rc0["hf_tokenizer_dir"] == "hf_tokenizer"  # copied into the checkpoint, not a path to the source
    out = finetune(str(tmp_path / "imported"), str(tmp_path / "ft"))
    assert "successfully loaded checkpoint from" in out
    rc = json.load(open(tmp_path / "ft" / "iter_0000002" / "run_config.json"))
    assert rc["hf_vocab_size"] == vocab and rc["hf_tokenizer_dir"] == "hf_tokenizer"
    assert rc["imported_from"] == str(tmp_path / "src")
    # the source directory may go away: the checkpoint carries its own copy
    import shutil

    shutil.rmtree(tmp_path / "src")
    shutil.rmtree(tmp_path / "imported")
    hf_checkpoint.export_checkpoint(str(tmp_path / "ft"), str(tmp_path / "hf_ft"), log=lambda *a: None)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf_ft"))
    for text in ("The state of the union.", "people  government\nyear nation"):
        assert tok(text)["input_ids"] == src_tok(text)["input_ids"], text
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_ft"), trust_remote_code=True).eval()
    assert type(model).__name__ == "DeltaQwen3ForCausalLM" and model.config.vocab_size == vocab
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("_router.query"))
    ids = tok("The union of the people.")["input_ids"]
    assert torch.isfinite(hf_logits(model, ids)).all()
    # a recorded tokenizer directory that went missing is a clear error, not a silent export without it
    shutil.rmtree(tmp_path / "ft" / "iter_0000002" / "hf_tokenizer")
    with pytest.raises(errors.ConversionError, match="HF tokenizer directory .* is missing"):
        hf_checkpoint.export_checkpoint(str(tmp_path / "ft"), str(tmp_path / "hf_ft2"), log=lambda *a: None)
