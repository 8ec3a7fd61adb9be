"""Served throughput at C concurrent streams: `pagedserve serve` on a loopback port, C clients each
streaming one request after another (mixed16 prompts, max_tokens capped), for a fixed number of
requests. Prints output tok/s and ITL p50 over HTTP; run it on two builds to compare.

Usage: python bench/served_streams.py [--concurrency 16] [--requests 48] [--max-tokens 64]
       [--pythonpath OLD_CHECKOUT] [--serve-args "--kv-cache-dtype int8"]
"""
import argparse
import asyncio
import json
import os
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server_proc import serve  # noqa: E402
from throughput import load_workload  # noqa: E402


async def client(base, queue, stats, max_tokens):
    async with httpx.AsyncClient(timeout=600) as c:
        while queue:
            req = queue.pop()
            last, n = None, 0
            body = {"prompt": req["prompt_token_ids"], "max_tokens": min(max_tokens, req["max_tokens"]),
                    "ignore_eos": True, "stream": True}
            async with c.stream("POST", base + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        obj = json.loads(line[6:])
                        if obj.get("choices") and obj["choices"][0]["text"]:
                            now = time.perf_counter()
                            if last is not None:
                                stats["itl"].append(now - last)
                            last = now
                        n += sum(1 for ch in obj.get("choices", []) if ch.get("text") is not None)
            stats["tokens"] += body["max_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pythonpath", default=None, help="serve the pagedserve found here (e.g. a worktree of an older commit)")
    ap.add_argument("--serve-args", default="", help="more `pagedserve serve` flags, e.g. '--kv-cache-dtype int8'")
    a = ap.parse_args()
    reqs = (load_workload("mixed64") * 2)[: a.requests]
    env = None if a.pythonpath is None else os.environ | {"PYTHONPATH": a.pythonpath}
    srv, base = serve(["--num-kv-blocks", "4096", "--no-enable-prefix-caching", *a.serve_args.split()], env)
    try:
        with httpx.Client(timeout=120) as c:
            c.post(base + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
        stats = {"itl": [], "tokens": 0}
        queue = list(reversed(reqs))
        t = time.perf_counter()

        async def go():
            await asyncio.gather(*(client(base, queue, stats, a.max_tokens) for _ in range(a.concurrency)))
        asyncio.run(go())
        wall = time.perf_counter() - t
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    itl = sorted(stats["itl"])
    print("RESULT " + json.dumps({"concurrency": a.concurrency, "requests": a.requests, "serve_args": a.serve_args,
                                  "pythonpath": a.pythonpath, "wall_s": round(wall, 1),
                                  "output_tok_s": round(stats["tokens"] / wall, 2),
                                  "itl_p50_ms": round(1000 * itl[len(itl) // 2], 1)}))


if __name__ == "__main__":
    main()
