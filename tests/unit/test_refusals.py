"""What the routed modes do not support fails at start-up with one message naming it, and
what upstream's TransformerBlock.forward hands its layers reaches the routed layers too (padding_mask).

- Config level: DeltaTransformerConfig refuses each feature of core/config.UNSUPPORTED_FEATURES for a routed
  mode (the flag, the mode and what to do), and accepts the same config for the baseline.
- Layer spec: a DeltaTransformerLayer refuses cross-attention submodules; Megatron's TransformerLayer takes them.
- Trainer: pretrain_gpt.py (megatron_delta.trainer.main) stops with one line before the distributed start-up.
- padding_mask: with an MLP whose output depends on it, a routed model (delta, gate a = 0: the baseline's
  numbers) gives the baseline's logits with a padding mask, in eval and under full recompute.
"""
import functools
import sys

import pytest
import torch

from megatron_delta.core.config import (
    PER_LAYER_GRAPHS_REFUSED,
    UNSUPPORTED_FEATURES,
    DeltaTransformerConfig,
)
from megatron_delta.core.modes import ADDITIVE_MODES, ROUTED_MODES
from tests.helpers.flags import tiny

pytestmark = pytest.mark.usefixtures("distributed_teardown")

SMALL = dict(num_layers=4, hidden_size=32, num_attention_heads=4)

# config field -> (value that switches it on, what else Megatron-Core needs for the baseline to accept it)
SWITCHED_ON = {
    "fp4": ("e2m1", {}),
    "cpu_offloading": (True, dict(cpu_offloading_num_layers=1)),
    "fine_grained_activation_offloading": (True, dict(offload_modules=["core_attn"])),
    "context_parallel_size": (2, {}),
    "overlap_moe_expert_parallel_comm": (True, dict(num_moe_experts=4, expert_model_parallel_size=2, bf16=True,
                                                    moe_token_dispatcher_type="alltoall")),
}

REMEDY = "or use --residual baseline (Megatron-Core's own layers support it)"


def test_every_refusal_is_tested():
    assert set(SWITCHED_ON) == set(UNSUPPORTED_FEATURES)


@pytest.mark.parametrize("field", list(SWITCHED_ON))
def test_config_refuses_for_routed_modes(field):
    """One refusal per feature: the message starts with the flag and the mode and ends with what to do;
    the same fields make a valid baseline config (Megatron-Core's own layers)."""
    value, needs = SWITCHED_ON[field]
    flag, why = UNSUPPORTED_FEATURES[field]
    with pytest.raises(ValueError) as e:
        DeltaTransformerConfig(**SMALL, residual="delta_block", **{field: value}, **needs)
    assert str(e.value) == f"{flag} is not supported with --residual delta_block: {why}. Drop {flag}, {REMEDY}"
    config = DeltaTransformerConfig(**SMALL, residual="baseline", **{field: value}, **needs)
    assert getattr(config, field) == value


@pytest.mark.parametrize("mode", ROUTED_MODES)
def test_config_accepts_full_iteration_graphs(mode):
    """--cuda-graph-impl full_iteration (the whole forward-backward captured once) constructs for every routed mode,
    with the router options a replay must repeat (null source, gate, recompute)."""
    config = DeltaTransformerConfig(**SMALL, residual=mode, cuda_graph_impl="full_iteration")
    assert config.cuda_graph_impl == "full_iteration" and config.routed
    gate = "scalar" if mode in ADDITIVE_MODES else "none"  # the gate is the additive modes'
    config = DeltaTransformerConfig(**SMALL, residual=mode, cuda_graph_impl="full_iteration", delta_null_source=True,
                                    delta_gate=gate, recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1)
    assert config.cuda_graph_impl == "full_iteration"


