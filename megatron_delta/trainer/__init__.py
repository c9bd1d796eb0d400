"""pretrain_gpt.py on Megatron-LM's own trainer (`megatron.training.pretrain`, megatron-core 0.19.2).

What Megatron-LM's pretrain_gpt.py holds, for the project's models:

- :mod:`.arguments`  the project's flags (``extra_args_provider``) and their validation
- :mod:`.provider`   the model provider, the dataset provider, the forward step and the loss
- :mod:`.main`       ``main(argv=None) -> int``: parse, adapt to CPU, ``pretrain``, reset the globals
- :mod:`.hooks`      RunHooks: the hooks into megatron.training for one run (metrics, run_config.json,
                     held-out and routing evaluations, the routers' param group)
- :mod:`.embedded`   the run with no data flags: the bundled corpus and the CPU defaults
- :mod:`.forward_pass` forward-only passes of a loaded model over a dataset, outside a training run
- :mod:`.run_summary` one run with its measurements (summary.json: parameters, sources, peak RSS, wall time)
- :mod:`.launch`     torchrun for preemptible jobs: SIGTERM passed on to the workers, which save and exit 0
- :mod:`.__main__`   ``python -m megatron_delta.trainer``

Megatron's trainer runs as it is; the CPU + gloo adaptation and the trainer's
hooks are entries of the registry megatron_delta/platform/patches/.
"""
