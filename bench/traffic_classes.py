"""Traffic classes (issue 26): an interactive class (short prompts, streaming, Poisson arrivals) beside
a batch class flooding the server (long prompts, many concurrent), against `pagedserve serve`, three
ways in one run:
  idle        the interactive stream alone;
  priority    the flood beside it, batch at priority 10 (what vLLM's `priority` gives: today's behaviour
              without classes);
  classes     the same, with --traffic-classes: interactive's ITL target is --itl-factor x its idle ITL
              p99 and its TTFT target --ttft-factor x its idle TTFT p99 (from the idle run).
Per run: interactive TTFT / ITL p50 and p99, batch output tok/s over the interactive window.

Usage: python bench/traffic_classes.py [--duration 60] [--rate 2] [--batch-concurrency 32]
"""
import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server_proc import serve  # noqa: E402
from serving import one, pct  # noqa: E402


def prompt(rng, n):
    return [rng.randrange(200, 40000) for _ in range(n)]


def computed_tokens(base) -> float:
    """Tokens the server has computed (prefill + decode rows of every step), from /metrics."""
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("pagedserve:iteration_prefill_tokens_sum ", "pagedserve:iteration_decode_tokens_sum ")):
            total += float(line.split()[-1])
    return total


async def interactive(client, base, ids, max_tokens, out):
    """One interactive request, streamed (serving.one: TTFT, gaps, completion tokens); `client` sends
    X-Traffic-Class: interactive."""
    r = await one(client, base, {"prompt_token_ids": ids, "max_tokens": max_tokens}, max_tokens)
    out.append({**r, "tokens": len(ids) + r["tokens"]})