# (config fields that ask for per-layer graphs, the flag the message names); Megatron-Core turns the deprecated
# switches into cuda_graph_impl (enable_cuda_graph: local, external_cuda_graph: transformer_engine)
PER_LAYER_GRAPHS = [
    (dict(cuda_graph_impl="local"), "--cuda-graph-impl local", "local"),
    (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl transformer_engine", "transformer_engine"),
    (dict(enable_cuda_graph=True), "--enable-cuda-graph", "local"),
    (dict(external_cuda_graph=True), "--external-cuda-graph", "transformer_engine"),
]


@pytest.mark.parametrize("fields, flag, impl", PER_LAYER_GRAPHS, ids=[p[1] for p in PER_LAYER_GRAPHS])
def test_config_refuses_per_layer_graphs(fields, flag, impl):
    """Per-layer graphs: one line naming the flag, why, and the graph mode that works; the baseline keeps them."""
    with pytest.raises(ValueError) as e:
        DeltaTransformerConfig(**SMALL, residual="delta", **fields)
    assert str(e.value) == (f"{flag} is not supported with --residual delta: {PER_LAYER_GRAPHS_REFUSED}. Use "
                            f"--cuda-graph-impl full_iteration (the whole forward-backward in one graph), or "
                            f"--residual baseline")
    assert DeltaTransformerConfig(**SMALL, residual="baseline", **fields).cuda_graph_impl == impl


def test_config_full_iteration_graphs_under_pipeline_parallelism():
    """Full-iteration graphs with pipeline parallelism, one chunk per rank or interleaved: accepted for the routed
    modes (tests/integration/test_padded_payloads.py: the payloads need no shape message) as for the baseline."""
    pp = dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    for layout in (pp, dict(pp, virtual_pipeline_model_parallel_size=2)):
        for mode in ("baseline", "delta_block"):
            config = DeltaTransformerConfig(**SMALL, residual=mode, cuda_graph_impl="full_iteration", **layout)
            assert config.cuda_graph_impl == "full_iteration"


def test_config_off_values_are_accepted():
    DeltaTransformerConfig(**SMALL, residual="delta", context_parallel_size=1, mtp_num_layers=None,
                           num_moe_experts=None, fp4=None, cpu_offloading=False)


# ----------------------------------------------------------------------------- trainer: before start-up
CLI_TINY = tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=1) + [
    "--eval-iters", "1", "--eval-interval", "1000"]

CLI_REFUSED = [
    (["--fp4-format", "e2m1"], "--fp4-format is not supported with --residual delta: "),
    (["--fine-grained-activation-offloading", "--offload-modules", "core_attn"],
     "--fine-grained-activation-offloading is not supported with --residual delta: "),
    (["--context-parallel-size", "2"], "--context-parallel-size is not supported with --residual delta: "),
    (["--overlap-moe-expert-parallel-comm", "--num-experts", "4", "--expert-model-parallel-size", "2",
      "--moe-token-dispatcher-type", "alltoall", "--bf16"],
     "--overlap-moe-expert-parallel-comm is not supported with --residual delta: "),
    (["--fused-residual-rmsnorm"], "--fused-residual-rmsnorm folds the residual add into a fused kernel and cannot "
                                   "be used with --residual delta: "),
]


@pytest.mark.parametrize("flags, start", CLI_REFUSED, ids=[f[0][0] for f in CLI_REFUSED])
def test_trainer_refuses_before_startup(flags, start, monkeypatch, capsys):
    """pretrain_gpt.py --residual delta with the flag: exit 2, one line naming it, and run() (the distributed
    start-up) is never reached."""
    from megatron_delta.trainer import main as trainer_main

    def started(args):
        raise AssertionError("the run started: the flag was not refused at start-up")

    monkeypatch.setattr(trainer_main, "run", started)
    rc = trainer_main.main(CLI_TINY + ["--residual", "delta"] + flags)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("pretrain_gpt.py: error: " + start), line
    assert line.endswith(REMEDY) or line.endswith("x <- x + v itself)"), line


