"""bf16 end to end on CPU: every residual mode trains with `--bf16` under TP2+PP2+SP.

The runs (tests/helpers/rank_runner.py's tiny model: 4 layers, hidden 64, 4 heads in 2 query groups, seq 32, mbs 2, gbs
8, mock data, lr 1e-2, ITERS iterations), from the session's fixtures (tests/conftest.py):
  TP1, one process (tp1_reference): one fp32 initial model per mode (`--train-iters 0 --save`), then the same
      iterations from it (`--load --finetune`) in fp32 and in bf16;
  TP2+PP2+SP, 4 gloo ranks (tp2_pp2_sp_runs, shared with tests/integration/test_parallel_parity.py): the same runs from
      the same initial models, bf16 (saving the trained model) and fp32.
What they must show:
  (1) bf16 under TP2+PP2+SP: finite, falling loss, within BF16_VS_FP32 of the same run in fp32 (and so under
      TP1); the fp32 runs of the two layouts agree to FP32_PARITY (tests/integration/test_parallel_parity.py's 1e-5),
      so a gap below is bf16 rounding, not a layout bug;
  (2) precision: the optimizer's main params - the values Adam updates and checkpoints - are fp32 for every
      parameter, routers included (docs/design.md section 2.5; the router math on bf16 sources and with bf16
      parameters is tests/unit/test_router.py's test_bf16_sources_fp32_math and test_bf16_parameters_fp32_math);
      Megatron's Float16Module holds the model copy in bf16, routers included (fp32 router params in a bf16 model
      break megatron-core 0.19.2's optimizer checkpoints: both optimizers' sharded_state_dict assume one dtype).
      The activations - the decoder's input and output, the payload received from the previous pipeline stage,
      every router's output - are bf16;
  (3) layout parity at bf16 tolerance: the bf16 losses under TP2+PP2+SP equal TP1's within BF16_LAYOUTS;
  (4) the bf16-trained TP2+PP2+SP checkpoint exported with `--dtype bf16` (megatron_delta.convert) and
      loaded by transformers in bf16 (routers kept fp32) gives Megatron's bf16 forward of the same checkpoint
      (the trained model in Float16Module, TP1) within BF16_EXPORT, where an fp32 export of the same
      checkpoint matches it only to the bf16 rounding of the activations.
The routed modes train with --delta-router-lr-mult 10 (rank_runner's *_r10 variants) so the routers' part of the
function stands out from bf16 rounding. CPU, one thread per rank, offline.
"""
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from megatron_delta.core.modes import RESIDUAL_MODES, ROUTED_MODES
from tests.helpers import REPO_ROOT as REPO
from tests.helpers.dist_utils import run_distributed
from tests.helpers.rank_runner import ITERS

MODES = list(RESIDUAL_MODES)
ROUTED = list(ROUTED_MODES)

# Tolerances: ~3x the worst gap measured over the 5 modes (2-core CPU, torch 2.13, megatron-core 0.19.2).
# Per-iteration LM loss (nats; the loss falls ~0.5 in the 4 iterations, 0.27 for full_attnres, whose x10 router
# lr overshoots at the 4th): bf16 vs fp32 measured 6.0e-4 .. 5.2e-3 (TP2+PP2+SP) and 8.6e-4 .. 4.0e-3 (TP1);
# bf16 TP2+PP2+SP vs TP1 measured 3.0e-4 .. 5.8e-3, where fp32 layouts agree to 4.8e-7.
BF16_VS_FP32 = 1.5e-2
BF16_LAYOUTS = 1.5e-2
FP32_PARITY = 1e-5      # as tests/integration/test_parallel_parity.py
# Logits (|logit| <= ~1.7, bf16 spacing 7.8e-3 there): bf16 export vs Megatron bf16 measured 7.8e-3 .. 1.2e-2
# (about one bf16 step: the two round differently inside, e.g. the attention softmax); an fp32 export of the same
# checkpoint is 6.0e-3 .. 1.3e-2 off Megatron bf16; zeroing the exported router queries: 0.27 .. 2.1.
BF16_EXPORT = 3e-2
SEQS = [[1, 5, 9, 200, 3, 3, 17, 255, 0, 42, 7, 64], list(range(3, 256, 8))]  # lengths 12 and 32

