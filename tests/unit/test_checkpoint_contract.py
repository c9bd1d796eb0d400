"""The load rule of the run_config.json contract (checkpoint/run_config.py check_load): a --load whose checkpoint
records another value of a flag that defines the model's tensors or its function is refused before upstream
loads anything, in one line naming the flag, both values and where to read them. The flags are written out here,
not read from run_config.MODEL_FLAGS, so that a flag dropped from the contract fails its case."""
import os
import types

import pytest

from megatron_delta.checkpoint.run_config import RUN_CONFIG, CheckpointError, check_load, write_run_config

# A tiny delta_block run's Megatron-LM args (the names upstream's parser gives them: layernorm_epsilon is
# --norm-epsilon, add_bias_linear is --disable-bias-linear negated)
RUN = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
           group_query_attention=True, kv_channels=16, normalization="RMSNorm", layernorm_epsilon=1e-5, swiglu=True,
           qk_layernorm=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
           position_embedding_type="rope", rotary_base=10000, max_position_embeddings=64, padded_vocab_size=128,
           residual="delta_block", delta_num_blocks=2, delta_null_source=True, delta_gate="scalar",
           delta_sources="exact", delta_router_eps=1e-6, tokenizer_type="NullTokenizer", vocab_size=100)

# arg -> (its flag, another value): the routed residual's flags (docs/design.md) and the backbone's that change
# what the checkpoint's tensors compute
OTHER = {
    "residual": ("--residual", "delta"),
    "delta_num_blocks": ("--delta-num-blocks", 4),
    "delta_null_source": ("--delta-null-source", False),
    "delta_gate": ("--delta-gate", "none"),
    "delta_sources": ("--delta-sources", "authors-code"),
    "delta_router_eps": ("--delta-router-eps", 1e-5),
    "layernorm_epsilon": ("--norm-epsilon", 1e-6),
    "num_layers": ("--num-layers", 6),
    "qk_layernorm": ("--qk-layernorm", False),
    "rotary_base": ("--rotary-base", 500000),
    "add_bias_linear": ("--disable-bias-linear", True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint directory whose run_config.json the run RUN wrote (iteration 5)."""
    root = str(tmp_path_factory.mktemp("contract"))
    return write_run_config(root, 5, types.SimpleNamespace(**RUN), False, None)


def test_the_same_flags_load(saved):
    assert os.path.isfile(os.path.join(saved, RUN_CONFIG))
    assert check_load(types.SimpleNamespace(**RUN, load=saved)) == {}


@pytest.mark.parametrize("arg", list(OTHER))
def test_another_model_flag_is_refused_naming_it(saved, arg):
    flag, value = OTHER[arg]
    with pytest.raises(CheckpointError) as e:
        check_load(types.SimpleNamespace(**dict(RUN, **{arg: value}), load=saved))
    was, now = RUN[arg], value
    if arg == "add_bias_linear":  # recorded as --disable-bias-linear
        was, now = not was, not now
    assert str(e.value) == (f"--load {saved} was saved with a different model: {flag}: checkpoint {was!r}, flags "
                            f"{now!r}. Pass the checkpoint's values (see {RUN_CONFIG}).")
