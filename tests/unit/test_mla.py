"""Multi-latent attention (--multi-latent-attention, DeepSeek-V2/V3's attention) in every residual mode.

- the config class: Megatron's MLATransformerConfig with the delta_* fields, checked by the one definition of
  them (core/config.py DeltaFields), as the trainer builds it from Megatron-LM's flags;
- the layer spec: Megatron's MLA spec (MLASelfAttention) in baseline and in the routed layers, with the local
  core attention that takes MLA's head sizes (core/mla.py);
- the model of every mode vs the independent float64 reference (tests/helpers/reference_delta.py mla_attention): the
  routers read MLA sublayers' addends as any other's;
- the start-up refusals of MLA flags (one line naming the flag).

In-process, one rank, fp32, CPU. Tolerances as tests/unit/test_modes_reference.py (measured there and here: logits
<= ~1e-6 relative, router gradients <= ~1e-5).
"""

import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.flags import tiny
from tests.helpers.reference_compare import randomise, rel_error
from tests.helpers.reference_delta import RefConfig, reference_forward, weights_from_megatron_state_dict

torch.set_num_threads(1)

B, S, V = 2, 16, 128
HIDDEN, HEADS = 64, 4
SEED = 1234
LOGIT_TOL = 1e-5
GRAD_TOL = 1e-4
# DeepSeek-style shapes at a tiny size: query and key/value latents, per-head no-position and rotary parts
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)
MLA_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
             "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--rope-type", "rope"]


def mla_cli(extra=(), **tiny_kw) -> list[str]:
    """The tests' tiny Megatron-LM command line (tests/helpers/flags.py) with multi-latent attention instead of
    grouped-query attention (Megatron-LM refuses the two together)."""
    flags = tiny(**{"num_layers": 2, "hidden": 32, "heads": 2, "seq": 16, "mbs": 2, "train_iters": 1, **tiny_kw})
    flags.remove("--group-query-attention")
    i = flags.index("--num-query-groups")
    del flags[i:i + 2]
    return flags + ["--eval-iters", "0", "--eval-interval", "1000"] + MLA_FLAGS + list(extra)


@pytest.fixture(scope="module", autouse=True)
def dist():
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, None, 1, seed=SEED)
    yield


def build(mode, null=False, gate=False, num_blocks=None, q_lora_rank=MLA["q_lora_rank"], sources="exact",
          qk_layernorm=True, mtp_num_layers=None):
    """(model, fields): the tiny CPU model of megatron_delta.checkpoint.model_config with MLA sublayers (the fields a
    checkpoint's run_config.json records; DeltaMLATransformerConfig), freshly seeded so every mode gets the same
    backbone."""
    from megatron.core import tensor_parallel

    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields
    from megatron_delta.core.model import build_model_chunks

    f = dict(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=HEADS, seq_length=S,
             vocab_size=V, norm_epsilon=1e-6, residual=mode, delta_null_source=null, delta_sources=sources,
             delta_gate="scalar" if gate else "none", qk_layernorm=qk_layernorm, multi_latent_attention=True,
             rope_type="rope", mtp_num_layers=mtp_num_layers, **dict(MLA, q_lora_rank=q_lora_rank))
    if num_blocks:
        f["delta_num_blocks"] = num_blocks
    fields = resolve_model_fields(f)
    config, options = model_config(fields)
    assert type(config).__name__ == "DeltaMLATransformerConfig"
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model = build_model_chunks(config, V, **options)[0]
    return model.eval(), SimpleNamespace(**fields)


def ref_config(f, q_lora_rank=MLA["q_lora_rank"]):
    return RefConfig(vocab_size=V, hidden_size=f.hidden_size, num_layers=f.num_layers, qk_layernorm=f.qk_layernorm,
                     num_attention_heads=f.num_attention_heads, ffn_hidden_size=f.ffn_hidden_size,
                     norm_eps=f.norm_epsilon, rotary_base=float(f.rotary_base),
                     share_embeddings_and_output_weights=not f.untie_embeddings_and_output_weights,
                     **dict(MLA, q_lora_rank=q_lora_rank))


def tokens(seed=0):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def run(model, tok):
    return model(tok, torch.arange(S)[None].expand(B, S), None)