pytestmark = pytest.mark.usefixtures("offline_single_thread", "distributed_teardown")


@pytest.fixture(scope="module")
def runs(tp1_reference, tp2_pp2_sp_runs):
    """(root, TP1 {mode: {fp32, bf16}}, per rank TP2+PP2+SP {mode: {bf16, fp32}}): the runs with the routers at 10x
    the lr; the bf16 TP2+PP2+SP checkpoints are ROOT/ckpt-tp2pp2sp-bf16_r10-MODE."""
    def r10(by_mode):
        return {m: {"fp32": by_mode[m]["fp32_r10"], "bf16": by_mode[m]["bf16_r10"]} for m in MODES}

    root, par = tp2_pp2_sp_runs
    return root, r10(tp1_reference.runs(MODES, ("fp32_r10", "bf16_r10"))), [r10(rank) for rank in par]


def _gap(a, b):
    assert len(a) == len(b) == ITERS, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
def test_bf16_trains_under_tp2_pp2_sp_close_to_fp32(runs):
    _, tp1, par = runs
    last = par[-1]
    gaps = {}
    for mode in MODES:
        bf16, fp32 = last[mode]["bf16"]["losses"], last[mode]["fp32"]["losses"]
        assert len(bf16) == ITERS and all(math.isfinite(x) for x in bf16), (mode, bf16)
        assert bf16[-1] < bf16[0] - 0.2, (mode, bf16)
        assert _gap(fp32, tp1[mode]["fp32"]["losses"]) <= FP32_PARITY, mode
        gaps[mode] = (_gap(bf16, fp32), _gap(tp1[mode]["bf16"]["losses"], tp1[mode]["fp32"]["losses"]))
    print(f"[bf16 vs fp32, max |loss diff| over {ITERS} iterations: TP2+PP2+SP, TP1] {gaps}")
    bad = {m: g for m, g in gaps.items() if max(g) > BF16_VS_FP32}
    assert not bad, f"bf16 losses differ from fp32 by more than {BF16_VS_FP32}: {bad}"


@pytest.mark.slow
def test_bf16_dtypes_of_params_main_params_and_activations(runs):
    _, tp1, par = runs
    results = [("tp1", 0, tp1)] + [("tp2pp2sp", r, res) for r, res in enumerate(par)]
    for layout, rank, res in results:
        for mode in MODES:
            for prec, want in (("bf16", "bfloat16"), ("fp32", "float32")):
                r = res[mode][prec]
                kinds = ["other", "router"] if mode in ROUTED else ["other"]
                where = (layout, rank, mode, prec)
                assert r["dtypes"]["model"] == {k: [want] for k in kinds}, (where, r["dtypes"])
                assert r["dtypes"]["main"] == {k: ["float32"] for k in kinds}, (where, r["dtypes"])
                seen = r["seen"]
                assert seen["block_output"] == [want], (where, seen)
                # the first stage reads the embedding, a later stage the previous stage's payload
                first = layout == "tp1" or rank < 2
                assert seen["block_input" if first else "block_input_from_previous_stage"] == [want], (where, seen)
                if mode in ROUTED:
                    assert seen["router_output"] == [want], (where, seen)


@pytest.mark.slow
def test_bf16_layouts_agree(runs):
    _, tp1, par = runs
    gaps = {m: _gap(par[-1][m]["bf16"]["losses"], tp1[m]["bf16"]["losses"]) for m in MODES}
    print(f"[bf16 TP2+PP2+SP vs TP1, max |loss diff| over {ITERS} iterations] {gaps}")
    bad = {m: g for m, g in gaps.items() if g > BF16_LAYOUTS}
    assert not bad, f"bf16 TP2+PP2+SP losses differ from TP1 by more than {BF16_LAYOUTS}: {bad}"


