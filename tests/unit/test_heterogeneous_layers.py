"""Heterogeneous layer configs (--heterogeneous-layers-config-path): the baseline builds what Megatron-LM builds
(its HeterogeneousTransformerConfig with the delta_* fields, its per-layer spec); the routed modes refuse it at
start-up with the reason (core/config.py HETEROGENEOUS_REFUSED).

In-process, one rank, fp32, CPU, a 2-layer model whose JSON file the test writes: layer 1 full attention with
its own FFN size, layer 2 a no-op attention with another FFN size.
"""

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.flags import tiny

torch.set_num_threads(1)

SEED = 1234
FLAG = "--heterogeneous-layers-config-path"
# Megatron-LM's validate_model_config_args_from_heterogeneous_config reads these from the file and requires the
# command line to agree (the tiny model's: 2 layers, hidden 32, 2 heads, tied embeddings, RoPE base 1e6).
LAYERS = {
    "hidden_act": "silu", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
    "tie_word_embeddings": True, "rope_theta": 1000000, "rope_scaling": {"factor": 8.0},
    "block_configs": [
        {"attention": {"n_heads_in_group": 1, "no_op": False, "replace_with_linear": False},
         "ffn": {"ffn_hidden_size": 48, "no_op": False, "replace_with_linear": False}},
        {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
         "ffn": {"ffn_hidden_size": 64, "no_op": False, "replace_with_linear": False}},
    ],
}


def cli(path, extra=()) -> list[str]:
    return (tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=2)
            + ["--eval-iters", "0", "--eval-interval", "1000", "--use-rotary-position-embeddings",
               "--use-rope-scaling", "--rope-scaling-factor", "8", FLAG, str(path)] + list(extra))


@pytest.fixture
def layers_json(tmp_path):
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(LAYERS))
    return path


@pytest.fixture(scope="module")
def dist():
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, None, 1, seed=SEED)
    yield


def test_the_baseline_builds_megatron_lms_heterogeneous_model(layers_json, dist):
    """The trainer's config is HeterogeneousTransformerConfig with the delta_* fields (Megatron's class is back
    afterwards), and the model its provider builds has the parameters (names, shapes) of the model Megatron-LM's
    own builder builds from the same args (megatron.training.models.gpt.default_layer_spec, GPTModel), and, with
    those weights loaded, its logits."""
    import megatron.core.transformer.heterogeneous.heterogeneous_config as heterogeneous
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.global_vars import set_args
    from megatron.training.models.gpt import default_layer_spec

    from megatron_delta.core.config import DeltaFields, DeltaHeterogeneousTransformerConfig
    from megatron_delta.trainer.main import parse_args
    from megatron_delta.trainer.provider import model_provider, transformer_config

    args = parse_args(cli(layers_json))
    args.padded_vocab_size = 256
    config = transformer_config(args)
    assert type(config) is DeltaHeterogeneousTransformerConfig and isinstance(config, DeltaFields)
    assert heterogeneous.HeterogeneousTransformerConfig is HeterogeneousTransformerConfig
    assert [(b.attention.no_op, b.mlp.ffn_hidden_size) for b in config.per_block_parameters] == [(False, 48),
                                                                                               (True, 64)]

    set_args(args)  # model_provider reads Megatron-LM's global args
    try:
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        ours = model_provider(pre_process=True, post_process=True, config=config)
    finally:
        set_args(None)

    upstream = core_transformer_config_from_args(args)  # Megatron-LM's own mapping and class
    assert type(upstream) is HeterogeneousTransformerConfig
    spec = default_layer_spec(SimpleNamespace(transformer=upstream, restore_modelopt_state=False), None)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    theirs = GPTModel(config=upstream, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                      max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                      share_embeddings_and_output_weights=True, position_embedding_type="rope",
                      rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                      rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor)

    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}
    assert shapes == {k: tuple(v.shape) for k, v in theirs.state_dict().items() if not k.endswith("_extra_state")}
    assert not any(k.startswith("decoder.layers.1.self_attention.") for k in shapes)  # the no-op attention
    assert shapes["decoder.layers.0.mlp.linear_fc2.weight"] == (32, 48)
    assert shapes["decoder.layers.1.mlp.linear_fc2.weight"] == (32, 64)

    torch.manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():  # every weight random (norm weights start at one)
            p.normal_(0, 0.5)
    ours.load_state_dict(theirs.state_dict())
    tokens = torch.randint(0, args.padded_vocab_size, (2, 16))
    positions = torch.arange(16)[None].expand(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, positions, None), theirs(tokens, positions, None), rtol=0, atol=0)


