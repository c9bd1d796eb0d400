"""Multi-latent attention on Megatron-Core's local backend.

MLASelfAttention builds its core attention with MLA's head sizes (``k_channels`` = qk_head_dim +
qk_pos_emb_head_dim, ``v_channels`` = v_head_dim); megatron-core 0.19's local DotProductAttention takes neither
(TypeError when the model is built; NVIDIA/Megatron-LM issue #1589, PR #6564 open) and shapes its output from
kv_channels. :class:`MLADotProductAttention` is that module with the two sizes; the local MLA layer specs
(core/specs.py) use it. Transformer Engine's core attention takes them already.
"""

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide


class MLADotProductAttention(DotProductAttention):
    """Megatron's local DotProductAttention with MLA's key and value head sizes."""

    # Replaces DotProductAttention.__init__: takes k_channels / v_channels (MLASelfAttention passes them). The
    # softmax scale is MLASelfAttention's (YaRN mscale / sqrt(k_channels)); the output is v_channels per head.
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            # DotProductAttention.forward reshapes its context [sq, b, np, v] to this width
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, self.tp_group.size())
