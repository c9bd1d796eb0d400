"""Hugging Face side of conversion: megatron_delta.hf (config, model, remote code, tokenizer export).

Fast: tiny models (4 layers, hidden 64), CPU, offline.
"""
import math
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import safetensors  # noqa: E402,F401
import torch
import transformers  # noqa: E402,F401  (imported to fail early: required, pinned in requirements-lock.txt)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import megatron_delta  # noqa: E402
from megatron_delta.hf import (  # noqa: E402
    AUTO_MAP,
    REMOTE_CODE_FILES,
    DeltaQwen3Config,
    DeltaQwen3ForCausalLM,
    DeltaRouter,
    export_sentencepiece_tokenizer,
    write_remote_code_model,
)
from tests.helpers import reference_delta as ref  # noqa: E402

L, D, NH, NG, HN, FFN, V = 4, 64, 4, 2, 16, 96, 64


@pytest.fixture(autouse=True)
def _offline_single_thread(monkeypatch):
    # tiny models: intra-op threads only add contention on a shared 2-core machine (100x slower there)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def backbone_kwargs(**over):
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=NH,
              num_key_value_heads=NG, head_dim=HN, max_position_embeddings=64, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
    kw.update(over)
    return kw


def stock_qwen3(**over):
    return Qwen3ForCausalLM(Qwen3Config(**backbone_kwargs(**over))).eval()


def stock_llama(**over):
    kw = backbone_kwargs(**over)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


def randomize_routers(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, DeltaRouter):
            for p in m.parameters():
                p.data.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(D) if p.numel() == D else 1.0))
                if p is m.key_norm_weight:
                    p.data.add_(1.0)


