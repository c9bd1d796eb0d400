"""Evaluation of trained models, in the trainer and in the tools.

  loaders        - a checkpoint loaded for evaluation (one process, or any layout), computing as trained; logits
  precision      - the precision the tools compute in (--dtype): choices, help, eval_in_bf16 (imports no torch)
  in_training    - what the trainer evaluates beside validation: --delta-heldout-data-path, the routing statistics
  routing_stats  - statistics of the depth routers' weights (entropy, mass per source), merged over ranks
  cloze          - the word-cloze task on held-out text, run with lm-eval on an exported HF model
  cloze_eval     - the cloze command (tools/cloze_eval.py): flags, one line per bad input, the printed results
  token_nll      - per-sequence next-token NLL and greedy tokens (tools/evaluate.py), in one process or TP x PP x DP
  perplexity     - held-out perplexity over fixed, contiguous token streams (tools/perplexity.py)
  routing_report - routing diagnostics of a checkpoint: routing.json, receiver x source matrix, curves
                   (tools/routing_report.py)
  run_comparison - training runs compared in one markdown table (tools/compare_runs.py table)
  loss_curves    - loss curves of runs' metrics files, one colour per run (tools/plot_metrics.py)
"""