async def batch_worker(client, base, rng, a, tokens, stop, sent):
    """Requests back to back until stopped (one only with --batch-once); tokens[key] = completion tokens so
    far of each request; each request sent is logged in `sent` (for --workload-out)."""
    k = 0
    while not stop.is_set() and not (a.batch_once and k):
        key = (id(rng), k)
        k += 1
        body = {"prompt": prompt(rng, rng.randint(a.batch_min, a.batch_max)), "max_tokens": a.batch_out,
                "stream": True, "ignore_eos": True, "priority": 10,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        sent.append((time.perf_counter(), {"prompt_token_ids": body["prompt"], "max_tokens": a.batch_out,
                                           "priority": 10}))
        try:
            async with client.stream("POST", base + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens[key] = usage["completion_tokens"]
        except httpx.HTTPError:
            if not stop.is_set():
                raise


async def run(base, a, with_batch, seed):
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=a.batch_concurrency + 64)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client, \
            httpx.AsyncClient(timeout=900, headers={"X-Traffic-Class": "interactive"}) as iclient:
        stop, tokens, workers, sent, t_start = asyncio.Event(), {}, [], [], time.perf_counter()
        if with_batch:
            workers = [asyncio.create_task(batch_worker(client, base, random.Random(seed * 1000 + i), a, tokens, stop,
                                                        sent))
                       for i in range(a.batch_concurrency)]
            await asyncio.sleep(a.warmup)                      # the flood is in full swing
        start_tokens, start_computed, t0 = sum(tokens.values()), computed_tokens(base), time.perf_counter()
        res, tasks = [], []
        while time.perf_counter() - t0 < a.duration:
            ids = prompt(rng, rng.randint(a.interactive_min, a.interactive_max))
            sent.append((time.perf_counter(), {"prompt_token_ids": ids, "max_tokens": a.interactive_out,
                                               "traffic_class": "interactive"}))
            tasks.append(asyncio.create_task(interactive(iclient, base, ids, a.interactive_out, res)))
            await asyncio.sleep(rng.expovariate(a.rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        batch_toks = sum(tokens.values()) - start_tokens
        computed = computed_tokens(base) - start_computed
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    ttft = [r["ttft"] for r in res if r["ttft"] is not None]
    itl = [x for r in res for x in r["itl"]]
    # the batch class's work: every token the server computed in the window but the interactive ones
    batch_computed = computed - sum(r["tokens"] for r in res)
    row = {"interactive_requests": len(res), "wall_s": round(wall, 1),
           "batch_output_tok_s": round(batch_toks / wall, 2) if with_batch else None,
           "batch_computed_tok_s": round(batch_computed / wall, 1) if with_batch else None,
           "computed_tok_s": round(computed / wall, 1)}
    for name, xs in (("ttft", ttft), ("itl", itl)):
        for p in (50, 99):
            row[f"{name}_p{p}_ms"] = round(1000 * pct(xs, p), 1)
    # what was sent, as `pagedserve simulate --workload` reads it (arrival_s from the first request)
    workload = [{**d, "arrival_s": round(t - t_start, 4)} for t, d in sorted(sent, key=lambda x: x[0])]
    return row, workload


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of interactive arrivals per run")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds the flood runs before the window")
    ap.add_argument("--rate", type=float, default=2.0, help="interactive arrivals per second (Poisson)")
    ap.add_argument("--interactive-min", type=int, default=32)
    ap.add_argument("--interactive-max", type=int, default=128)
    ap.add_argument("--interactive-out", type=int, default=64)
    ap.add_argument("--batch-concurrency", type=int, default=32)
    ap.add_argument("--batch-min", type=int, default=1000)
    ap.add_argument("--batch-max", type=int, default=4000)
    ap.add_argument("--batch-out", type=int, default=256)
    ap.add_argument("--itl-factor", type=float, default=1.5)
    ap.add_argument("--ttft-factor", type=float, default=2.0)
    ap.add_argument("--targets", default=None, help="ITL,TTFT p99 targets in ms for the classes run instead of the "
                                                  "factors x the idle run's (A/B runs of trees: the same targets)")
    ap.add_argument("--batch-class", default="{}", help="extra keys of the batch class, JSON (e.g. max_running)")
    ap.add_argument("--serve-args", default="", help="more `pagedserve serve` flags for every run")
    ap.add_argument("--runs", default="idle,priority,classes")
    ap.add_argument("--batch-once", action="store_true",
                    help="each batch client sends one request (an open workload the simulator can replay)")
    ap.add_argument("--workload-out", default=None,
                    help="write each run's requests as simulate JSONL to PREFIX.RUN.jsonl (with their send times)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "traffic_classes.json"))
    a = ap.parse_args()
    common = ["--max-model-len", str(a.batch_max + a.batch_out + 16), *shlex.split(a.serve_args)]
    rows, idle = {}, None
    for name in a.runs.split(","):
        extra = []
        if name == "classes":
            ref = idle or {"itl_p99_ms": 150.0, "ttft_p99_ms": 1000.0}
            itl, ttft = (a.itl_factor * ref["itl_p99_ms"], a.ttft_factor * ref["ttft_p99_ms"]) if a.targets is None \
                else map(float, a.targets.split(","))
            classes = [{"name": "interactive", "priority": 0, "itl_p99_ms": round(itl, 1), "ttft_p99_ms": round(ttft, 1)},
                       {"name": "batch", "priority": 10, **json.loads(a.batch_class)}]
            extra = ["--traffic-classes", json.dumps(classes)]
        srv, base = serve(common + extra)
        try:
            with httpx.Client(timeout=300) as c:               # warm-up: the first forward passes are slower
                c.post(base + "/v1/completions", json={"prompt": prompt(random.Random(9), 200), "max_tokens": 8})
            row, workload = asyncio.run(run(base, a, name != "idle", seed=1))
            if a.workload_out:
                with open(f"{a.workload_out}.{name}.jsonl", "w") as f:
                    f.writelines(json.dumps(d) + "\n" for d in workload)
        finally:
            srv.terminate()
            srv.wait(timeout=60)
        if name == "classes":
            row["classes"] = classes
        rows[name] = row
        if name == "idle":
            idle = row
        print("RESULT", name, json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "runs": rows}, f, indent=1)
    print("| run | interactive TTFT p50 / p99 ms | ITL p50 / p99 ms | batch tokens computed/s (prompt + output) "
          "| batch output tok/s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} | "
              f"{r['batch_computed_tok_s'] if r['batch_computed_tok_s'] is not None else '-'} | "
              f"{r['batch_output_tok_s'] if r['batch_output_tok_s'] is not None else '-'} |")


if __name__ == "__main__":
    main()