# ---------------------------------------------------------------------------------------------- config
def test_config_validation():
    """The residual rules are the command line's (modes.check_delta_options), naming the config fields."""
    bad = [
        (dict(residual="hyper"), "residual='hyper' is not one of baseline, attnres, full_attnres, delta, delta_block"),
        (dict(residual="baseline", delta_null_source=True),
         "delta_null_source needs a routed residual mode; residual=baseline has no routers"),
        (dict(residual="baseline", delta_gate="scalar"), "delta_gate=scalar needs a routed residual mode"),
        (dict(residual="attnres", delta_num_blocks=3, num_hidden_layers=4),
         "delta_num_blocks=3 must be a positive divisor of num_hidden_layers=4"),
        (dict(residual="attnres", delta_num_blocks=True, num_hidden_layers=4),
         "delta_num_blocks=True must be a positive divisor of num_hidden_layers=4"),
        (dict(residual="delta", delta_num_blocks=2, num_hidden_layers=4),
         "delta_num_blocks applies to residual delta_block and attnres, not delta"),
        (dict(residual="full_attnres", delta_gate="scalar"),
         "delta_gate=scalar only applies to the additive modes (delta, delta_block): residual=full_attnres "
         "replaces the residual stream"),
        (dict(residual="attnres", delta_num_blocks=2, num_hidden_layers=4, delta_sources="authors-code"),
         "delta_sources=authors-code is defined for residual delta and delta_block only"),
        (dict(residual="delta", delta_gate="vector"), "delta_gate='vector' is not one of none, scalar"),
        (dict(residual="delta", delta_null_source=1), "delta_null_source must be a bool, got 1"),
        (dict(residual="delta", delta_router_eps=0.0), "delta_router_eps must be a positive float, got 0.0"),
        (dict(residual="attnres", num_hidden_layers=30),
         "residual=attnres with num_hidden_layers=30 needs delta_num_blocks K with K dividing 30 (1, 2, 3, 5, 6, 10, "
         "15, 30); the default, 4 blocks, does not divide 30"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError) as err:
            DeltaQwen3Config(**kwargs)
        assert message in str(err.value), (kwargs, str(err.value))
    # a block mode without delta_num_blocks gets the command line's default K (4, or L for at most 4 layers)
    assert DeltaQwen3Config(residual="delta_block", num_hidden_layers=8).delta_num_blocks == 4
    assert DeltaQwen3Config(residual="attnres", num_hidden_layers=3).delta_num_blocks == 3
    cfg = DeltaQwen3Config(residual="delta_block", delta_num_blocks=2, delta_sources="authors-code",
                           delta_null_source=True, delta_gate="scalar", delta_router_eps=1e-5, use_qk_norm=False,
                           **backbone_kwargs())
    again = DeltaQwen3Config.from_dict(cfg.to_dict())
    for k in ("residual", "delta_num_blocks", "delta_sources", "delta_null_source", "delta_gate",
              "delta_router_eps", "use_qk_norm", "hidden_size"):
        assert getattr(again, k) == getattr(cfg, k), k
    assert again.model_type == "delta_qwen3"


def test_from_backbone_config_llama():
    cfg = DeltaQwen3Config.from_backbone_config(stock_llama().config, residual="delta")
    assert cfg.use_qk_norm is False and cfg.head_dim == HN and cfg.num_key_value_heads == NG
    cfg = DeltaQwen3Config.from_backbone_config(stock_qwen3().config, residual="delta")
    assert cfg.use_qk_norm is True


# ---------------------------------------------------------------------------------------------- params
@pytest.mark.parametrize("mode,extra", [
    ("baseline", {}), ("delta", {}), ("delta", dict(delta_null_source=True, delta_gate="scalar")),
    ("delta_block", dict(delta_num_blocks=2, delta_gate="scalar")),
    ("attnres", dict(delta_num_blocks=2, delta_null_source=True)), ("full_attnres", {}),
])
def test_router_parameters(mode, extra):
    cfg = DeltaQwen3Config(residual=mode, **extra, **backbone_kwargs())
    model = DeltaQwen3ForCausalLM(cfg)
    names = {n: p for n, p in model.named_parameters() if "_router." in n}
    if mode == "baseline":
        assert names == {}
        return
    null, gate = extra.get("delta_null_source", False), extra.get("delta_gate") == "scalar"
    expected = set()
    receivers = [f"model.layers.{i}.{k}" for i in range(L) for k in ("attn_router", "mlp_router")]
    for r in receivers:
        expected |= {f"{r}.query", f"{r}.key_norm_weight"}
        expected |= {f"{r}.null_source"} if null else set()
        expected |= {f"{r}.gate"} if gate else set()
    if mode in ("attnres", "full_attnres"):
        expected |= {"model.final_router.query", "model.final_router.key_norm_weight"}
        expected |= {"model.final_router.null_source"} if null else set()
    assert set(names) == expected
    for n, p in names.items():
        assert p.dtype == torch.float32, n
        field = n.rsplit(".", 1)[1]
        assert tuple(p.shape) == ((1,) if field == "gate" else (D,)), n
        assert torch.equal(p, torch.ones_like(p) if field == "key_norm_weight" else torch.zeros_like(p)), n


def test_router_math_and_zero_query_is_mean():
    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randn(2, 5, D, generator=gen) * (i + 1) for i in range(3)]
    r = DeltaRouter(D, eps=1e-6, null_source=True, gate=True)
    # zero query: uniform weights -> the mean of the sources (and of the zero null source)
    out = r(srcs)
    assert torch.allclose(out, sum(srcs) / 4, atol=1e-6)
    randomize_routers(r, seed=4)
    rr, alpha = ref.route([s.double() for s in srcs], r.query.double(), r.key_norm_weight.double(),
                          r.null_source.double(), eps=1e-6)
    assert torch.allclose(r(srcs).double(), rr, atol=1e-5)
    assert torch.allclose(r.weights(srcs).permute(1, 2, 0).double(), alpha, atol=1e-6)
    # bf16 activations: fp32 math, result cast back by the additive/replace helpers
    x = torch.randn(2, 5, D).bfloat16()
    assert r.additive(x, [s.bfloat16() for s in srcs]).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- function preservation
