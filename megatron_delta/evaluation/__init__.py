"""Evaluation of trained models, in the trainer and in the tools.

  loaders        - a checkpoint loaded for evaluation (one process, or any layout), computing as trained; logits
  in_training    - what the trainer evaluates beside validation: --delta-heldout-data-path, the routing statistics
  routing_stats  - statistics of the depth routers' weights (entropy, mass per source), merged over ranks
  cloze          - the word-cloze task on held-out text, run with lm-eval on an exported HF model
"""
