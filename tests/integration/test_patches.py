"""megatron_delta.platform.patches, the one registry of changes of upstream behaviour: every entry says what it changes,
which upstream issue or failure it answers, for which megatron-core versions and where; an entry outside its
versions is not applied; the pointing entries point at the code that makes the change; known upstream warnings
are silenced around the upstream calls only (no process-wide warning filter after a run).

The functions without a ``test_`` prefix run in fresh processes (tests/helpers/dist_utils.py); this module imports
nothing of Megatron at top level."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.dist_utils import run_distributed

REPO = pathlib.Path(REPO_ROOT)
ENTRIES = [
    "current_device", "synchronize", "tensor_cuda", "module_torch", "rng", "clip_grads", "tensor_type_checks",
    "checkpoint_without_output_fp8", "training_module_torch", "initialize_allow_no_cuda", "initialize_model_parallel",
    "compile_helpers", "device_arch_version", "loader_generator", "moe_splits_to_host",
    "moe_uneven_gather",
    "distopt_fresh_state_dict", "distopt_step_per_param", "distopt_load_no_grad", "distopt_missing_state_key",
    "ckpt_writer_manager_exits_with_rank", "expert_parallel_optimizer_reshard",
    "p2p_shape_exchange", "vpp_pp2_batched_p2p", "local_mla_core_attention", "local_mla_tp_gradients",
    "delta_config_classes", "trainer_hooks",
    "checkpoint_hint",
    "verify_integrity_default", "model_parallel_release",
]
CPU_ENTRIES = ENTRIES[:16]  # the CPU adaptation
FIX_ENTRIES = ENTRIES[16:22]  # upstream fixes applied on every device


# ------------------------------------------------------------------------------------------ the table
def test_registry_lists_every_entry_with_issue_versions_and_where():
    from packaging.specifiers import SpecifierSet

    from megatron_delta.platform import patches

    assert [p.name for p in patches.REGISTRY] == ENTRIES
    for p in patches.REGISTRY:
        assert p.changes and all(c.startswith(("megatron.", "torch.")) for c in p.changes), p.name
        assert len(p.answers) > 40 and "\n" not in p.answers, p.name  # one line saying what fails
        assert "0.19.2" in SpecifierSet(p.versions), p.name  # the installed megatron-core
        assert p.where in (patches.CPU_ONLY, patches.EVERY_DEVICE), p.name
        assert (p.apply is None) == bool(p.made_by), p.name
    cpu = [p.name for p in patches.REGISTRY if p.where == patches.CPU_ONLY]
    assert cpu == CPU_ENTRIES  # the rest applies on every device
    # the entries with an upstream issue name it
    assert patches.entry("vpp_pp2_batched_p2p").answers.startswith("Megatron-LM #750:")
    assert patches.entry("p2p_shape_exchange").answers.startswith("Megatron-LM #1450:")


def test_registry_refuses_an_incomplete_entry():
    from megatron_delta.platform import patches

    with pytest.raises(ValueError, match="where must be"):
        patches.Patch("x", ("torch.x",), "a failure", ">=0.19", "GPU", made_by="here")
    with pytest.raises(ValueError, match="either apply .* or made_by"):
        patches.Patch("x", ("torch.x",), "a failure", ">=0.19", patches.CPU_ONLY)
    with pytest.raises(ValueError, match="changes, answers and versions are required"):
        patches.Patch("x", (), "a failure", ">=0.19", patches.CPU_ONLY, made_by="here")
    with pytest.raises(Exception, match="Invalid specifier"):
        patches.Patch("x", ("torch.x",), "a failure", "0.19 or later", patches.CPU_ONLY, made_by="here")


def test_a_version_outside_the_range_skips_the_entry_and_says_so():
    from megatron_delta.platform import patches

    distopt = patches.entry("distopt_step_per_param")
    assert patches.applies(distopt, version="0.19.2") == (True, "")
    assert patches.applies(distopt, version="0.19.2+f360c1d") == (True, "")  # a local build of it
    assert patches.applies(distopt, version="0.20.0") == (False, "megatron-core 0.20.0 is outside >=0.19,<0.20")
    assert patches.applies(distopt, version="0.18.1") == (False, "megatron-core 0.18.1 is outside >=0.19,<0.20")
    rng = patches.entry("rng")
    assert patches.applies(rng, version="0.16.1", cuda=False) == (True, "")
    assert patches.applies(rng, version="0.19.2", cuda=True) == (False, "CUDA is available (CPU only)")
    assert patches.applies(distopt, version="0.19.2", cuda=True) == (True, "")  # every device

    lines = dict(line.split(None, 1) for line in patches.describe(version="0.20.0", cuda=False))
    assert list(lines) == ENTRIES
    for name in CPU_ENTRIES + FIX_ENTRIES:
        assert lines[name].endswith(f"skipped: megatron-core 0.20.0 is outside {patches.entry(name).versions}")
    assert "made by megatron_delta/trainer/hooks.py RunHooks" in lines["trainer_hooks"]
    assert "[megatron-core 0.20.0 is outside >=0.19,<0.20]" in lines["trainer_hooks"]
    lines = dict(line.split(None, 1) for line in patches.describe(version="0.19.2", cuda=True))
    assert lines["current_device"].endswith("skipped: CUDA is available (CPU only)")
    assert lines["distopt_load_no_grad"].endswith("applies")


_APPLY_PROBE = r"""
import json, logging, sys, torch
logging.basicConfig(stream=sys.stdout, format="LOG %(message)s")
original = torch.cuda.current_device
from megatron_delta.platform import patches
out = {"cpu_outside": patches.apply_patches(patches.CPU_ONLY, version="0.20.0"),
       "untouched": torch.cuda.current_device is original,
       "megatron_imported": "megatron.core" in sys.modules}