@pytest.mark.parametrize("backbone", ["qwen3", "llama"])
@pytest.mark.parametrize("mode,extra", [
    ("baseline", {}),
    ("delta", dict(delta_gate="scalar")),
    ("delta", dict(delta_gate="scalar", delta_null_source=True, delta_sources="authors-code")),
    ("delta_block", dict(delta_num_blocks=2, delta_gate="scalar")),
    ("delta_block", dict(delta_num_blocks=4, delta_gate="scalar", delta_null_source=True,
                         delta_sources="authors-code")),
])
def test_gated_additive_equals_stock(backbone, mode, extra):
    stock = stock_qwen3(tie_word_embeddings=True) if backbone == "qwen3" else stock_llama()
    model = DeltaQwen3ForCausalLM.from_backbone(stock, residual=mode, **extra).eval()
    assert model.config.use_qk_norm == (backbone == "qwen3")
    ids = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        got, want = model(ids).logits, stock(ids).logits
    # u = x + 0 * r = x exactly, and the residual adds are the stock ones: bitwise equal on CPU fp32
    assert torch.equal(got, want), (got - want).abs().max().item()


@pytest.mark.parametrize("mode,extra", [("delta", {}), ("delta_block", dict(delta_num_blocks=2))])
def test_ungated_exact_sources_preserve_function_up_to_eps(mode, extra):
    # uniform weights: u = (1 + 1/N) x, and pre-norms are scale invariant up to their eps
    stock = stock_qwen3(rms_norm_eps=1e-12)
    with torch.no_grad():
        stock.model.embed_tokens.weight.normal_()  # O(1) activations: eps negligible
    ids = torch.randint(0, V, (2, 11))
    model = DeltaQwen3ForCausalLM.from_backbone(stock, residual=mode, **extra).eval()
    with torch.no_grad():
        ref_logits = stock(ids).logits
        diff_exact = (model(ids).logits - ref_logits).abs().max().item()
        scale = ref_logits.abs().max().item()
    assert diff_exact <= 1e-5 * max(1.0, scale), (diff_exact, scale)  # measured ~1e-7
    # authors-code: in `delta` only sublayer 0 differs (it reads nothing, u = x), so the sources still
    # sum to x; in `delta_block` they are alternating sums and the function changes
    model = DeltaQwen3ForCausalLM.from_backbone(stock, residual=mode, delta_sources="authors-code", **extra).eval()
    with torch.no_grad():
        diff = (model(ids).logits - ref_logits).abs().max().item()
    if mode == "delta":
        assert diff <= 1e-5 * max(1.0, scale), (diff, scale)
    else:
        assert diff > 100 * max(diff_exact, 1e-7), (diff, diff_exact)


