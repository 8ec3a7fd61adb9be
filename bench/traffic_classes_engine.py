"""Traffic classes seen from the engine (no HTTP, no client on the cores): bench/traffic_classes.py's workload
through LLMEngine in one process, an interactive class (32-128-token prompts, 64 out, Poisson --rate) beside
--batch requests always in flight (1-4k-token prompts, 256 out, priority 10). Per run: the interactive
requests' inter-token gaps and TTFT as the engine emits them, the steps that carry an interactive decode
(time, the step-time model's prediction, the rows of the slowest), and the batch tokens computed per second
over the window. --no-classes runs the same with priorities only.

Usage: python bench/traffic_classes_engine.py [--itl-ms 15.6] [--ttft-ms 154] [--duration 40] [--warmup 15]
           [--no-classes]
"""
import argparse
import json
import random
import time

from serving import pct as percentile      # the served bench's percentile, so the two compare

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.host import describe
from pagedserve.sampling_params import SamplingParams


def pct(xs, p):
    """The p-th percentile of seconds, in ms (None: no samples)."""
    return None if not xs else round(1e3 * percentile(xs, p), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--itl-ms", type=float, default=15.6)
    ap.add_argument("--ttft-ms", type=float, default=154.0)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--no-classes", action="store_true")
    a = ap.parse_args()
    print(f"host: {describe()}")
    classes = [{"name": "interactive", "priority": 0, "itl_p99_ms": a.itl_ms, "ttft_p99_ms": a.ttft_ms},
               {"name": "batch", "priority": 10}]
    eng = LLMEngine(max_model_len=4300, **({} if a.no_classes else {"traffic_classes": json.dumps(classes)}))
    core, rng = eng.core, random.Random(1)
    sch = core.scheduler
    steps = []                 # (seconds, predicted, carries an interactive decode, rows, batch tokens, end)
    execute = core.executor.execute

    def timed(so):
        rows = [(s.start, s.num_tokens, s.sampling.num_samples if s.sampling else 0) for s in so.seqs]
        pred = sch.step_cost(rows) if sch.step_cost else 0.0
        t = time.perf_counter()
        out = execute(so)
        steps.append((time.perf_counter() - t, pred, any(s.request_id[0] == "i" and s.num_tokens == 1 for s in so.seqs),
                      rows, sum(s.num_tokens for s in so.seqs if s.request_id[0] == "b"), time.perf_counter()))
        return out
    core.executor.execute = timed

    def prompt(n):
        return {"prompt_token_ids": [rng.randrange(200, 40000) for _ in range(n)]}
    bp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0)
    ip = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    klass = {"priority": 0} if a.no_classes else {"traffic_class": "interactive"}
    nb = ni = 0
    for _ in range(a.batch):
        eng.add_request(f"b{nb}", prompt(rng.randint(1000, 4000)), bp, priority=10)
        nb += 1
    t0 = time.perf_counter()
    window, end, next_i = t0 + a.warmup, t0 + a.warmup + a.duration, t0 + a.warmup
    sent, last, gaps, ttft = {}, {}, [], []
    while time.perf_counter() < end:
        now = time.perf_counter()
        if now >= next_i:
            eng.add_request(f"i{ni}", prompt(rng.randint(32, 128)), ip, stream=True, **klass)
            sent[f"i{ni}"], ni, next_i = now, ni + 1, now + rng.expovariate(a.rate)
        for o in eng.step():
            rid, t = o.request_id, time.perf_counter()
            if rid[0] == "i" and o.outputs:
                (gaps if rid in last else ttft).append(t - last.get(rid, sent[rid]))
                last[rid] = t
            if o.finished and rid[0] == "b":
                eng.add_request(f"b{nb}", prompt(rng.randint(1000, 4000)), bp, priority=10)
                nb += 1
    ws = [s for s in steps if s[5] >= window]
    inter = [s for s in ws if s[2]]
    res = {"classes": not a.no_classes, "itl_target_ms": None if a.no_classes else a.itl_ms,
           "interactive_requests": ni, "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99),
           "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
           "steps_with_interactive_decodes": len(inter), "their_time_p50_ms": pct([s[0] for s in inter], 50),
           "their_time_p99_ms": pct([s[0] for s in inter], 99), "predicted_p50_ms": pct([s[1] for s in inter], 50),
           "batch_computed_tok_s": round(sum(s[4] for s in ws) / (time.perf_counter() - window), 1)}
    for s in sorted(inter, key=lambda s: -s[0])[:5]:
        print(f"  slow step {s[0] * 1e3:6.1f} ms (predicted {s[1] * 1e3:5.1f}): prefill "
              f"{[(st, n) for st, n, smp in s[3] if not (n == 1 and smp)]}, decodes at "
              f"{sorted(st for st, n, smp in s[3] if n == 1 and smp)}")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
