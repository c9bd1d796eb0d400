"""The CUDA tests of the GPU acceptance run (tools/gpu_acceptance.sh): the project's Triton router and group
kernels against the PyTorch path and the float64 reference, and the routed stream captured and replayed with
torch.cuda.graph. Marked ``cuda``: skipped, with the reason, where no CUDA device is visible. Their checks are
tests/helpers/gpu_cases.py, which tests/helpers/gpu_interpreter_cases.py runs on CPU under the Triton interpreter."""