# ---------------------------------------------------------------------------------------------- vs float64 reference
def ref_to_hf(w, cfg: ref.RefConfig):
    """Reference (Megatron-named) weights -> DeltaQwen3ForCausalLM state dict (fp32)."""
    out = {"model.embed_tokens.weight": w["embedding.word_embeddings.weight"],
           "model.norm.weight": w["decoder.final_layernorm.weight"]}
    if not cfg.share_embeddings_and_output_weights:
        out["lm_head.weight"] = w["output_layer.weight"]
    per = cfg.num_attention_heads // cfg.num_query_groups
    hn, d = cfg.kv_channels, cfg.hidden_size
    for i in range(cfg.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = w[p + "self_attention.linear_qkv.weight"].view(cfg.num_query_groups, per + 2, hn, d)
        out[q + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(-1, d)
        out[q + "self_attn.k_proj.weight"] = qkv[:, per].reshape(-1, d)
        out[q + "self_attn.v_proj.weight"] = qkv[:, per + 1].reshape(-1, d)
        out[q + "self_attn.o_proj.weight"] = w[p + "self_attention.linear_proj.weight"]
        if cfg.qk_layernorm:
            out[q + "self_attn.q_norm.weight"] = w[p + "self_attention.q_layernorm.weight"]
            out[q + "self_attn.k_norm.weight"] = w[p + "self_attention.k_layernorm.weight"]
        out[q + "input_layernorm.weight"] = w[p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = w[p + "pre_mlp_layernorm.weight"]
        gate, up = w[p + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = gate, up
        out[q + "mlp.down_proj.weight"] = w[p + "mlp.linear_fc2.weight"]
    for name, t in w.items():
        if "_router." in name:
            name = name.replace("decoder.", "model.").replace("self_attention_router", "attn_router")
            out[name] = t
    return {k: v.float().contiguous() for k, v in out.items()}


REF_CASES = [
    ("baseline", None, "exact", False, False, True),
    ("delta", None, "exact", True, True, True),
    ("delta", None, "exact", False, False, False),
    ("delta", None, "authors-code", True, True, True),
    ("delta", None, "authors-code", False, False, True),
    ("delta_block", 2, "exact", True, True, True),
    ("delta_block", 4, "exact", False, False, False),
    ("delta_block", 2, "authors-code", True, True, True),
    ("delta_block", 2, "authors-code", False, False, False),
    ("attnres", 2, "exact", True, False, True),
    ("attnres", 1, "exact", False, False, False),
    ("full_attnres", None, "exact", True, False, True),
    ("full_attnres", None, "exact", False, False, False),
]


def build_pair(mode, k, sources, null, gate, qk_norm, tied=False, router_init="random"):
    rcfg = ref.RefConfig(vocab_size=V, hidden_size=D, num_layers=L, num_attention_heads=NH, num_query_groups=NG,
                         kv_channels=HN, ffn_hidden_size=FFN, qk_layernorm=qk_norm,
                         share_embeddings_and_output_weights=tied)
    w = ref.init_reference_weights(rcfg, mode, null_source=null, gate=gate, seed=7, router_init=router_init)
    cfg = DeltaQwen3Config(residual=mode, delta_num_blocks=k, delta_sources=sources, delta_null_source=null,
                           delta_gate="scalar" if gate else "none", delta_router_eps=1e-5, use_qk_norm=qk_norm,
                           **backbone_kwargs(tie_word_embeddings=tied))
    model = DeltaQwen3ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(ref_to_hf(w, rcfg), strict=False)
    assert not unexpected and all(m == "lm_head.weight" and tied for m in missing), (missing, unexpected)
    return model, w, rcfg


@pytest.mark.parametrize("mode,k,sources,null,gate,qk_norm", REF_CASES)
def test_matches_float64_reference(mode, k, sources, null, gate, qk_norm):
    model, w, rcfg = build_pair(mode, k, sources, null, gate, qk_norm, tied=not qk_norm)
    ids = torch.randint(0, V, (2, 10))
    expected = ref.reference_forward(w, rcfg, ids, mode=mode, num_blocks=k, sources=sources,
                                     null_source=null, gate=gate, eps=1e-5)
    with torch.no_grad():
        got = model(ids).logits.double()
    err = (got - expected).abs().max().item() / expected.abs().max().item()
    assert err < 1e-5, err  # measured: 3e-7 .. 8e-7 relative (fp32 model vs fp64 reference)
    # routing diagnostics: same receivers, same source order (null source last), same weights
    _, alphas, _ = ref.reference_forward(w, rcfg, ids, mode=mode, num_blocks=k, sources=sources,
                                         null_source=null, gate=gate, eps=1e-5, return_routing=True)
    with torch.no_grad():
        model(ids, output_routing=True)
    got_alphas = model.model.last_routing
    assert len(got_alphas) == len(alphas)
    for a, b in zip(got_alphas, alphas):
        assert a.shape == b.shape and torch.allclose(a.double(), b, atol=1e-5)


def test_a_mode_registered_in_modes_alone_runs_as_its_rule_says(monkeypatch):
    """The model takes what each sublayer reads, forms and commits from modes.py: a made-up mode registered
    there alone (tests/helpers/custom_modes.py's delta_window: routers read h0 and the last two sublayer outputs) is
    accepted by the config, and each sublayer's input, captured, is x + r([h0, v_{j-2}, v_{j-1}]) over the
    captured outputs v, x = h0 + sum v, written out here."""
    from megatron_delta.core import modes
    from tests.helpers.custom_modes import DeltaWindowMode

    monkeypatch.setitem(modes.ROUTED_MODE_CLASSES, "delta_window", DeltaWindowMode)
    eps = 1e-5
    model = DeltaQwen3ForCausalLM(DeltaQwen3Config(residual="delta_window", delta_router_eps=eps,
                                                   **backbone_kwargs())).eval()
    randomize_routers(model)
    inputs, outputs, routers = [], [], []
    for layer in model.model.layers:
        for norm, sublayer, router in ((layer.input_layernorm, layer.self_attn, layer.attn_router),
                                       (layer.post_attention_layernorm, layer.mlp, layer.mlp_router)):
            norm.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
            sublayer.register_forward_hook(lambda m, args, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                               else out))
            routers.append(router)
    ids = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        h0 = model.model.embed_tokens(ids)
        assert len(inputs) == len(outputs) == 2 * L
        x = h0
        for j, router in enumerate(routers):
            s = torch.stack([h0] + outputs[max(0, j - 2):j])
            logits = (router.key_norm_weight * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)) @ router.query
            torch.testing.assert_close(inputs[j], x + (torch.softmax(logits, 0).unsqueeze(-1) * s).sum(0))
            x = x + outputs[j]
        torch.testing.assert_close(hidden, model.model.norm(x))


# ---------------------------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("mode,k,sources,null,gate", [
    ("baseline", None, "exact", False, False),
    ("delta", None, "exact", False, False),
    ("delta", None, "authors-code", True, True),
    ("delta_block", 2, "exact", True, False),
    ("delta_block", 2, "authors-code", False, True),
    ("attnres", 2, "exact", True, False),
    ("full_attnres", None, "exact", False, False),
])
def test_generate_with_cache_equals_without(mode, k, sources, null, gate):
    model, _, _ = build_pair(mode, k, sources, null, gate, qk_norm=True)
    ids = torch.randint(0, V, (2, 6))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kw)
    without = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(with_cache, without)
    seq = ids  # recompute the whole prefix by hand
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(with_cache, seq)
        # incremental logits with a cache == logits of the full prefix
        first = model(seq[:, :9], use_cache=True)
        nxt = model(seq[:, 9:], cache=first.cache, use_cache=True)
        full = model(seq, use_cache=False).logits
    assert (nxt.logits - full[:, 9:]).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------- remote code
