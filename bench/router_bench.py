"""The data-parallel router, two `pagedserve serve` replicas (child processes) on loopback: (1) the
prefix-cache hit rate over both replicas for 40 requests in 4 prefix families (shuffled), routed
round robin and then cache-aware (fresh families each, so neither finds the other's prefixes);
(2) the latency the router adds: --n sequential 1-token completions straight to a replica and
through the router, interleaved.

Usage: python bench/router_bench.py [--n 60] [--num-kv-blocks 40]
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--num-kv-blocks", type=int, default=40)
    args = ap.parse_args()
    from pagedserve.host import describe
    from pagedserve.router.app import build_router
    from tests.entrypoints.helpers import serve_in_process, serve_in_thread
    from tests.router.test_router import _metrics, _run, family_prompts, hit_rate_delta
    print("host:", describe())
    flags = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "4", "--no-dashboard"]
    with contextlib.ExitStack() as st:
        bases = [st.enter_context(serve_in_process(flags))[0] for _ in range(2)]
        for seed, policy in ((1, "round_robin"), (2, "cache_aware")):
            before = {b: _metrics(b) for b in bases}
            with serve_in_thread(build_router(bases, policy)) as router:
                t = time.perf_counter()
                rs = _run(router, family_prompts(seed))
                wall = time.perf_counter() - t
            assert all(r.status_code == 200 for r in rs)
            print("RESULT", json.dumps({"policy": policy, "requests": len(rs), "wall_s": round(wall, 2),
                                        "prefix_hit_rate": round(hit_rate_delta(bases, before), 3)}), flush=True)
        with serve_in_thread(build_router(bases)) as router:
            direct, routed = [], []
            body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
            with httpx.Client(timeout=60) as c:
                for i in range(args.n + 5):
                    for url, out in ((bases[0], direct), (router, routed)):
                        t = time.perf_counter()
                        assert c.post(url + "/v1/completions", json=body).status_code == 200
                        if i >= 5:                 # the first few warm connections and caches
                            out.append(1e3 * (time.perf_counter() - t))
        med = statistics.median
        print("RESULT", json.dumps({"latency_direct_ms_p50": round(med(direct), 2),
                                    "latency_routed_ms_p50": round(med(routed), 2),
                                    "router_added_ms_p50": round(med(routed) - med(direct), 2),
                                    "router_added_ms_mean": round(statistics.mean(routed) - statistics.mean(direct), 2),
                                    "n": args.n}))


if __name__ == "__main__":
    main()