out["every_device_inside"] = patches.apply_patches(patches.EVERY_DEVICE, version="0.19.9")
out["again"] = patches.apply_patches(patches.EVERY_DEVICE, version="0.19.9")
out["cpu_inside"] = patches.apply_patches(patches.CPU_ONLY, version="0.19.2")
out["patched"] = torch.cuda.current_device is not original
out["applied"] = patches.applied()
print("RESULT " + json.dumps(out))
"""


def test_apply_patches_skips_entries_outside_the_version_given():
    """A fresh process: a faked megatron-core 0.20.0 applies no CPU entry (and imports no Megatron); a version
    in range applies them, once."""
    run = subprocess.run([sys.executable, "-c", _APPLY_PROBE], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert out["cpu_outside"] == [] and out["untouched"] and not out["megatron_imported"]
    for name in CPU_ENTRIES:  # each skipped entry is reported
        assert f"LOG megatron_delta.platform.patches: {name} not applied: megatron-core 0.20.0 is outside" in run.stdout
    assert out["every_device_inside"] == FIX_ENTRIES and out["again"] == []
    assert out["cpu_inside"] == CPU_ENTRIES and out["patched"]
    assert out["applied"] == FIX_ENTRIES + CPU_ENTRIES


def test_patches_suspended_knows_only_installable_entries():
    from megatron_delta.platform import patches

    with pytest.raises(ValueError, match=r"unknown patches \['nope', 'trainer_hooks'\]"):
        with patches.patches_suspended("trainer_hooks", "nope"):
            pass


# ------------------------------------------------------------------------------------------ the pointers
def test_pointing_entries_point_at_the_code_that_makes_the_change():
    from megatron_delta.core import payload
    from megatron_delta.platform import patches

    cls = payload.PayloadP2PCommunicator
    assert "_communicate_shapes" in cls.__dict__  # the override of p2p_shape_exchange
    assert cls.__mro__[1].__qualname__ == "P2PCommunicator"
    for p in patches.REGISTRY:
        if p.made_by:
            files = [w.rstrip(",;:") for w in p.made_by.split() if w.rstrip(",;:").endswith(".py")]
            assert all((REPO / f).is_file() for f in files), (p.name, files)
    # vpp_pp2_batched_p2p: the one decision, and the refusal of the silently wrong setting
    assert patches.batch_p2p_comm(None) is True and patches.batch_p2p_comm(2) is False


def test_trainer_hooks_entry_lists_exactly_what_the_run_replaces():
    """Entering RunHooks replaces the functions trainer_hooks names (and no other); leaving it puts them back."""
    import argparse

    from megatron_delta.platform import patches
    from megatron_delta.trainer.hooks import RunHooks

    patches.import_megatron(training=True)
    args = argparse.Namespace(rank=0, world_size=1, delta_metrics_file=None)
    modules = {m: sys.modules[m] for m in ("megatron.training.training", "megatron.training.checkpointing")}
    listed = set(patches.entry("trainer_hooks").changes)
    before = {c: getattr(modules[c.rsplit(".", 1)[0]], c.rsplit(".", 1)[1]) for c in listed}
    run = RunHooks(args)
    with run:
        replaced = {f"{module.__name__}.{name}" for module, name, _ in run._saved}
        changed = {c for c in listed if getattr(modules[c.rsplit(".", 1)[0]], c.rsplit(".", 1)[1]) is not before[c]}
    assert replaced == listed and changed == listed
    assert all(getattr(modules[c.rsplit(".", 1)[0]], c.rsplit(".", 1)[1]) is before[c] for c in listed)


# ------------------------------------------------------------------------------------------ warnings
def _warning_filter_calls_outside_catch_warnings(path: pathlib.Path) -> list[str]:
    """Calls of warnings.filterwarnings / simplefilter / resetwarnings not lexically inside a
    `with warnings.catch_warnings()` block."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []

    def visit(node, guarded):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            guarded = guarded or any("catch_warnings" in ast.unparse(item.context_expr) for item in node.items)
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.split(".")[-1] in ("filterwarnings", "simplefilter", "resetwarnings") and not guarded:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return bad