@pytest.mark.parametrize("mode,k,sources,null,gate,qk_norm,tied", [
    ("delta_block", 2, "exact", True, True, True, True),
    ("full_attnres", None, "exact", True, False, False, False),
    ("delta", None, "authors-code", False, True, False, True),
])
def test_remote_code_roundtrip(tmp_path, mode, k, sources, null, gate, qk_norm, tied):
    model, _, _ = build_pair(mode, k, sources, null, gate, qk_norm, tied=tied)
    out = tmp_path / f"hf_{mode}"
    write_remote_code_model(model, model.config, str(out))
    assert sorted(os.listdir(out)) == ["config.json", "configuration_delta.py", "model.safetensors",
                                       "modeling_delta.py", "modes.py"]
    import json
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["auto_map"] == AUTO_MAP and cfg_json["residual"] == mode
    # the copies are this package's files (test_export_loads_without_this_package: they need nothing else)
    package = os.path.dirname(os.path.abspath(megatron_delta.__file__))
    for fname, source in REMOTE_CODE_FILES.items():
        assert (out / fname).read_bytes() == open(os.path.join(package, source), "rb").read(), fname
    loaded = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    assert type(loaded).__name__ == "DeltaQwen3ForCausalLM"
    assert type(loaded) is not DeltaQwen3ForCausalLM  # really the copied remote code
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert set(sd) == set(sd2)
    for name in sd:
        assert torch.equal(sd[name], sd2[name]), name
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        diff = (want - loaded(ids).logits).abs().max().item()
        # safetensors-mmapped weights can take another BLAS path than in-memory ones (measured up to
        # ~6e-6 on logits of size ~50); with the same weights copied into ordinary memory: bitwise equal
        assert diff <= 1e-6 * max(1.0, want.abs().max().item()), diff
        for p in loaded.parameters():
            p.data = p.data.clone()
        assert torch.equal(want, loaded(ids).logits)
    # state dict from a plain dict works too; bf16 loading keeps the routers in fp32
    write_remote_code_model(model.state_dict(), model.config, str(out))
    half = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.bfloat16).eval()
    for n, p in half.named_parameters():
        assert p.dtype == (torch.float32 if "_router." in n else torch.bfloat16), n
    with torch.no_grad():
        assert half(ids).logits.dtype == torch.bfloat16