# ------------------------------------------------------------------------------------------------ config, spec
def test_the_config_class_is_megatrons_mla_config_with_the_delta_fields():
    """One definition of the delta_* fields and their checks: the MLA class refuses what the plain one refuses,
    with the same line, and keeps Megatron's MLA fields and checks."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from megatron_delta.core.config import DeltaFields, DeltaMLATransformerConfig, DeltaTransformerConfig

    assert issubclass(DeltaMLATransformerConfig, MLATransformerConfig)
    assert issubclass(DeltaMLATransformerConfig, DeltaFields) and issubclass(DeltaTransformerConfig, DeltaFields)
    delta = {f.name for f in dataclasses.fields(DeltaFields)}
    assert {f.name for f in dataclasses.fields(DeltaMLATransformerConfig)} == (
        {f.name for f in dataclasses.fields(MLATransformerConfig)} | delta)
    assert {f.name for f in dataclasses.fields(DeltaTransformerConfig)} == (
        {f.name for f in dataclasses.fields(TransformerConfig)} | delta)
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4)
    for bad in (dict(residual="attnres", delta_gate="scalar"), dict(residual="delta", fp4="e2m1"),
                dict(residual="delta", delta_router_kernels="x")):
        with pytest.raises(ValueError) as plain:
            DeltaTransformerConfig(**base, **bad)
        with pytest.raises(ValueError) as mla:
            DeltaMLATransformerConfig(**base, **bad)
        assert str(mla.value) == str(plain.value)
    config = DeltaMLATransformerConfig(**base, residual="delta_block", delta_num_blocks=2, q_lora_rank=32)
    assert config.routed and config.delta_num_blocks == 2 and config.q_lora_rank == 32
    with pytest.raises(NotImplementedError, match="Output gate is not supported for MLA"):
        DeltaMLATransformerConfig(**base, attention_output_gate=True)  # Megatron's own check still runs


@pytest.mark.parametrize("residual", ["baseline", "delta_block"])
def test_the_trainer_builds_the_mla_config_from_megatron_lms_flags(residual, monkeypatch):
    """pretrain_gpt.py's flags -> DeltaMLATransformerConfig through Megatron-LM's own mapping, every MLA flag
    carried; megatron.core.transformer's MLATransformerConfig is Megatron's again afterwards."""
    import megatron.core.transformer as transformer
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_delta.core.config import DeltaMLATransformerConfig
    from megatron_delta.trainer.main import parse_args
    from megatron_delta.trainer.provider import transformer_config

    args = parse_args(mla_cli(["--residual", residual, "--rotary-scaling-factor", "4", "--mscale", "0.5",
                               "--mscale-all-dim", "0.7"]))
    config = transformer_config(args)
    assert type(config) is DeltaMLATransformerConfig and transformer.MLATransformerConfig is MLATransformerConfig
    assert (config.residual, config.multi_latent_attention, config.rope_type) == (residual, True, "rope")
    assert {k: getattr(config, k) for k in MLA} == dict(MLA, kv_lora_rank=16, v_head_dim=12)
    assert (config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (4.0, 0.5, 0.7)
    plain = transformer_config(parse_args(tiny(num_layers=2, hidden=32, heads=2, seq=16, mbs=2, train_iters=1)
                                          + ["--eval-iters", "0", "--eval-interval", "1000"]))
    assert type(plain).__name__ == "DeltaTransformerConfig" and not plain.multi_latent_attention


def test_the_layer_specs_are_megatrons_mla_specs():
    """Baseline: Megatron's TransformerLayer with MLASelfAttention (LocalMLASelfAttention: its local-backend
    gradients under TP); routed: the same submodules in a DeltaTransformerLayer; local core attention with MLA's
    head sizes, SP-capable latent norms."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_delta.core.layer import DeltaTransformerLayer
    from megatron_delta.core.mla import LocalMLASelfAttention, MLADotProductAttention
    from megatron_delta.core.norms import LocalNorm

    for mode, cls in (("baseline", TransformerLayer), ("delta", DeltaTransformerLayer)):
        model, _ = build(mode)
        layer = model.decoder.layers[0]
        assert type(layer) is cls and type(layer.self_attention) is LocalMLASelfAttention
        attn = layer.self_attention
        assert type(attn.core_attention) is MLADotProductAttention
        assert type(attn.q_layernorm) is LocalNorm and type(attn.kv_layernorm) is LocalNorm
        assert attn.core_attention.hidden_size_per_partition == HEADS * MLA["v_head_dim"]


# ------------------------------------------------------------------------------------ every mode vs the reference
VARIANTS = [("baseline", False, False, None), ("delta", True, True, None), ("delta", False, False, None),
            ("delta_block", True, True, 2), ("attnres", True, False, 2), ("full_attnres", False, False, None)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v if x))
