"""The GPU acceptance run's summary (tools/gpu_acceptance.sh, last step): the CUDA tests' outcomes
(OUT/gpu_tests.json, written as each test finished, against the tests collected: OUT/gpu_tests_collected.txt) and
the throughput run's results (OUT/gpu_check.json) in one JSON, OUT/acceptance.json, and one printed table. A test
skipped or not run in its time is not a pass; neither is a throughput run the budget left out.

    python -m megatron_delta.perf.acceptance OUT TESTS_EXIT_STATUS CHECK_EXIT_STATUS
"""
import json
import os
import sys

TIMED_OUT = (124, 137)  # timeout's exit status for a command it stopped (TERM, then KILL)


def _json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _last_line(path):
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def summarize(out, tests_rc, check_rc):
    """(the summary written to OUT/acceptance.json, the table's lines)."""
    outcomes = _json(os.path.join(out, "gpu_tests.json")) or {}
    try:
        with open(os.path.join(out, "gpu_tests_collected.txt")) as f:
            collected = [line.strip() for line in f if "::" in line]
    except OSError:
        collected = []
    by = {k: sorted(n for n, o in outcomes.items() if o["outcome"] == k) for k in ("passed", "failed", "skipped")}
    tests = dict(exit_status=tests_rc, timed_out=tests_rc in TIMED_OUT, collected=len(collected),
                 passed=len(by["passed"]), failed={n: outcomes[n].get("error") for n in by["failed"]},
                 skipped={n: outcomes[n].get("reason") for n in by["skipped"]},
                 not_run=[n for n in collected if n not in outcomes])
    tests["ok"] = tests_rc == 0 and bool(collected) and tests["passed"] == len(collected)
    check = _json(os.path.join(out, "gpu_check.json"))
    throughput = dict(exit_status=check_rc, timed_out=check_rc in TIMED_OUT,
                      ok=bool(check and check.get("ok")) and check_rc == 0,
                      targets_met=bool(check and check.get("targets_met")),
                      not_run=(check or {}).get("skipped", []), file=os.path.join(out, "gpu_check.json"))
    if check is None:
        throughput["error"] = _last_line(os.path.join(out, "gpu_check.log")) or "no result written"
    result = dict(ok=tests["ok"] and throughput["ok"], tests=tests, throughput=throughput,
                  device=(check or {}).get("device"), layers=(check or {}).get("layers"))
    with open(os.path.join(out, "acceptance.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result, table(result, check)


def table(result, check):
    t, c = result["tests"], result["throughput"]
    lines = [f"GPU acceptance: {'PASS' if result['ok'] else 'FAIL'} on {result['device'] or 'no device'}; "
             f"{result['layers'] or ''}",
             f"CUDA tests: {t['passed']} passed of {t['collected']}, {len(t['failed'])} failed, "
             f"{len(t['skipped'])} skipped, {len(t['not_run'])} not run"
             + (" (stopped at its time limit)" if t["timed_out"] else "") + " - skipped or not run is not passed"]
    lines += [f"  FAILED  {n}: {e}" for n, e in t["failed"].items()]
    reasons = {}
    for n, r in t["skipped"].items():
        reasons.setdefault(r, []).append(n)
    lines += [f"  SKIPPED {len(ns)} ({ns[0]}{', ...' if len(ns) > 1 else ''}): {r}" for r, ns in reasons.items()]
    lines += [f"  NOT RUN {n}" for n in t["not_run"]]
    verdict = "not judged" if check is None else "met" if c["targets_met"] else "MISSED"
    lines.append(f"throughput: {'ok' if c['ok'] else 'FAIL'}, targets {verdict}"
                 + (" (stopped at its time limit)" if c["timed_out"] else "") + f" -> {c['file']}")
    if "error" in c:
        lines.append(f"  {c['error']}")
    for r in (check or {}).get("speed", []):
        run = f"  {r['shape']:3s} {r['mode']:12s} {'graphs' if r['graphs'] else 'eager':6s}"
        if "tokens_per_sec" in r and "throughput_ratio" in r:
            tgt = "" if "target_ok" not in r else (" target MET" if r["target_ok"] else " target MISSED")
            mem = "" if r.get("peak_mem_ratio") is None else f", peak memory {r['peak_mem_ratio']:.3f}x"
            full = r["full_depth_ratio"]
            lines.append(f"{run} {r['tokens_per_sec']:10,.0f} tok/s {r['throughput_ratio']:.3f}x base, at full depth "
                         f"{'-' if full is None else format(full, '.3f')}x{mem}{tgt}")
        else:
            why = r.get("refused") or r.get("not_run") or r.get("error", "no baseline run the same way")
            lines.append(f"{run} {why}")
    for r in (check or {}).get("host", []):
        lines.append(f"  host {r['mode']:12s} S={r['group_size']!s:5s} "
                     + (f"{r['host_us']:.0f} us per router call" if "host_us" in r else r.get("error", "")))
    lines += [f"  NOT RUN {w}" for w in c["not_run"]]
    return lines


def main(argv=None):
    out, tests_rc, check_rc = (argv or sys.argv[1:])[:3]
    result, lines = summarize(out, int(tests_rc), int(check_rc))
    print("\n" + "\n".join(lines) + f"\n-> {os.path.join(out, 'acceptance.json')}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