def test_project_code_sets_no_process_wide_warning_filter():
    files = [*(REPO / "megatron_delta").rglob("*.py"), *(REPO / "tools").glob("*.py"), REPO / "pretrain_gpt.py",
             *(REPO / "tests").rglob("*.py")]
    bad = [b for f in files for b in _warning_filter_calls_outside_catch_warnings(f)]
    assert bad == []
    # the check sees a bare call
    probe = REPO / "tests" / "__pycache__" / "warning_probe.py"
    probe.parent.mkdir(exist_ok=True)
    probe.write_text("import warnings\nwith warnings.catch_warnings():\n    warnings.simplefilter('ignore')\n"
                     "warnings.filterwarnings('ignore')\n")
    try:
        assert _warning_filter_calls_outside_catch_warnings(probe) == [
            "tests/__pycache__/warning_probe.py:4 warnings.filterwarnings"]
    finally:
        probe.unlink()


def test_known_warnings_are_quieted_inside_the_block_only():
    """known_warnings_quieted: the known warnings silenced inside; afterwards the filters are what they were,
    plus what upstream code set meanwhile (its own filters outlive the block, as they would without it)."""
    import warnings

    from megatron_delta.platform import patches

    class UpstreamWarning(UserWarning):
        pass

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with patches.known_warnings_quieted():
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
            warnings.warn("\n        It is recommended to use a ModelConfig (e.g. ...)")
            warnings.warn("the project's own warning")
            warnings.filterwarnings("once", category=UpstreamWarning)  # as sympy's import does
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        after = list(warnings.filters)
    assert [str(w.message) for w in shown] == [
        "the project's own warning", "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."]
    assert after[0] == ("once", None, UpstreamWarning, None, 0) and after[1] == ("always", None, Warning, None, 0)
    assert after[2:] == before and warnings.filters == before


def rank_trainer_warnings(root: str) -> dict:
    """One trainer run (1 iteration, delta_block, with a save): the warning filters it leaves behind and who added
    them (the file calling warnings.filterwarnings / simplefilter), and the warnings shown meanwhile (Python's
    default filters: a fresh process, not pytest's)."""
    import functools
    import sys
    import warnings

    adders = {}

    def recorded(fn):
        @functools.wraps(fn)
        def call(*a, **k):
            ahead = list(warnings.filters)
            fn(*a, **k)
            for f in warnings.filters:
                if f not in ahead:
                    adders.setdefault(repr(f), sys._getframe(1).f_code.co_filename)

        return call

    warnings.filterwarnings, warnings.simplefilter = recorded(warnings.filterwarnings), recorded(warnings.simplefilter)
    shown = []
    warnings.showwarning = lambda message, category, *a, **k: shown.append(f"{category.__name__}: {message}")
    before = [repr(f) for f in warnings.filters]
    from megatron_delta.trainer.main import main
    from tests.helpers.trainer_driver import COMMON, mode_flags

    code = main(COMMON + mode_flags("delta_block") + ["--train-iters", "1", "--save", os.path.join(root, "ckpt"),
                                                      "--save-interval", "1"])
    from megatron_delta.platform import patches

    left = [repr(f) for f in warnings.filters if repr(f) not in before]
    return {"code": code, "left": {f: adders.get(f, "?") for f in left}, "shown": shown,
            "known": [w.message for w in patches.KNOWN_WARNINGS]}


@pytest.mark.slow
def test_trainer_run_adds_no_warning_filter_and_shows_no_known_noise(tmp_path):
    import re

    r = run_distributed(rank_trainer_warnings, 1, str(tmp_path), timeout=400, torchrun_env=False)[0]
    assert r["code"] == 0
    project = [str(REPO / d) for d in ("megatron_delta", "tools", "tests")]
    by_project = {f: who for f, who in r["left"].items() if who == "?" or who.startswith(tuple(project))}
    assert by_project == {}, r["left"]  # only upstream's own filters (torch's, numpy's at import) remain
    noise = [s for s in r["shown"] if any(re.match(k, s.split(": ", 1)[1], re.I) for k in r["known"])]
    assert noise == []