def test_the_baseline_trains_a_heterogeneous_config(layers_json, tmp_path):
    """pretrain_gpt.py --residual baseline with the file trains: finite losses in its metrics file, the second
    below the first (deterministic: one seed, one CPU thread). Its checkpoint records the file, and the tools,
    which rebuild a model from run_config.json's flags, refuse it in one line before writing anything (they would
    otherwise build a uniform model)."""
    from megatron_delta.checkpoint.errors import CheckpointError
    from megatron_delta.checkpoint.reader import open_checkpoint
    from megatron_delta.convert.hf_checkpoint import export_checkpoint
    from megatron_delta.trainer.main import main

    metrics, save = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    assert main(cli(layers_json, ["--residual", "baseline", "--delta-metrics-file", str(metrics),
                                  "--save", str(save), "--save-interval", "2"])) == 0
    losses = [json.loads(line)["lm_loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 2 and torch.isfinite(torch.tensor(losses)).all() and losses[1] < losses[0], losses
    ckpt = save / "iter_0000002"
    expected = (f"{ckpt} was trained with {FLAG} {layers_json}: the tools rebuild a model from run_config.json's "
                f"flags and cannot rebuild per-layer configurations; evaluate it with pretrain_gpt.py --load {save} "
                f"{FLAG} {layers_json} --skip-train and the run's other flags")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(str(save))
    assert str(e.value) == expected
    with pytest.raises(CheckpointError) as e:
        export_checkpoint(str(save), str(tmp_path / "hf"))
    assert str(e.value) == expected and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("residual", ["delta_block", "full_attnres"])
def test_a_routed_mode_refuses_it_at_start_up(residual, layers_json, monkeypatch, capsys):
    from megatron_delta.trainer import main as trainer_main

    def started(args):
        raise AssertionError("the run started: the flag was not refused at start-up")

    monkeypatch.setattr(trainer_main, "run", started)
    rc = trainer_main.main(cli(layers_json, ["--residual", residual]))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2
    assert line == (
        f"pretrain_gpt.py: error: {FLAG} is not supported with --residual {residual}: Megatron's heterogeneous "
        f"layer spec gives each layer its own submodules (attention or MLP a no-op or a linear layer, its own FFN "
        f"size) and TransformerBlock gives each layer a plain TransformerConfig without the delta_* fields, while "
        f"a routed model builds every layer from the one routed layer spec. Drop the flag, or use --residual "
        f"baseline"), line


def test_the_config_class_refuses_a_routed_mode(layers_json):
    """Library users get the same reason from the config class itself."""
    from megatron_delta.core.config import HETEROGENEOUS_REFUSED, DeltaHeterogeneousTransformerConfig

    with pytest.raises(ValueError) as e:
        DeltaHeterogeneousTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2, residual="delta",
                                            heterogeneous_layers_config_path=str(layers_json))
    assert str(e.value) == (f"{FLAG} is not supported with --residual delta: {HETEROGENEOUS_REFUSED}. Drop the "
                            f"flag, or use --residual baseline")
    config = DeltaHeterogeneousTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2,
                                                 heterogeneous_layers_config_path=str(layers_json))
    assert config.heterogeneous_block_specs and len(config.per_block_parameters) == 2


def test_megatron_lms_own_check_of_the_file_is_one_line(layers_json, monkeypatch, capsys):
    """Megatron-LM checks the command line against the file (validate_args): its ValueError is one line."""
    from megatron_delta.trainer import main as trainer_main

    argv = cli(layers_json)
    argv.remove("--use-rotary-position-embeddings")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    rc = trainer_main.main(argv)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2
    assert line == (f"pretrain_gpt.py: error: {FLAG} {layers_json}: Arguments differ from heterogeneous config: "
                    f"use_rotary_position_embeddings: False (provided) != True (expected) (Megatron-LM "
                    f"validate_args); pass flags that match the file"), line
