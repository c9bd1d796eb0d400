#!/usr/bin/env bash
# The GPU acceptance run: one command, one H100 / H200, at most 6 minutes (docs/gpu.md).
#
#   tools/gpu_acceptance.sh [OUT]     # or OUT=dir tools/gpu_acceptance.sh; default runs/gpu_acceptance
#
# 1. the CUDA tests (tests/gpu: kernel parity, capture and replay of the routed stream), stopped after
#    TESTS_LIMIT_S (180 s); each test's outcome in OUT/gpu_tests.json as it finishes;
# 2. the throughput run (tools/gpu_check.py: tokens/s and peak memory eager and with CUDA graphs, host time per
#    router call), which starts no run after CHECK_BUDGET_S (95 s) and is stopped after CHECK_LIMIT_S (140 s);
#    OUT/gpu_check.json, rewritten after every run;
# 3. the summary (megatron_delta/perf/acceptance.py): OUT/acceptance.json and the table printed, with every test
#    that failed, was skipped or did not run in its time, and every run the budget left out. Skipped is not passed.
# At most 180 + 5 + 140 + 5 s (the limits and their kill grace) and ~10 s to collect and summarise: under 6 minutes.
# Runs on Megatron's local layers (no Transformer Engine needed) from this checkout and its .venv; no network.
# Exit status 0 only where every test passed and every throughput run ran and was ok.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_acceptance}}
PY=${PYTHON:-.venv/bin/python}
TESTS_LIMIT_S=${TESTS_LIMIT_S:-180}
CHECK_BUDGET_S=${CHECK_BUDGET_S:-95}
CHECK_LIMIT_S=${CHECK_LIMIT_S:-140}
mkdir -p "$OUT"
rm -f "$OUT"/gpu_tests.json "$OUT"/gpu_check.json "$OUT"/acceptance.json
"$PY" -m pytest --collect-only -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests_collected.txt" 2>&1
GPU_TEST_RESULTS="$OUT/gpu_tests.json" timeout -k 5 "$TESTS_LIMIT_S" \
    "$PY" -m pytest -q -n 0 -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout -k 5 "$CHECK_LIMIT_S" "$PY" tools/gpu_check.py --out "$OUT/gpu_check.json" \
    --time-budget-s "$CHECK_BUDGET_S" --num-layers-8b 8 2>&1 | tee "$OUT/gpu_check.log"
check_rc=${PIPESTATUS[0]}
"$PY" -m megatron_delta.perf.acceptance "$OUT" "$tests_rc" "$check_rc"