def megatron_bf16(ckpt):
    """The checkpoint's model as --bf16 training holds it (the tools' --dtype auto): evaluation.loaders.load_megatron
    builds it in bf16 under TP1 in this process, in Megatron's Float16Module (fp32 logits out)."""
    from megatron.core.transformer.module import Float16Module

    from megatron_delta.evaluation import loaders

    model, args, rc = loaders.load_megatron(ckpt, dtype="auto")
    assert rc["bf16"] is True and args.bf16 is True and isinstance(model, Float16Module)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    return model, rc


def export_gaps(ckpt, out):
    """max |logits| differences on SEQS: {"bf16": HF bf16 export vs Megatron bf16, "fp32": HF fp32 export of
    the same checkpoint vs Megatron bf16}, and the greedy tokens agreement of the bf16 pair."""
    from transformers import AutoModelForCausalLM

    from megatron_delta.checkpoint import run_config
    from megatron_delta.convert import hf_checkpoint
    from megatron_delta.evaluation import loaders

    model, rc = megatron_bf16(ckpt)
    vocab = run_config.true_vocab_size(rc)
    routed = rc["residual"] != "baseline"
    gaps, argmax_equal = {}, True
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        hf_checkpoint.export_checkpoint(ckpt, f"{out}-{dtype}", dtype=dtype, log=lambda *a: None)
        hf = AutoModelForCausalLM.from_pretrained(f"{out}-{dtype}", trust_remote_code=routed,
                                                  dtype=torch_dtype).eval()
        for n, p in hf.named_parameters():  # routers stay fp32 in a bf16 export (their values are bf16's)
            assert p.dtype == (torch.float32 if "_router." in n else torch_dtype), (dtype, n, p.dtype)
        if routed:  # trained routers moved off their zero initial query
            assert any(p.abs().sum() > 0 for n, p in hf.named_parameters() if n.endswith("_router.query"))
        worst = 0.0
        for ids in SEQS:
            t = torch.tensor([ids])
            meg = loaders.megatron_logits(model, t)[0, :, :vocab]
            with torch.no_grad():
                logits = hf(t).logits[0]
            assert logits.dtype == torch_dtype and meg.shape == logits.shape == (len(ids), vocab)
            worst = max(worst, (logits.float() - meg).abs().max().item())
            if dtype == "bf16":
                argmax_equal &= bool((logits.float().argmax(-1) == meg.argmax(-1)).float().mean() >= 0.9)
        gaps[dtype] = worst
        if routed and dtype == "bf16":  # what the tolerance must see: the export without its trained queries
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    if n.endswith("_router.query"):
                        p.zero_()
                gaps["bf16_routers_zeroed"] = max(
                    (hf(torch.tensor([ids])).logits[0].float() - loaders.megatron_logits(
                        model, torch.tensor([ids]))[0, :, :vocab]).abs().max().item() for ids in SEQS)
    return gaps, argmax_equal


@pytest.mark.slow
def test_bf16_export_matches_megatron_bf16(runs, tmp_path):
    root, _, _ = runs
    gaps = {}
    for mode in MODES:
        gaps[mode], argmax_equal = export_gaps(os.path.join(root, f"ckpt-tp2pp2sp-bf16_r10-{mode}"),
                                               str(tmp_path / f"hf-{mode}"))
        assert argmax_equal, mode
    print(f"[HF export vs Megatron bf16 forward, max |logits diff|] {gaps}")
    bad = {m: g for m, g in gaps.items() if g["bf16"] > BF16_EXPORT}
    assert not bad, f"bf16 exports differ from Megatron's bf16 forward by more than {BF16_EXPORT}: {bad}"
    # the tolerance is sharp enough to see the routers: zeroing the exported queries breaks it
    blind = {m: g for m, g in gaps.items() if m in ROUTED and not g["bf16_routers_zeroed"] > 3 * BF16_EXPORT}
    assert not blind, f"the routers' part of the function is within bf16 tolerance: {blind}"


