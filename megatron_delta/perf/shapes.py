"""The model shapes the performance tools share: the paper's 1B width and 8B layer (SHAPES), and the memory
plan's presets of whole jobs (PRESETS), all in pretrain_gpt.py's field names."""
from megatron_delta.core.modes import DELTA_BLOCK

SHAPES = {  # the paper's 1B width (Qwen3-1.7B) and the 8B layer slice (Qwen3-8B)
    "1B": dict(num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8,
               kv_channels=128, seq_length=2048),
    "8B": dict(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8,
               kv_channels=128, seq_length=2048),
}

PRESETS = {
    # The paper's 8B run = examples/slurm/pretrain_qwen3_8b_delta_block.sbatch on 2 nodes x 8 GPUs.
    "qwen3-8b": dict(**SHAPES["8B"], vocab_size=151936, untie_embeddings_and_output_weights=True,
                     residual=DELTA_BLOCK, delta_num_blocks=4, tensor_model_parallel_size=2,
                     pipeline_model_parallel_size=1, sequence_parallel=True, use_distributed_optimizer=True,
                     bf16=True, fp8_format="hybrid", transformer_impl="transformer_engine", micro_batch_size=1,
                     global_batch_size=64, world_size=16),
}
