"""What the tests share (tests/unit/, tests/integration/ and tests/gpu/ import it from here; no test module imports
another). REPO_ROOT: the repository's root, whatever folder a test lives in.

  reference_delta    - the independent float64 reference of every residual mode, written from docs/design.md alone
  reference_compare  - random router parameters and the relative error, for comparisons with the reference
  toy_stack          - a toy stack of sublayers routed through SourceBuffer (sources, modes, group router)
  group_toys         - the group router's toy configurations, inputs, cuts and one forward and backward
  host_data          - the ops that make a tensor from host data, counted as they are dispatched
  traffic_steps      - one counted training step of the traffic tests (also run under Triton's interpreter)
  kernel_models      - a 4-layer model on a chosen router backend, compared with the PyTorch path and the reference
  mtp_models         - tiny GPT models with multi-token prediction depths, and their batches
  flags              - the tests' tiny Megatron-LM command lines (tiny, MODEL, CPU, the parallel layouts)
  dist_utils         - run_distributed: a function or script on N ranks (forked from a preloaded server)
  rank_preload       - what the fork server imports before it forks ranks
  rank_runner        - the multi-process runs of the parity, bf16, source-cache and MoE tests (run in the ranks)
  trainer_driver     - rank functions running megatron_delta.trainer.main in one launch
  trainer_jobs       - the trainer as a program (python -m, torchrun) and what a test reads back from its run
  conversion         - the conversion tests' fine-tuning of an imported checkpoint and their HF logits
  sp_marking_driver  - the rank function of the sequence-parallel marking test (ranks import it by name)
  checkpoint_damage  - flips bytes of a saved tensor (the readers' and run-safety tests)
  import_scan        - the imports of a package folder, read from its source (module level and in functions)
  custom_modes       - a residual mode defined outside the package (delta_window), as a user would add one
  triton_cases       - the Triton kernels' cases, run by pytest in a process with Triton's interpreter on
  triton_stash_count - a script: the bytes the Triton kernels' deferred block passes stash in backward
  gpu_cases          - the checks of the CUDA tests (tests/gpu/): kernels against the PyTorch path and the reference,
                       the routed stream captured and replayed
  gpu_interpreter_cases - gpu_cases run by pytest under Triton's interpreter on CPU (tests/unit/test_gpu_prep.py)
"""
import pathlib

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