# ------------------------------------------------------------------------------------------ checkpointing
def rank_optimizer_round_trip(root: str, delta_router_lr_mult: float) -> dict:
    """A routed model's optimizer (Megatron's groups + the routers' group of --delta-router-lr-mult) after one step,
    saved and loaded by megatron_delta.checkpoint.store into a fresh one, with upstream's param-group matching."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields
    from megatron_delta.checkpoint.run_config import checkpoint_args
    from megatron_delta.checkpoint.store import load_checkpoint, save_checkpoint
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed
    from megatron_delta.trainer.hooks import router_overrides

    vocab = 64
    fields = resolve_model_fields(dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                       vocab_size=vocab, residual="delta"))
    # what router_overrides, the scheduler and megatron_delta.checkpoint.store read of a run's args
    args = checkpoint_args(fields, delta_router_lr_mult=delta_router_lr_mult, lr=1e-2, min_lr=1e-3)
    initialize_distributed(seed=1234)

    def build():
        chunk_config, options = model_config(fields)
        (chunk,) = build_model_chunks(chunk_config, vocab, **options)
        model = DistributedDataParallel(config=chunk.config, ddp_config=DistributedDataParallelConfig(), module=chunk)
        config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=0.1)
        optimizer = get_megatron_optimizer(
            config, [model], config_overrides=router_overrides(args, get_standard_config_overrides(config)))
        scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
                                            lr_warmup_steps=1, lr_decay_steps=10, lr_decay_style="cosine",
                                            start_wd=0.1, end_wd=0.1, wd_incr_steps=10, wd_incr_style="constant")
        return model, optimizer, scheduler

    def groups(model, optimizer):
        names = {p: n for n, p in model.module.named_parameters()}
        return [{"max_lr": g.get("max_lr"), "min_lr": g.get("min_lr"), "wd_mult": g.get("wd_mult"),
                 "lr": g["lr"], "params": sorted(names[p] for p in g["params"])}
                for g in optimizer.param_groups]

    def moments(model, optimizer):
        names = {p: n for n, p in model.module.named_parameters()}
        state = optimizer.optimizer.state
        return {names[p]: [float(state[p]["exp_avg"].abs().sum()), float(state[p]["step"])]
                for g in optimizer.param_groups for p in g["params"] if p in state}

    torch.manual_seed(0)
    model, optimizer, scheduler = build()
    tokens = torch.randint(0, vocab, (2, 16))
    position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(tokens, position_ids, None, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    scheduler.step(1)
    save_checkpoint(root, 1, [model], optimizer, scheduler, 2, args)

    torch.manual_seed(1)
    fresh, fresh_optimizer, fresh_scheduler = build()
    assert moments(fresh, fresh_optimizer) == {}
    iteration, consumed, _ = load_checkpoint(root, [fresh], fresh_optimizer, fresh_scheduler, args)
    out = {"iteration": iteration, "consumed": consumed, "saved": groups(model, optimizer),
           "loaded": groups(fresh, fresh_optimizer), "saved_moments": moments(model, optimizer),
           "loaded_moments": moments(fresh, fresh_optimizer)}
    destroy_distributed()
    return out


@pytest.mark.parametrize("delta_router_lr_mult, num_groups", [(2.0, 3), (1.0, 2)])
def test_optimizer_param_groups_reload_without_a_patch(tmp_path, delta_router_lr_mult, num_groups):
    """megatron-core 0.19.2 re-matches the saved optimizer param groups by every per-group setting (max_lr,
    min_lr, wd_mult, ...; MegatronOptimizer._filter_and_reorder_param_groups), and builds one group per distinct
    settings (_get_param_groups): the routers' group of --delta-router-lr-mult reloads into its own group, no patch."""
    r = run_distributed(rank_optimizer_round_trip, 1, str(tmp_path), delta_router_lr_mult, timeout=300)[0]
    assert (r["iteration"], r["consumed"]) == (1, 2)
    assert len(r["saved"]) == num_groups and r["loaded"] == r["saved"]
    routers = [g for g in r["saved"] if any(".router" in n or "router" in n.split(".")[-2] for n in g["params"])]
    assert routers and routers[0]["wd_mult"] == 0.0
    if delta_router_lr_mult != 1.0:
        assert routers[0]["max_lr"] == pytest.approx(1e-2 * delta_router_lr_mult)
        assert all("router" in n for n in routers[0]["params"])
    assert r["loaded_moments"] == r["saved_moments"] and len(r["saved_moments"]) == sum(
        len(g["params"]) for g in r["saved"])