@pytest.mark.parametrize("flags", [["--cuda-graph-impl", "local"], ["--enable-cuda-graph"]], ids=["local", "enable"])
def test_trainer_refuses_graphs_a_routed_mode_cannot_honour(flags, monkeypatch, capsys):
    """The graph options a routed mode cannot honour: the routed line (config.check_cuda_graphs'), before the
    distributed start-up and before the line about CUDA (the routed refusal says what to use instead)."""
    from megatron_delta.trainer import main as trainer_main

    def started(args):
        raise AssertionError("the run started: the flag was not refused at start-up")

    monkeypatch.setattr(trainer_main, "run", started)
    rc = trainer_main.main(CLI_TINY + ["--residual", "delta"] + flags)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"pretrain_gpt.py: error: {flags[0]}") and PER_LAYER_GRAPHS_REFUSED in line, line


@pytest.mark.parametrize("residual, pp", [("baseline", []), ("delta", []), ("delta", ["2"]), ("delta", ["2", "1"])],
                         ids=["baseline", "delta", "delta-pp2", "delta-pp2-vpp"])
def test_trainer_refuses_graphs_without_cuda(residual, pp, monkeypatch, capsys):
    """--cuda-graph-impl full_iteration on a machine without CUDA, in any mode: one line saying that graphs need
    CUDA, before the distributed start-up (Megatron would fail making its capture stream)."""
    from megatron_delta.trainer import main as trainer_main

    def started(args):
        raise AssertionError("the run started: graphs on CPU were not refused at start-up")

    monkeypatch.setattr(trainer_main, "run", started)
    layout = (["--pipeline-model-parallel-size", pp[0]] if pp else []) + (
        ["--num-layers-per-virtual-pipeline-stage", pp[1]] if len(pp) > 1 else [])
    rc = trainer_main.main(CLI_TINY + ["--residual", residual, "--cuda-graph-impl", "full_iteration"] + layout)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: no CUDA device: --cuda-graph-impl full_iteration captures CUDA kernels into a "
        "graph, which needs a CUDA device; drop it on CPU")


@pytest.mark.parametrize("flags", [f for f, _ in CLI_REFUSED], ids=[f[0][0] for f in CLI_REFUSED])
def test_trainer_baseline_keeps_the_flags(flags, monkeypatch):
    """The same flags pass the project's validation for --residual baseline (Megatron-LM's own checks follow)."""
    from megatron.training.arguments import parse_args

    from megatron_delta.trainer.arguments import add_delta_args, validate_delta_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + CLI_TINY + flags)
    args = parse_args(extra_args_provider=add_delta_args)
    validate_delta_args(args)


# ----------------------------------------------------------------------------- built models
@pytest.fixture(scope="module")
def dist():
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, None, 1, seed=1234)
    yield


def _config(mode, **overrides):
    """(DeltaTransformerConfig, GPTModel options) of a 4-layer model (delta: with the scalar gate)."""
    from megatron_delta.checkpoint.model_config import model_config

    return model_config(dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, seq_length=16,
                             vocab_size=64, residual=mode, delta_gate="scalar" if mode == "delta" else "none"),
                        **overrides)


def _t5_cross_attention():
    """Megatron-Core's own cross-attention submodules (its T5 decoder layer)."""
    from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec

    t5 = decoder_model_with_local_spec().submodules
    return dict(pre_cross_attn_layernorm=t5.pre_cross_attn_layernorm, cross_attention=t5.cross_attention,
                cross_attn_bda=t5.cross_attn_bda)


def test_cross_attention_spec_refused(dist):
    """A layer spec with cross-attention: Megatron's TransformerLayer builds it; a routed layer refuses it,
    naming the submodule."""
    import dataclasses

    from megatron.core.transformer.spec_utils import build_module

    from megatron_delta.core.model import layer_spec_for

    config, _ = _config("delta_block")
    spec = layer_spec_for(config)
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **_t5_cross_attention()))
    with pytest.raises(ValueError) as e:
        build_module(spec, config=config, layer_number=1)
    assert str(e.value) == (
        "cross-attention is not supported with --residual delta_block: the layer spec's cross_attention is "
        "CrossAttention, but a routed layer routes two sublayers (self-attention, MLP). Use a GPT layer spec with "
        "cross_attention=IdentityOp, or --residual baseline (Megatron's TransformerLayer) "
        "when instantiating DeltaTransformerLayer")  # build_module's suffix

    base_config, _ = _config("baseline")
    base = layer_spec_for(base_config)
    base = dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, **_t5_cross_attention()))
    layer = build_module(base, config=base_config, layer_number=1)
    assert type(layer.cross_attention).__name__ == "CrossAttention"