LOAD_WITHOUT_PACKAGE = r"""
import sys
sys.modules["megatron_delta"] = None  # any import of this package fails (it is installed, editable, here)
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
ids = torch.load(sys.argv[1])
for path in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    for p in model.parameters():
        p.data = p.data.clone()  # ordinary memory, not safetensors' mmap (the BLAS path of the writer's model)
    with torch.no_grad():
        torch.save(model(ids).logits, path + "/logits.pt")
print(sorted(m for m in sys.modules if m.startswith("megatron_delta") and sys.modules[m] is not None))
"""


def test_export_loads_without_this_package(tmp_path):
    """An export is self-contained: in a process where megatron_delta cannot be imported, transformers' remote
    code loader accepts the files (its import check and relative imports: modes.py) and the model computes
    the logits of the model that was exported."""
    import subprocess
    import sys

    ids = torch.randint(0, V, (2, 9))
    torch.save(ids, tmp_path / "ids.pt")
    models = {}
    for mode, k, sources, null, gate in [("delta_block", 2, "authors-code", True, True),
                                         ("attnres", 2, "exact", False, False)]:
        model, _, _ = build_pair(mode, k, sources, null, gate, qk_norm=True)
        write_remote_code_model(model, model.config, str(tmp_path / mode))
        models[mode] = model
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PACKAGE, str(tmp_path / "ids.pt")]
                          + [str(tmp_path / m) for m in models], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout  # nothing of megatron_delta was imported
    for mode, model in models.items():
        with torch.no_grad():
            want = model(ids).logits
        assert torch.equal(torch.load(tmp_path / mode / "logits.pt"), want), mode


# ---------------------------------------------------------------------------------------------- tokenizer
TOKENIZER_STRINGS = [
    "Hello world", "The state of the union is strong.", " leading space", "   three leading", "trailing  ",
    "double  space inside", "new\nline", "a\n\nb\n", "tab\there", "mixed\r\nCRLF", "", " ", "\n",
    "unicode: café naïve über — “quotes” 日本語 😀", "fullwidth ＡＢＣ １２３", "ﬁ ligature Ⅻ",
    "\u00a0nbsp\u3000ideographic space", "x" * 40, "numbers 1,234.56 and 2026",
]


def _corpus(path):
    random.seed(0)
    words = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
             "have an they you were her she there one all we their been has would when who will more if no out "
             "so said what up its about into than them can only other new some could time these two may then do "
             "first any my now such like our over man me even most made after also did many before must through "
             "union state congress nation people government year world").split()
    lines = []
    for _ in range(2000):
        s = " ".join(random.choice(words) for _ in range(random.randint(3, 14)))
        s = s.capitalize() + random.choice([".", "!", "?", ",", ";"])
        if random.random() < 0.05:
            s += " café naïve über 1234 2026"
        lines.append(s)
    path.write_text("\n".join(lines), encoding="utf-8")
    return lines


@pytest.mark.parametrize("model_type,extra", [
    ("bpe", {}),
    ("bpe", dict(byte_fallback=True)),
    ("bpe", dict(normalization_rule_name="identity", remove_extra_whitespaces=False)),
    ("unigram", {}),
])
def test_sentencepiece_export_encodes_identically(tmp_path, model_type, extra):
    import sentencepiece as spm
    lines = _corpus(tmp_path / "corpus.txt")
    prefix = str(tmp_path / "spm")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=prefix, model_type=model_type,
                                   vocab_size=300 if model_type == "unigram" else 400, hard_vocab_limit=False,
                                   character_coverage=1.0, minloglevel=2, **extra)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    out = tmp_path / "hf_tok"
    export_sentencepiece_tokenizer(prefix + ".model", str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in TOKENIZER_STRINGS + lines[:50]:
        want = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == want, repr(text)
        assert tok(text)["input_ids"] == want, repr(text)  # no BOS/EOS added by default
    assert tok.decode(sp.encode("Hello world")) == sp.decode(sp.encode("Hello world"))
    assert tok.unk_token_id == sp.unk_id() and tok.bos_token_id == sp.bos_id() and tok.eos_token_id == sp.eos_id()
