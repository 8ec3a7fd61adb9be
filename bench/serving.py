"""Serving benchmark: Poisson arrivals at several rates over HTTP with streaming, against a
`pagedserve serve` subprocess on a loopback port. Per rate: throughput and TTFT / inter-token /
end-to-end latency at p50, p90, p99; a PNG plot of latency against rate.

Usage: python bench/serving.py [--workload mixed16] [--rates 0.5,1,2,4] [--requests 16] [--max-tokens 64]
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server_proc import serve  # noqa: E402
from throughput import load_workload  # noqa: E402


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one(client, base, req, max_tokens):
    t0 = time.perf_counter()
    ttft, last, itl, n = None, None, [], 0
    body = {"prompt": req["prompt_token_ids"], "max_tokens": min(max_tokens, req["max_tokens"]), "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            now = time.perf_counter()
            if obj.get("usage"):
                n = obj["usage"]["completion_tokens"]
            if obj.get("choices") and obj["choices"][0]["text"]:
                if ttft is None:
                    ttft = now - t0
                else:
                    itl.append(now - last)
                last = now
    return {"ttft": ttft, "itl": itl, "e2e": time.perf_counter() - t0, "tokens": n}


async def run_rate(base, reqs, rate, max_tokens, seed, request=one):
    """`request(client, base, req, max_tokens)` -> {"ttft", "itl", "e2e", "tokens"} for one request."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        tasks, t0 = [], time.perf_counter()
        for r in reqs:
            tasks.append(asyncio.create_task(request(client, base, r, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        res = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in res if r["ttft"] is not None]
    itl = [x for r in res for x in r["itl"]]
    e2e = [r["e2e"] for r in res]
    toks = sum(r["tokens"] for r in res)
    row = {"rate": rate, "requests": len(res), "output_tokens": toks, "wall_s": round(wall, 2),
           "output_tok_s": round(toks / wall, 2)}
    for name, xs in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for p in (50, 90, 99):
            row[f"{name}_p{p}_ms"] = round(1000 * pct(xs, p), 1)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mixed16")
    ap.add_argument("--rates", default="0.5,1,2,4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serving"))
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep prefix caching on (off by default: every rate replays the same prompts, so later "
                         "rates would hit the cache and look faster)")
    a = ap.parse_args()
    reqs = load_workload(a.workload)[: a.requests]
    srv, base = serve(["--num-kv-blocks", "4096", *([] if a.prefix_caching else ["--no-enable-prefix-caching"])])
    try:
        with httpx.Client(timeout=120) as c:   # warm-up: first forward passes are slower
            c.post(base + "/v1/completions", json={"prompt": reqs[0]["prompt_token_ids"], "max_tokens": 4})
        rows = []
        for i, rate in enumerate(float(x) for x in a.rates.split(",")):
            row = asyncio.run(run_rate(base, reqs, rate, a.max_tokens, seed=i))
            rows.append(row)
            print("RESULT " + json.dumps(row), flush=True)
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    rates = [r["rate"] for r in rows]
    for ax, name, title in zip(axes, ("ttft", "itl", "e2e"), ("time to first token", "inter-token latency",
                                                                "end-to-end latency")):
        for p, style in ((50, "o-"), (90, "s--"), (99, "^:")):
            ax.plot(rates, [r[f"{name}_p{p}_ms"] for r in rows], style, label=f"p{p}")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"pagedserve serving, {a.workload} ({a.requests} requests, <= {a.max_tokens} output tokens)")
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=90)
    print("| rate (req/s) | output tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        f = lambda n: "/".join(str(r[f"{n}_p{p}_ms"]) for p in (50, 90, 99))   # noqa: E731
        print(f"| {r['rate']} | {r['output_tok_s']} | {f('ttft')} | {f('itl')} | {f('e2e')} |")


if __name__ == "__main__":
    main()
