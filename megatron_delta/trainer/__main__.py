"""`python -m megatron_delta.trainer ...` (torchrun -m too): Megatron-LM's trainer with the project's models."""
import sys

if __name__ == "__main__":
    from megatron_delta.trainer.main import main

    sys.exit(main())