def _tool(name):
    """tools/<name>.py as a module (its main() runs in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_{name}_tool", os.path.join(REPO, "tools", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _evaluate(tmp_path, ckpt, name, *flags):
    """tools/evaluate.py in this process on SEQS: (OUT.json, logits)."""
    import json

    tool = _tool("evaluate")
    toks = tmp_path / "toks.json"
    toks.write_text(json.dumps(SEQS))
    out, logits = tmp_path / f"{name}.json", tmp_path / f"{name}.pt"
    assert tool.main(["--load", ckpt, "--tokens-file", str(toks), "--output", str(out), "--logits-file",
                      str(logits), *flags]) == 0
    return json.loads(out.read_text()), torch.load(logits)


@pytest.mark.slow
def test_evaluate_computes_as_trained(runs, tmp_path):
    """tools/evaluate.py on the bf16-trained checkpoints: by default (--dtype auto) it computes in bf16, as
    training held the model, and says so in OUT.json; its logits are Megatron's bf16 forward (the export test's
    yardstick) exactly; --dtype fp32 computes with the same weights in fp32, which differs from bf16 by bf16
    rounding only; under TP2 x PP2 (4 ranks, the payload crossing the stage boundary in bf16) the bf16 numbers
    equal TP1's within bf16 tolerance."""
    import json

    from megatron_delta.checkpoint import run_config
    from megatron_delta.evaluation import loaders

    root, _, _ = runs
    gaps = {}
    for mode in MODES:
        ckpt = os.path.join(root, f"ckpt-tp2pp2sp-bf16_r10-{mode}")
        auto, auto_logits = _evaluate(tmp_path, ckpt, f"{mode}-auto")
        fp32, fp32_logits = _evaluate(tmp_path, ckpt, f"{mode}-fp32", "--dtype", "fp32")
        assert (auto["dtype"], fp32["dtype"]) == ("bf16", "fp32"), mode
        model, rc = megatron_bf16(ckpt)
        vocab = run_config.true_vocab_size(rc)
        for ids, got in zip(SEQS, auto_logits, strict=True):
            assert torch.equal(got, loaders.megatron_logits(model, torch.tensor([ids]))[0, :, :vocab]), mode
        gap = max((a - b).abs().max().item() for a, b in zip(auto_logits, fp32_logits, strict=True))
        assert 0 < gap <= BF16_EXPORT, (mode, gap)
        gaps[mode] = (gap, abs(auto["total_nll"] - fp32["total_nll"]))
    print(f"[evaluate of the bf16 checkpoints: bf16 vs fp32 compute, max |logits diff|, |total NLL diff|] {gaps}")
    ckpt = os.path.join(root, "ckpt-tp2pp2sp-bf16_r10-delta")
    tp1, tp1_logits = _evaluate(tmp_path, ckpt, "delta-tp1")
    run_distributed(os.path.join("tools", "evaluate.py"), 4, "--load", ckpt,
                    "--tokens-file", str(tmp_path / "toks.json"),
                    "--output", str(tmp_path / "par.json"), "--logits-file", str(tmp_path / "par.pt"),
                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", timeout=600)
    par = json.loads((tmp_path / "par.json").read_text())
    worst = max((a - b).abs().max().item() for a, b in zip(torch.load(tmp_path / "par.pt"), tp1_logits, strict=True))
    print(f"[evaluate bf16 TP2xPP2 vs TP1, delta] max |logits diff| {worst:.2e}, total NLL {par['total_nll']:.5f} "
          f"vs {tp1['total_nll']:.5f}")
    assert par["dtype"] == "bf16" and par["total_tokens"] == tp1["total_tokens"]
    assert worst <= BF16_EXPORT
    assert abs(par["total_nll"] - tp1["total_nll"]) <= BF16_LAYOUTS * par["total_tokens"]


@pytest.mark.slow
def test_routing_report_computes_as_trained(runs, tmp_path):
    """tools/routing_report.py on the bf16-trained delta_block checkpoint: by default in bf16 (recorded in
    routing.json), with --dtype fp32 in fp32; the routing weights of the two agree within bf16 rounding of the
    sources (the routers compute in fp32 either way) and each row still sums to 1."""
    import json

    tool = _tool("routing_report")
    root, _, _ = runs
    ckpt = os.path.join(root, "ckpt-tp2pp2sp-bf16_r10-delta_block")
    reports = {}
    for dtype, flags in (("bf16", []), ("fp32", ["--dtype", "fp32"])):
        out = tmp_path / dtype
        assert tool.main(["--load", ckpt, "--output", str(out), "--mock-data", "--num-batches", "1",
                          "--micro-batch-size", "2", *flags]) == 0
        reports[dtype] = json.loads((out / "routing.json").read_text())
        assert reports[dtype]["dtype"] == dtype
    a, b = (reports[k]["datasets"]["mock"] for k in ("bf16", "fp32"))
    assert a["order"] == b["order"] and a["columns"] == b["columns"]
    worst = 0.0
    for ra, rb in zip(a["aligned_matrix"], b["aligned_matrix"], strict=True):
        assert [w is None for w in ra] == [w is None for w in rb]
        assert math.isclose(sum(w for w in ra if w is not None), 1.0, rel_tol=1e-5)
        worst = max([worst] + [abs(x - y) for x, y in zip(ra, rb) if x is not None])
    print(f"[routing report of the bf16 delta_block checkpoint: bf16 vs fp32, max |mean weight diff|] {worst:.1e}")
    assert 0 < worst <= 1e-2


@pytest.mark.slow
def test_perplexity_computes_as_trained(runs, tmp_path):
    """tools/perplexity.py on the bf16-trained delta checkpoint: by default in bf16 (recorded in its JSON), and
    its NLL over the windows of 31 tokens of context is tools/evaluate.py's bf16 NLL of the same windows (the
    two tools, one model; evaluate.py runs each window's last token through the model too, so the shapes and
    the bf16 roundings may differ); --dtype fp32 moves it by bf16 rounding only."""
    import json

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    stream = list(range(3, 255, 4)) + [255]  # 64 token ids of the checkpoints' NullTokenizer vocabulary, EOD last
    prefix = str(tmp_path / "heldout")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    b.add_document(torch.tensor(stream, dtype=torch.int32), [len(stream)])
    b.finalize(prefix + ".idx")
    tool = _tool("perplexity")
    root, _, _ = runs
    ckpt = os.path.join(root, "ckpt-tp2pp2sp-bf16_r10-delta")
    got = {}
    for dtype, flags in (("bf16", []), ("fp32", ["--dtype", "fp32"])):
        out = tmp_path / f"ppl-{dtype}.json"
        assert tool.main(["--load", ckpt, "--data-path", f"heldout={prefix}", "--seq-length", "31", "--batch-size",
                          "1", "--max-tokens", "0", "--output", str(out), *flags]) == 0
        rep = json.loads(out.read_text())
        assert rep["dtype"] == dtype and rep["datasets"]["heldout"]["predicted_tokens"] == len(stream) - 1
        got[dtype] = rep["datasets"]["heldout"]["nll"]
    # the same windows through tools/evaluate.py (32 tokens, overlapping by one; the model has 32 positions)
    toks = tmp_path / "windows.json"
    toks.write_text(json.dumps([stream[0:32], stream[31:63], stream[62:64]]))
    assert _tool("evaluate").main(["--load", ckpt, "--tokens-file", str(toks),
                                   "--output", str(tmp_path / "ev.json")]) == 0
    ev = json.loads((tmp_path / "ev.json").read_text())
    print(f"[perplexity of the bf16 delta checkpoint] NLL bf16 {got['bf16']:.5f}, fp32 {got['fp32']:.5f}, "
          f"evaluate.py bf16 {ev['total_nll']:.5f}")
    assert ev["dtype"] == "bf16" and ev["total_tokens"] == len(stream) - 1
    assert got["bf16"] == pytest.approx(ev["total_nll"], rel=1e-4)
    assert 0 < abs(got["bf16"] - got["fp32"]) <= BF16_LAYOUTS * (len(stream) - 1)
