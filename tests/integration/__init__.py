"""Multi-process tests: torchrun and run_distributed launches, trainer runs, tools and pretrain_gpt.py run end to end
as subprocesses."""
