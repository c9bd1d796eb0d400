"""Multi-latent attention on Megatron-Core's local backend (--transformer-impl local), as megatron-core 0.19 lacks it.

- MLASelfAttention builds its core attention with MLA's head sizes (``k_channels`` = qk_head_dim +
  qk_pos_emb_head_dim, ``v_channels`` = v_head_dim); 0.19's local DotProductAttention takes neither (TypeError
  when the model is built; NVIDIA/Megatron-LM issue #1589, PR #6564 open) and shapes its output from kv_channels.
  :class:`MLADotProductAttention` is that module with the two sizes.
- Under tensor parallelism the local spec's down projections are ColumnParallelLinear: their outputs are gathered
  over the TP ranks, whose backward keeps each rank's slice of the gradient. The rotary key part ``k_pe`` of the
  key/value latent is read by every head, and each rank holds only its heads, so each rank's slice of its gradient
  misses the other ranks' heads; and without sequence parallelism the replicated query-latent norm ``q_layernorm``
  has its gradient summed over the TP ranks by finalize_model_grads (which sums every ``*q_layernorm*`` under
  --qk-layernorm, right for per-head q norms only): twice the gradient under TP2. :class:`LocalMLASelfAttention`
  gives the key/value latent to upstream's attention as a replicated projection would (the layout upstream's
  ``Linear`` branch handles: ``k_pe`` gathered from the sequence-parallel region, whose backward sums over the
  ranks; without SP its gradient summed by copy_to_tensor_model_parallel_region) and averages, not sums, the
  query-latent norm's replicated gradient. TP1 is unchanged (tests/unit/test_mla.py; TP2 parity in
  tests/integration/test_parallel_parity.py).

The local MLA layer specs (core/specs.py) use both. Transformer Engine's spec has neither problem there (its down
projections are replicated TELinear, its latent norms fused into the up projections).
"""

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
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


class LocalMLASelfAttention(MLASelfAttention):
    """MLASelfAttention with the local backend's gradients right under tensor parallelism (module docstring)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if getattr(self, "q_layernorm", None) is not None and not config.sequence_parallel:
            # every rank normalises the same full query latent: average the identical gradients (finalize_model_grads
            # checks this attribute before its q_layernorm sum)
            for p in self.q_layernorm.parameters():
                p.average_gradients_across_tp_domain = True

    # Replaces MLASelfAttention._qkv_down_projection: a TP-split key/value latent comes back whole over its last
    # dimension (sequence-sharded under SP), as a replicated projection's, with k_pe's gradient summed over the ranks.
    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        rank_dim = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == rank_dim:
            return q_compressed, kv_combined
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined)  # [s, b, rank_dim]
        if self.config.sequence_parallel:
            # upstream's replicated branch gathers k_pe from the sequence-parallel region (backward: sum over ranks)
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined)
        kv_compressed, k_pos_emb = torch.split(
            kv_combined, [self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1)
        return q_compressed, torch.cat([kv_compressed, copy_to_tensor_model_parallel_region(k_pos_emb)], dim=-1)