def test_block_refuses_what_it_cannot_honour(dist):
    """TransformerBlock.forward's arguments the routed block cannot honour are refused, each named: context
    (cross-attention), inference_context (Megatron-Core's KV-cache inference), extract_layer_indices."""
    from megatron.core import tensor_parallel
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_delta.core.model import build_model_chunks

    config, options = _config("delta")
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    (model,) = build_model_chunks(config, 64, **options)
    h = torch.zeros(16, 2, 32)
    with pytest.raises(ValueError, match=r"^DeltaTransformerBlock.forward: context is not supported with "
                                         r"--residual delta: cross-attention"):
        model.decoder(h, None, context=h)
    with pytest.raises(ValueError, match=r"^DeltaTransformerBlock.forward: inference_context is not supported with "
                                         r"--residual delta: Megatron-Core inference \(KV cache\); generate with"):
        model.decoder(h, None, inference_context=StaticInferenceContext(2, 16))
    with pytest.raises(ValueError, match=r"^DeltaTransformerBlock.forward: extract_layer_indices is not supported"):
        model.decoder(h, None, extract_layer_indices={0})
    model.eval()
    with torch.no_grad():
        assert model.decoder(h, None, extract_layer_indices=set()).shape == h.shape  # empty: upstream's default


# ----------------------------------------------------------------------------- padding_mask reaches the layers
def _padding_aware_mlp():
    from megatron.core.transformer.mlp import MLP

    class PaddingAwareMLP(MLP):
        """Megatron's MLP with its output zeroed at padded tokens ([b, s], True = padding), as an MoE router
        drops them: makes the padding_mask that reaches the MLP visible in the logits."""

        def forward(self, hidden_states, per_token_scale=None, padding_mask=None, **kwargs):
            out, bias = super().forward(hidden_states, per_token_scale, **kwargs)
            if padding_mask is not None:
                out = out * (~padding_mask).t().unsqueeze(-1).to(out.dtype)
            return out, bias

    return PaddingAwareMLP


def _model_with_padding_aware_mlp(mode, recompute_method):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    from megatron_delta.core.model import DeltaGPTModel, final_norm_for, layer_spec_for
    from megatron_delta.core.specs import decoder_block_spec

    recompute = dict(recompute_granularity="full", recompute_method=recompute_method,
                     recompute_num_layers=1) if recompute_method else {}
    config, options = _config(mode, **recompute)
    spec = layer_spec_for(config)
    spec.submodules.mlp = functools.partial(_padding_aware_mlp().as_mlp_submodule,
                                            submodules=spec.submodules.mlp.keywords["submodules"])
    options.pop("transformer_impl")
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model_cls = DeltaGPTModel if config.routed else GPTModel
    block_spec = decoder_block_spec(config, spec, None, final_norm_for("local"))
    return model_cls(config=config, transformer_layer_spec=block_spec, vocab_size=64, pre_process=True,
                     post_process=True, parallel_output=True, **options)