def test_logits_and_router_grads_match_reference(variant):
    """Megatron's model with MLA sublayers == the float64 reference with DeepSeek's attention, in every mode
    (random router parameters): the routed stream around an MLA sublayer is the reference's."""
    mode, null, gate, k = variant
    model, fields = build(mode, null, gate, k)
    randomise(model)
    tok = tokens()
    W = torch.randn(B, S, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    logits = run(model, tok)
    (logits.double() * W).sum().backward()
    w = weights_from_megatron_state_dict(model.state_dict())
    router_names = [n for n in w if "router" in n]
    for n in router_names:
        w[n].requires_grad_(True)
    ref = reference_forward(w, ref_config(fields), tok, mode=mode, num_blocks=k, null_source=null, gate=gate,
                            eps=fields.delta_router_eps)
    rel = rel_error(logits.detach().double(), ref.detach())
    assert rel < LOGIT_TOL, (variant, rel)
    if not router_names:
        return
    (ref * W).sum().backward()
    params = dict(model.named_parameters())
    worst = 0.0
    for n in router_names:
        if w[n].grad is None:  # a router that reads one source: its query and key norm get no gradient
            continue
        scale = w[n].grad.abs().max().item() or 1.0
        err = (params[n].grad.double() - w[n].grad).abs().max().item() / scale
        worst = max(worst, err)
        assert err < GRAD_TOL, (variant, n, err)
    print(f"\nMLA {variant}: logits rel err {rel:.2e}, router grads rel err {worst:.2e}")


def test_one_query_projection_without_q_lora_rank():
    """--q-lora-rank unset: one query projection (linear_q_proj), as DeepSeek-V2-Lite; without --qk-layernorm
    (Megatron's local spec refuses a query-latent norm without a query latent), no latent norm."""
    model, fields = build("delta_block", num_blocks=2, q_lora_rank=None, qk_layernorm=False)
    randomise(model)
    assert hasattr(model.decoder.layers[0].self_attention, "linear_q_proj")
    tok = tokens(1)
    with torch.no_grad():
        logits = run(model, tok)
    ref = reference_forward(weights_from_megatron_state_dict(model.state_dict()), ref_config(fields, None), tok,
                            mode="delta_block", num_blocks=2, eps=fields.delta_router_eps)
    assert rel_error(logits.double(), ref) < LOGIT_TOL


@pytest.mark.parametrize("mode,k", [("baseline", None), ("delta_block", 2), ("attnres", 2)])
def test_mtp_depths_with_mla_match_the_reference(mode, k):
    """Multi-token prediction with MLA sublayers (the depths' layers are MLA layers too): main and depth logits ==
    the float64 reference (attnres: the depths' own routers over the decoder's sources)."""
    model, fields = build(mode, null=mode != "baseline", num_blocks=k, mtp_num_layers=2)
    randomise(model)
    tok = tokens(4)
    captured = []
    handle = model.mtp.register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        with torch.no_grad():
            logits = run(model, tok)
    finally:
        handle.remove()
    weight = model.shared_embedding_or_output_weight()
    with torch.no_grad():
        depth_logits = [model.output_layer(h, weight=weight)[0].transpose(0, 1)
                        for h in torch.chunk(captured[0], 3, dim=0)[1:]]
    ref, ref_depths = reference_forward(weights_from_megatron_state_dict(model.state_dict()), ref_config(fields), tok,
                                        mode=mode, num_blocks=k, null_source=mode != "baseline",
                                        eps=fields.delta_router_eps, mtp_num_layers=2)
    assert rel_error(logits.double(), ref) < LOGIT_TOL
    for got, want in zip(depth_logits, ref_depths):
        assert rel_error(got.double(), want) < LOGIT_TOL


def test_scalar_gate_at_init_is_bitwise_baseline():
    base, _ = build("baseline")
    model, _ = build("delta_block", gate=True, num_blocks=2)
    tok = tokens(2)
    with torch.no_grad():
        assert torch.equal(run(model, tok), run(base, tok))


# ---------------------------------------------------------------------------------------------- start-up refusals
def _refused(argv, monkeypatch, capsys) -> str:
    from megatron_delta.trainer import main as trainer_main

    def started(args):
        raise AssertionError("the run started: the flags were not refused at start-up")

    monkeypatch.setattr(trainer_main, "run", started)
    rc = trainer_main.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def _without_mla(flags):
    flags = list(flags)
    i = flags.index("--multi-latent-attention")
    return flags[:i] + flags[i + 1:]


@pytest.mark.parametrize("flag,value", [("--q-lora-rank", "32"), ("--kv-lora-rank", "8"), ("--qk-head-dim", "8"),
                                        ("--qk-pos-emb-head-dim", "4"), ("--v-head-dim", "8"),
                                        ("--cache-mla-latents", None), ("--mscale", "2")])
def test_an_mla_flag_without_multi_latent_attention_is_refused(flag, value, monkeypatch, capsys):
    flags = [f for f in tiny(num_layers=2, hidden=32, heads=2, seq=16, mbs=2, train_iters=1)]
    argv = flags + ["--eval-iters", "0", "--eval-interval", "1000", flag] + ([value] if value else [])
    line = _refused(argv, monkeypatch, capsys)
    assert line == (f"pretrain_gpt.py: error: {flag} configures multi-latent attention: add "
                    f"--multi-latent-attention, or drop {flag}"), line


def test_megatron_lm_defaults_of_the_mla_flags_are_the_tables():
    """MLA_FLAGS holds Megatron-LM's parser defaults (a flag at its default is not 'given')."""
    from megatron.training.arguments import parse_args

    from megatron_delta.trainer.arguments import MLA_FLAGS, add_delta_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py"]
    try:
        args = parse_args(extra_args_provider=add_delta_args)
    finally:
        sys.argv = saved
    assert {attr: getattr(args, attr) for attr in MLA_FLAGS} == {a: d for a, (_, d) in MLA_FLAGS.items()}


@pytest.mark.parametrize("extra,message", [
    (["--rope-type", "yarn"], "--rope-type yarn applies to multi-latent attention only"),
])
def test_rope_type_yarn_without_mla_is_refused(extra, message, monkeypatch, capsys):
    argv = tiny(num_layers=2, hidden=32, heads=2, seq=16, mbs=2, train_iters=1) + [
        "--eval-iters", "0", "--eval-interval", "1000"] + extra
    assert message in _refused(argv, monkeypatch, capsys)


@pytest.mark.parametrize("extra,message", [
    (["--tensor-model-parallel-size", "3", "--num-attention-heads", "3"],
     "--tensor-model-parallel-size 3 must divide --q-lora-rank (32): the local backend's MLA down projections "
     "split it over the tensor-parallel ranks"),
    (["--tensor-model-parallel-size", "2", "--q-lora-rank", "31"],
     "--tensor-model-parallel-size 2 must divide --q-lora-rank (31)"),
    (["--tensor-model-parallel-size", "2", "--qk-pos-emb-head-dim", "6", "--kv-lora-rank", "15"],
     "--tensor-model-parallel-size 2 must divide --kv-lora-rank + --qk-pos-emb-head-dim (21)"),
    (["--kv-lora-rank", "0"], "--kv-lora-rank 0 must be a positive size"),
    (["--position-embedding-type", "yarn"], "--position-embedding-type yarn would add another: use "
                                            "--position-embedding-type rope (or none)"),
    (["--yarn-beta-fast", "16"], "--yarn-beta-fast is not read with --multi-latent-attention"),
    (["--group-query-attention", "--num-query-groups", "1"],
     "Group query attention is mutually exclusive with multi latent attention. (Megatron-LM validate_args"),
    (["--q-lora-rank", "0"], "--q-lora-rank 0 must be a positive size"),
    (["--attention-output-gate"], "Output gate is not supported for MLA yet. (Megatron-Core transformer_config.py"),
])
def test_bad_mla_input_is_one_line(extra, message, monkeypatch, capsys):
    """Sizes that do not divide, flags MLA does not read, and what Megatron refuses for MLA (its line, at
    start-up): one line naming the flag."""
    line = _refused(mla_cli(extra), monkeypatch, capsys)
    assert line.startswith("pretrain_gpt.py: error: ") and message in line, line


def test_a_query_latent_norm_without_a_query_latent_is_refused(monkeypatch, capsys):
    """--qk-layernorm without --q-lora-rank: Megatron-Core's local MLA spec refuses the unused query norm when the
    model is built (mla_qk_norm_config.py); here at start-up, naming both flags."""
    flags = mla_cli()
    i = flags.index("--q-lora-rank")
    line = _refused(flags[:i] + flags[i + 2:], monkeypatch, capsys)
    assert line == ("pretrain_gpt.py: error: --qk-layernorm with --multi-latent-attention and no --q-lora-rank: "
                    "Megatron-Core's local MLA spec refuses a query-latent norm without a query latent "
                    "(mla_qk_norm_config.py). Pass --q-lora-rank, or drop --qk-layernorm (the key/value latent "
                    "is then not normed either)"), line


def test_rope_fusion_without_transformer_engine_is_refused():
    """RoPE fusion (Megatron-LM's default) with the local backend on a GPU (on CPU the GPU-defaults check names
    --no-rope-fusion first): MLA's fused RoPE is Transformer Engine's, which Megatron-Core asserts only at the
    first forward."""
    from megatron_delta.trainer.arguments import check_mla_flags
    from megatron_delta.trainer.main import parse_args

    args = parse_args(mla_cli())
    check_mla_flags(args)
    args.apply_rope_fusion = True
    with pytest.raises(ValueError) as e:
        check_mla_flags(args)
    assert str(e.value) == ("--multi-latent-attention with RoPE fusion (Megatron-LM's default) needs Transformer "
                            "Engine's fused MLA RoPE kernels: pass --no-rope-fusion, or --transformer-impl "
                            "transformer_engine on a GPU")


def test_a_checkpoint_records_mla_and_its_export_is_refused_before_any_file(tmp_path, capsys):
    """run_config.json records the MLA flags (a --load with other MLA flags is refused by name; the tools rebuild
    the model); an export DeepSeek-V3 cannot express (here a softmax router) is refused in one line, writing
    nothing."""
    import json

    from megatron_delta.checkpoint.errors import ConversionError
    from megatron_delta.checkpoint.run_config import MODEL_FLAGS, run_config_fields
    from megatron_delta.convert.hf_checkpoint import export_checkpoint
    from megatron_delta.trainer.main import main

    save = str(tmp_path / "ckpt")
    moe = ["--num-experts", "2", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16"]
    assert main(mla_cli(["--residual", "delta_block", "--train-iters", "0", "--save", save] + moe)) == 0
    rc = json.load(open(os.path.join(save, "iter_0000000", "run_config.json")))
    assert {k: rc[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                               "qk_pos_emb_head_dim", "v_head_dim", "rope_type")} == dict(
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=12, rope_type="rope")
    assert "multi_latent_attention" in MODEL_FLAGS and run_config_fields(rc)["multi_latent_attention"] is True
    with pytest.raises(ConversionError) as e:
        export_checkpoint(save, str(tmp_path / "hf"))
    assert str(e.value) == (f"--load {save}/iter_0000000 (--multi-latent-attention) has no Hugging Face counterpart "
                            f"here: --moe-router-score-function softmax (or --moe-router-pre-softmax): DeepSeek-V3's "
                            f"router is a sigmoid; evaluate it with the Megatron tools (tools/evaluate.py, "
                            f"tools/perplexity.py)")
    assert not os.path.exists(tmp_path / "hf") and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    capsys.readouterr()
    line = _refused_run(mla_cli(["--residual", "delta_block", "--kv-lora-rank", "8", "--load", save,
                                 "--finetune"] + moe), capsys)
    assert "--kv-lora-rank: checkpoint 16, flags 8" in line, line


def _refused_run(argv, capsys) -> str:
    from megatron_delta.trainer.main import main

    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("mla", [True, False], ids=["deepseek-v3", "qwen3-moe"])
def test_an_export_with_the_shared_expert_gate_is_refused_before_any_file(mla, tmp_path):
    """--moe-shared-expert-gate: run_config.json records it (the tools rebuild the gate), and the export, whose
    Hugging Face layouts have ungated shared experts, refuses it in one line naming the flag, writing nothing."""
    from megatron_delta.checkpoint.errors import ConversionError
    from megatron_delta.convert.hf_checkpoint import export_checkpoint
    from megatron_delta.evaluation.loaders import load_megatron
    from megatron_delta.trainer.main import main
    from tests.helpers.rank_runner import DEEPSEEK_MOE

    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    moe = list(DEEPSEEK_MOE) if mla else ["--num-experts", "2", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
                                          "32", "--moe-shared-expert-intermediate-size", "32"]
    if mla:
        moe[moe.index("--moe-layer-freq") + 1] = "[0,1]"
    extra = moe + ["--moe-shared-expert-gate", "--train-iters", "0", "--save", save]
    argv = (mla_cli(extra) if mla else
            tiny(num_layers=2, hidden=32, heads=2, seq=16, mbs=2, train_iters=1) + ["--eval-iters", "0",
                                                                                    "--eval-interval", "1000"] + extra)
    assert main(argv) == 0
    model, _, rc = load_megatron(save)
    assert rc["moe_shared_expert_gate"] is True
    assert any(k.endswith("mlp.shared_experts.gate_weight") for k in model.state_dict())
    with pytest.raises(ConversionError) as e:
        export_checkpoint(save, out, log=lambda *a: None)
    assert str(e.value) == (
        f"--load {save}/iter_0000000 was trained with --moe-shared-expert-gate, which the Hugging Face layouts the "
        f"export writes (DeepSeek-V3, Qwen3-MoE) have no counterpart for: their shared experts are ungated; train "
        f"without --moe-shared-expert-gate to export, or evaluate this checkpoint with the Megatron tools "
        f"(tools/evaluate.py, tools/perplexity.py)")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no output, no temporary sibling


def test_the_embedded_run_leaves_out_grouped_query_attention_with_mla(monkeypatch):
    """`pretrain_gpt.py --multi-latent-attention` without data (docs/usage.md's recipe): the embedded defaults
    without their grouped-query attention, which Megatron-LM refuses with MLA; the other defaults stay."""
    from megatron_delta.data import corpus
    from megatron_delta.trainer.embedded import embedded_argv

    paths = dict(train_data_path=["t"], sotu_valid_data_path="v", tokenizer_model="m", heldout_data_path="h")
    monkeypatch.setattr(corpus, "ensure_default_data", lambda cache: paths)
    plain = embedded_argv(["--residual", "delta_block"])
    mla = embedded_argv(["--residual", "delta_block", "--multi-latent-attention"])
    assert "--group-query-attention" in plain and "--num-query-groups" in plain
    assert "--group-query-attention" not in mla and "--num-query-groups" not in mla
    flags = [a for a in plain if a.startswith("--")]
    assert [a for a in mla if a.startswith("--")] == ["--residual", "--multi-latent-attention"] + [
        a for a in flags[1:] if a not in ("--group-query-attention", "--num-query-groups")]


# --------------------------------------------------------------------------------------- Hugging Face export
@pytest.mark.parametrize("rope", [["--rope-type", "rope"],
                                  ["--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.9",
                                   "--mscale-all-dim", "0.7"]], ids=["rope", "yarn"])
def test_baseline_mla_exports_to_stock_deepseek_v3(rope, tmp_path):
    """A trained baseline MLA checkpoint -> transformers' DeepseekV3ForCausalLM (no remote code): logits equal
    Megatron's within the other exports' fp32 tolerance (tests/helpers/conversion.py EXPORT_TOL)."""
    from transformers import AutoModelForCausalLM

    from megatron_delta.convert.hf_checkpoint import export_checkpoint
    from megatron_delta.evaluation.loaders import load_megatron
    from megatron_delta.evaluation.token_nll import evaluate_tokens
    from megatron_delta.trainer.main import main
    from tests.helpers.conversion import EXPORT_TOL, SEQS

    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    # (the last --rope-type wins over mla_cli's)
    argv = mla_cli(rope + ["--train-iters", "3", "--lr", "1e-2", "--save", save, "--save-interval", "3"],
                   num_layers=2, hidden=32, heads=2, seq=16, mbs=2)
    assert main(argv) == 0
    export_checkpoint(save, out, log=lambda *a: None)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    model, _, rc = load_megatron(save)
    seqs = [[t % 256 for t in s] for s in SEQS]
    _, meg_logits = evaluate_tokens(model, 256, seqs)
    for ids, ml in zip(seqs, meg_logits):
        with torch.no_grad():
            hl = hf(torch.tensor([ids])).logits[0].float()
        diff = (hl - ml).abs().max().item()
        assert diff <= EXPORT_TOL, diff
        print(f"[MLA export {rope[1]}] max |HF - Megatron| logits {diff:.1e}")


def test_baseline_mla_with_deepseek_moe_exports_to_stock_deepseek_v3(tmp_path):
    """DeepSeek's MoE routing (tests/helpers/rank_runner.py DEEPSEEK_MOE: sigmoid scores with the trained expert bias,
    group-limited top-k, scaled top-k weights, a shared expert, the first layer dense) -> DeepseekV3ForCausalLM's
    MoE: logits equal Megatron's within EXPORT_TOL."""
    from transformers import AutoModelForCausalLM

    from megatron_delta.convert.hf_checkpoint import export_checkpoint
    from megatron_delta.evaluation.loaders import load_megatron
    from megatron_delta.evaluation.token_nll import evaluate_tokens
    from megatron_delta.trainer.main import main
    from tests.helpers.conversion import EXPORT_TOL, SEQS
    from tests.helpers.rank_runner import DEEPSEEK_MOE

    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    moe = list(DEEPSEEK_MOE)
    moe[moe.index("--moe-layer-freq") + 1] = "[0,1]"
    moe[moe.index("--moe-router-bias-update-rate") + 1] = "0.1"  # a bias far from zero after 3 steps
    assert main(mla_cli(moe + ["--rope-type", "yarn", "--train-iters", "3", "--lr", "1e-2", "--save", save,
                               "--save-interval", "3"], num_layers=2, hidden=32, heads=2, seq=16, mbs=2)) == 0
    export_checkpoint(save, out, log=lambda *a: None)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM" and hf.config.first_k_dense_replace == 1
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0.05  # the trained bias travelled
    model, _, rc = load_megatron(save)
    seqs = [[t % 256 for t in s] for s in SEQS]
    _, meg_logits = evaluate_tokens(model, 256, seqs)
    for ids, ml in zip(seqs, meg_logits):
        with torch.no_grad():
            hl = hf(torch.tensor([ids])).logits[0].float()
        diff = (hl - ml).abs().max().item()
        assert diff <= EXPORT_TOL, diff
        print(f"[MLA + DeepSeek MoE export] max |HF - Megatron| logits {diff:.1e}")


@pytest.mark.parametrize("change,why", [
    (dict(qk_layernorm=False), "no --qk-layernorm: DeepSeek-V3's attention always norms its query and key/value "
                               "latents"),
    (dict(moe_router_score_function="softmax"), "--moe-router-score-function softmax (or --moe-router-pre-softmax): "
                                                "DeepSeek-V3's router is a sigmoid"),
    (dict(moe_layer_freq=[1, 0, 1, 1]), "--moe-layer-freq [1, 0, 1, 1]: DeepSeek-V3 has dense layers first, then "
                                        "MoE layers only"),
    (dict(moe_router_group_topk=2), "--moe-router-num-groups 2 / --moe-router-group-topk 2: DeepSeek-V3 scores each "
                                    "group by its top 2 experts, Megatron by its top --moe-router-topk / "
                                    "--moe-router-group-topk (1)"),
    (dict(moe_shared_expert_intermediate_size=48), "--moe-shared-expert-intermediate-size 48 is not a multiple of "
                                                   "--moe-ffn-hidden-size 32 (DeepSeek-V3's n_shared_experts)"),
])
def test_what_deepseek_v3_cannot_express_is_refused_naming_the_flag(change, why):
    from megatron_delta.checkpoint.errors import ConversionError
    from megatron_delta.convert.hf_checkpoint import check_deepseek_export

    rc = dict(residual="baseline", multi_latent_attention=True, qk_layernorm=True, rope_type="yarn", num_layers=4,
              ffn_hidden_size=96, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1, 1],
              moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
              moe_shared_expert_intermediate_size=32)
    check_deepseek_export(rc, "CKPT")  # DeepSeek's own routing: expressible
    with pytest.raises(ConversionError) as e:
        check_deepseek_export(dict(rc, **change), "CKPT")
    assert str(e.value) == (f"--load CKPT (--multi-latent-attention) has no Hugging Face counterpart here: {why}; "
                            f"evaluate it with the Megatron tools (tools/evaluate.py, tools/perplexity.py)")


# --------------------------------------------------------------------------------------- Hugging Face import
def _tiny_deepseek_v3(tmp_path, moe: bool, yarn: bool):
    """A tiny DeepseekV3ForCausalLM that transformers builds offline (random weights; its norms, latent norms and
    expert bias perturbed so that each of them matters), saved to a directory."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    rope = dict(rope_type="default", rope_theta=10000.0)
    if yarn:
        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4096,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                           n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                           routed_scaling_factor=2.5, first_k_dense_replace=1 if moe else 3,
                           max_position_embeddings=64, rope_parameters=rope, tie_word_embeddings=False,
                           num_mtp_layers=0)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.normal_(0, 0.2, generator=g)
    out = str(tmp_path / "deepseek")
    hf.save_pretrained(out)
    return out, hf


@pytest.mark.parametrize("moe,yarn", [(False, False), (True, True)], ids=["dense-rope", "moe-yarn"])
@pytest.mark.parametrize("residual", ["baseline", "delta_block"])
def test_deepseek_v3_imports_and_scalar_gate_keeps_its_logits(tmp_path, residual, moe, yarn):
    """A DeepseekV3ForCausalLM directory -> a Megatron checkpoint (MLA; DeepSeek's MoE routing with its correction
    bias as the expert bias); with --delta-gate scalar the routed model's step-0 logits equal the original's."""
    from megatron_delta.convert.hf_checkpoint import import_checkpoint
    from megatron_delta.evaluation.loaders import load_megatron
    from megatron_delta.evaluation.token_nll import evaluate_tokens
    from tests.helpers.conversion import EXPORT_TOL, SEQS

    hf_dir, hf = _tiny_deepseek_v3(tmp_path, moe, yarn)
    save = str(tmp_path / "imported")
    kw = dict(delta_num_blocks=3, delta_gate="scalar") if residual != "baseline" else {}
    import_checkpoint(hf_dir, save, residual=residual, log=lambda *a: None, **kw)
    model, _, rc = load_megatron(save)
    assert rc["multi_latent_attention"] and bool(rc.get("num_experts")) == moe
    seqs = [[t % 256 for t in s] for s in SEQS]
    _, meg_logits = evaluate_tokens(model, 256, seqs)
    for ids, ml in zip(seqs, meg_logits):
        with torch.no_grad():
            hl = hf(torch.tensor([ids])).logits[0].float()
        diff = (hl - ml).abs().max().item()
        assert diff <= EXPORT_TOL * max(1.0, hl.abs().max().item()), diff  # fp32 round-off of logits ~4
        print(f"[DeepSeek-V3 import {residual} moe={moe} yarn={yarn}] max |HF - Megatron| logits {diff:.1e} "
              f"(max |logit| {hl.abs().max().item():.1f})")
    if residual == "delta_block" and moe:
        # fine-tuning it takes the flags run_config.model_flags gives (MLA and the MoE routing among them)
        from megatron_delta.checkpoint.run_config import model_flags
        from megatron_delta.trainer.main import main
        from tests.helpers.flags import CPU

        argv = model_flags(rc) + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--mock-data",
                                  "--finetune", "--load", save, "--seq-length", "16", "--micro-batch-size", "1",
                                  "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                                  "--eval-iters", "0", "--eval-interval", "1000"] + CPU
        assert main(argv) == 0


@pytest.mark.parametrize("mode,moe", [("delta_block", True), ("attnres", False)])
def test_routed_mla_exports_as_remote_code_with_deepseek_modules(mode, moe, tmp_path):
    """A trained routed MLA checkpoint (routers at 10x the lr, so that they matter) -> DeltaDeepseekV3ForCausalLM
    remote code (DeepSeek-V3's attention and MoE, the routers of megatron_delta/hf): logits equal Megatron's;
    generate() with and without the KV cache gives the same tokens."""
    from transformers import AutoModelForCausalLM

    from megatron_delta.convert.hf_checkpoint import export_checkpoint
    from megatron_delta.evaluation.loaders import load_megatron
    from megatron_delta.evaluation.token_nll import evaluate_tokens
    from megatron_delta.trainer.main import main
    from tests.helpers.conversion import EXPORT_TOL, SEQS
    from tests.helpers.rank_runner import DEEPSEEK_MOE

    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    extra = ["--residual", mode, "--delta-num-blocks", "2", "--delta-null-source", "--delta-router-lr-mult", "10",
             "--rope-type", "yarn", "--train-iters", "3", "--lr", "1e-2", "--save", save, "--save-interval", "3"]
    if moe:
        extra += DEEPSEEK_MOE
        extra[extra.index("--moe-layer-freq") + 1] = "[0,1]"
    assert main(mla_cli(extra, num_layers=2, hidden=32, heads=2, seq=16, mbs=2)) == 0
    export_checkpoint(save, out, log=lambda *a: None)
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf).__name__ == "DeltaDeepseekV3ForCausalLM"
    assert type(hf.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"
    assert type(hf.model.layers[1].mlp).__name__ == ("DeepseekV3MoE" if moe else "DeepseekV3MLP")
    assert any(p.abs().sum() > 0 for n, p in hf.named_parameters() if n.endswith("_router.query"))
    model, _, rc = load_megatron(save)
    seqs = [[t % 256 for t in s] for s in SEQS]
    _, meg_logits = evaluate_tokens(model, 256, seqs)
    for ids, ml in zip(seqs, meg_logits):
        with torch.no_grad():
            hl = hf(torch.tensor([ids])).logits[0].float()
        diff = (hl - ml).abs().max().item()
        assert diff <= EXPORT_TOL, diff
        print(f"[routed MLA export {mode} moe={moe}] max |HF - Megatron| logits {diff:.1e}")
    prompt = torch.tensor([SEQS[0][:5]])
    with torch.no_grad():
        cached = hf.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        uncached = hf.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.tolist() == uncached.tolist() and cached.shape[1] == 11
