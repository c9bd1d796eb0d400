"""Where Megatron-LM's trainer puts a checkpoint: the tracker file and the iteration directories of a --save
directory. The one statement of the layout, below both run_config.py (the contract) and errors.py (the
one-line diagnoses), which import it."""
import os

TRACKER = "latest_checkpointed_iteration.txt"  # megatron.training.checkpointing.get_checkpoint_tracker_filename


def iteration_dir(root: str, iteration: int) -> str:
    """root/iter_NNNNNNN, as megatron.training.checkpointing.get_checkpoint_name names it."""
    return os.path.join(root, f"iter_{iteration:07d}")