@pytest.mark.parametrize("recompute_method", [None, "uniform", "block"])
def test_padding_mask_reaches_the_layers(dist, recompute_method):
    """delta with the scalar gate at a = 0 computes the baseline's numbers; with an MLP that reads padding_mask,
    the logits stay the baseline's only if the routed block hands padding_mask to every layer's MLP as
    TransformerBlock does (eval: the layer loop; train: full recompute, uniform and block)."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, -1)
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[0, 10:] = True
    padding[1, 3:7] = True
    logits = {}
    for mode in ("baseline", "delta"):
        model = _model_with_padding_aware_mlp(mode, recompute_method)
        model.train(recompute_method is not None)
        with torch.set_grad_enabled(recompute_method is not None):
            masked = model(tokens, positions, None, padding_mask=padding)
            plain = model(tokens, positions, None)
        logits[mode] = (masked.detach(), plain.detach())
        if recompute_method is not None:
            masked.float().sum().backward()  # recompute runs the layers again, with the mask
    assert torch.equal(logits["delta"][0], logits["baseline"][0])
    assert torch.equal(logits["delta"][1], logits["baseline"][1])
    assert not torch.equal(logits["delta"][0], logits["delta"][1])  # the mask matters for these logits


# ----------------------------------------------------------------------------- selective recompute of the norms
@pytest.mark.parametrize("mode", ["baseline", "delta_block"])
def test_selective_norm_recompute_matches_the_plain_step(mode, dist):
    """--recompute-granularity selective --recompute-modules layernorm (upstream's input/pre-MLP norm
    recompute, which the routed layer runs through TransformerLayer._forward_attention/_forward_mlp): the same
    loss and gradients as without recompute. On CPU it needs the patch checkpoint_without_output_fp8 (upstream
    asks TE's FP8 state: NameError without Transformer Engine)."""
    from megatron.core import tensor_parallel

    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.platform.patches import patches_suspended

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)

    def step(**recompute):
        config, options = _config(mode, hidden_dropout=0.0, attention_dropout=0.0, **recompute)
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        (model,) = build_model_chunks(config, 64, **options)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    selective = dict(recompute_granularity="selective", recompute_modules=["layernorm"])
    plain_loss, plain_grads = step()
    loss, grads = step(**selective)
    assert loss == plain_loss
    assert grads.keys() == plain_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], plain_grads[n], rtol=0, atol=1e-6, msg=n)
    with patches_suspended("checkpoint_without_output_fp8"):
        with pytest.raises(NameError, match="FP8GlobalStateManager"):
            step(**selective)


# ----------------------------------------------------------------------------- router kernels that cannot run
C_ON_BF16 = ("--delta-router-kernels c takes fp32 tensors, and --bf16 makes the sources bf16: drop --bf16, or use "
             "--delta-router-kernels auto or torch (PyTorch ops)")


def test_c_kernels_refused_where_they_cannot_run(monkeypatch, capsys):
    """`--delta-router-kernels c` where the C kernels cannot take the tensors (bf16 / fp16 sources, a run on CUDA
    devices) is one line naming the flag and what to use - in the config, in the trainer before the distributed
    start-up, and in the start-up check - instead of every router call going to PyTorch ops without a word; fp32 on
    CPU and the other choices pass."""
    from megatron_delta.core.router import check_kernel_placement
    from megatron_delta.trainer import main as trainer_main

    with pytest.raises(ValueError) as e:
        DeltaTransformerConfig(**SMALL, residual="delta", delta_router_kernels="c", bf16=True)
    assert str(e.value) == C_ON_BF16
    with pytest.raises(ValueError, match=r"^--delta-router-kernels c takes fp32 tensors, and --fp16 makes"):
        check_kernel_placement("c", activation_dtype="fp16")
    with pytest.raises(ValueError) as e:
        check_kernel_placement("c", on_cuda=True)
    assert str(e.value) == ("--delta-router-kernels c runs the fused C kernels on CPU tensors, and this run trains on "
                            "CUDA devices: use --delta-router-kernels auto (the Triton kernels on CUDA) or triton")
    check_kernel_placement("c", activation_dtype="fp32")
    for choice in ("auto", "torch", "triton", "fla"):
        check_kernel_placement(choice, on_cuda=True, activation_dtype="bf16")
    assert DeltaTransformerConfig(**SMALL, residual="delta", delta_router_kernels="auto", bf16=True).bf16

    def started(args):
        raise AssertionError("the run started: --delta-router-kernels c with --bf16 was not refused at start-up")

    monkeypatch.setattr(trainer_main, "run", started)
    rc = trainer_main.main(CLI_TINY + ["--residual", "delta", "--delta-router-kernels", "c", "--bf16"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "pretrain_gpt.py: error: " + C_ON_BF16
