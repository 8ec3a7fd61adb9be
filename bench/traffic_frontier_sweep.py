"""Issue 54 item 3: the controller against the best hand tuning. Runs traffic_frontier.py (issue 54's workload
through the engine alone) once with traffic classes per ITL target, and once per static configuration
without classes (priorities only, `max_num_batched_tokens` swept; `long_prefill_token_threshold` its default 256, or the budget under it),
each in its own process, one after the other. For each target it prints the classes' interactive ITL / TTFT
p99 and batch throughput beside the best static configuration that meets the same targets (ITL p99 <= 1.1x
the target, TTFT p99 <= --ttft-ms): the aim is batch >= 90 % of that one's, and >= 85 % of unclassed (the
default budget, priorities only).

Usage: cd bench; python traffic_frontier_sweep.py [--targets 150,300,600] [--budgets 16,32,64,128,1024]
           [--ttft-ms 1000] [--batch 24] [--duration 90] [--json OUT]
       python traffic_frontier_sweep.py --from-json OUT        # the table again, from an earlier run
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(extra: list[str], a) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "traffic_frontier.py"), "--ttft-ms", str(a.ttft_ms), "--batch",
           str(a.batch), "--duration", str(a.duration), "--max-model-len", str(a.max_model_len), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    print(f"  {' '.join(extra):60s} ITL p99 {res['itl_p99_ms']} ms, TTFT p99 {res['ttft_p99_ms']} ms, "
          f"batch {res['batch_computed_tok_s']} tok/s", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="150,300,600", help="ITL targets (ms), comma-separated")
    ap.add_argument("--budgets", default="16,32,64,128,1024", help="max_num_batched_tokens values; the largest is "
                    "'unclassed' (1024: the default)")
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--json", default=None, help="write every run's result here")
    ap.add_argument("--from-json", default=None, help="print the table of an earlier run's --json, run nothing")
    ap.add_argument("--static-from", default=None, help="an earlier run's --json whose static budgets are taken "
                    "(those --budgets names again are run anew)")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            d = json.load(f)
        classed = {float(k): v for k, v in d["classes"].items()}
        static = {int(k): v for k, v in d["static"].items()}
    else:
        print("classes, one run per ITL target:", flush=True)
        classed = {float(t): run(["--itl-ms", t], a) for t in a.targets.split(",")}
        print("no classes (priorities only), one run per max_num_batched_tokens:", flush=True)
        static = {int(b): run(["--no-classes", "--engine-args", json.dumps(
            {"max_num_batched_tokens": int(b), "long_prefill_token_threshold": min(int(b), 256)})], a)
            for b in a.budgets.split(",") if b}
        if a.static_from:                 # budgets measured in an earlier run of the same tree, not run again
            with open(a.static_from) as f:
                static = {**{int(k): v for k, v in json.load(f)["static"].items()}, **static}
    unclassed = static[max(static)]
    rows = []
    print(f"\n| ITL target ms | classes: ITL p99 (x target) / TTFT p99 ms / batch tok/s | best static meeting both "
          f"targets | batch vs it | best static meeting the ITL target alone (budget: ITL p99 / TTFT p99 / batch) | "
          f"batch vs it | batch vs unclassed ({max(static)}) |")
    print("|---|---|---|---|---|---|---|")
    for t, r in classed.items():
        def best(ttft_too: bool):
            meets = [(b, s) for b, s in static.items() if s["itl_p99_ms"] is not None and s["itl_p99_ms"] <= 1.1 * t
                     and (not ttft_too or (s["ttft_p99_ms"] is not None and s["ttft_p99_ms"] <= a.ttft_ms))]
            return max(meets, key=lambda bs: bs[1]["batch_computed_tok_s"]) if meets else None

        def cells(b):
            if b is None:
                return "none meets it", None, "-"
            vs = round(r["batch_computed_tok_s"] / b[1]["batch_computed_tok_s"], 2)
            return f"{b[0]}: {b[1]['itl_p99_ms']} / {b[1]['ttft_p99_ms']} / {b[1]['batch_computed_tok_s']}", vs, vs
        both, vs_both, c1 = cells(best(True))
        itl, vs_itl, c2 = cells(best(False))
        vs_un = round(r["batch_computed_tok_s"] / unclassed["batch_computed_tok_s"], 2)
        rows.append({"target_ms": t, "classes": r, "vs_best_static_both": vs_both, "vs_best_static_itl": vs_itl,
                     "vs_unclassed": vs_un})
        print(f"| {t:g} | {r['itl_p99_ms']} ({r['itl_p99_ms'] / t:.2f}x) / {r['ttft_p99_ms']} / "
              f"{r['batch_computed_tok_s']} | {both} | {c1} | {itl} | {c2} | {vs_un} |")
    if a.json and not a.from_json:
        with open(a.json, "w") as f:
            json.dump({"classes": {str(k): v for k, v in classed.items()}, "static": {str(k): v for k, v in
                                                                                     static.items()}, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
