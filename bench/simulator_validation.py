"""Validate `pagedserve simulate` against the real engine on this machine, in one run:
1. calibrate the cost model on a calibration workload (not the ones below);
2. mixed64 offline: measured output tok/s (bench/throughput.py's run) vs simulated;
3. the serving benchmark (mixed16, streaming, Poisson arrivals, prefix caching off) at 3 rates:
   measured TTFT p50 / ITL p50 (bench/serving.py's run) vs simulated on the same arrival times;
4. a projection: Llama-3-8B bf16 on the h100 profile, a ShareGPT-like mix, vLLM-like limits.

Usage: python bench/simulator_validation.py [--rates 0.25,0.5,1] [--out bench/results/simulator]
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
from serving import run_rate  # noqa: E402
from throughput import load_workload, run_ours  # noqa: E402

from pagedserve.config import EngineArgs  # noqa: E402
from pagedserve.sim.calibrate import calibrate, calibration_workload, fit_trace, host_key, shape_of_engine  # noqa: E402
from pagedserve.sim.cost_model import MODELS, PROFILES, RooflineCost  # noqa: E402
from pagedserve.sim.simulator import SimRequest, poisson_workload, simulate, with_arrivals  # noqa: E402


def as_sim(reqs, cap=None):
    return [SimRequest(0.0, tuple(r["prompt_token_ids"]), min(cap or r["max_tokens"], r["max_tokens"])) for r in reqs]


async def one(client, base, req, max_tokens):
    """One streamed request; ITL per token (a chunk carrying k tokens, per its logprobs, counts as k
    gaps of 1/k each), which is what the simulator reports."""
    t0 = time.perf_counter()
    ttft, last, itl = None, None, []
    body = {"prompt": req["prompt_token_ids"], "max_tokens": min(max_tokens, req["max_tokens"]), "stream": True,
            "ignore_eos": True, "temperature": 0, "logprobs": 0}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"]
            k = len(ch[0]["logprobs"]["tokens"]) if ch and ch[0].get("logprobs") else 0
            if not k:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft, k = now - t0, k - 1
            elif k:
                itl.extend([(now - last) / k] * k)
            last = now
    return {"ttft": ttft, "itl": itl, "e2e": time.perf_counter() - t0, "tokens": body["max_tokens"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="0.25,0.5,1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "simulator"))
    a = ap.parse_args()
    report = {"host": host_key(), "date": time.strftime("%Y-%m-%d")}

    # 1. calibration (fresh)
    args = EngineArgs(num_kv_blocks=4096)
    t = time.perf_counter()
    cost = calibrate(args, use_cache=False)
    report["calibration"] = {"coef": cost.coef, "rel_error_p50": round(cost.rel_error_p50, 4),
                             "seconds": round(time.perf_counter() - t, 1)}
    from pagedserve.engine.llm_engine import LLMEngine
    shape = shape_of_engine(LLMEngine(args).core)

    # 2. mixed64 offline
    reqs64 = load_workload("mixed64")
    ns = argparse.Namespace(num_kv_blocks=4096, block_size=16, max_num_batched_tokens=1024, max_num_seqs=64, chunk=256)
    real = run_ours(reqs64, ns)
    sim = simulate(as_sim(reqs64), shape, cost, args, 4096).summary()
    report["mixed64"] = {"measured_output_tok_s": real["output_tok_s"], "simulated_output_tok_s": sim["output_tok_s"],
                         "error": round(sim["output_tok_s"] / real["output_tok_s"] - 1, 4)}
    print(json.dumps(report["mixed64"]), flush=True)

    # 3. serving at 3 rates (same requests, same arrival draws as bench/serving.py), predicted by a fit
    #    to a step trace of the server running the calibration waves (serving adds the HTTP thread)
    trace = a.out + "-trace.jsonl"
    if os.path.exists(trace):
        os.remove(trace)
    srv, base = serve(["--num-kv-blocks", "4096", "--no-enable-prefix-caching", "--step-trace", trace])
    try:
        async def wave(reqs):
            async with httpx.AsyncClient(timeout=600) as c:
                await asyncio.gather(*(one(c, base, {"prompt_token_ids": list(r.prompt_token_ids),
                                                     "max_tokens": r.output_len}, r.output_len) for r in reqs))
        for w in calibration_workload():
            asyncio.run(wave(w))
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    served_cost = fit_trace(trace, shape)
    report["served_calibration"] = {"coef": served_cost.coef, "rel_error_p50": round(served_cost.rel_error_p50, 4)}
    reqs16 = load_workload("mixed16")
    srv_args = EngineArgs(num_kv_blocks=4096, enable_prefix_caching=False)
    srv, base = serve(["--num-kv-blocks", "4096", "--no-enable-prefix-caching"])
    rows = []
    try:
        with httpx.Client(timeout=120) as c:
            c.post(base + "/v1/completions", json={"prompt": reqs16[0]["prompt_token_ids"], "max_tokens": 4})
        for i, rate in enumerate(float(x) for x in a.rates.split(",")):
            m = asyncio.run(run_rate(base, reqs16, rate, a.max_tokens, seed=i, request=one))
            s = simulate(with_arrivals(as_sim(reqs16, a.max_tokens), rate, seed=i), shape, served_cost, srv_args,
                         4096).summary()
            row = {"rate": rate, "ttft_p50_ms": (m["ttft_p50_ms"], s["ttft_p50_ms"]),
                   "itl_p50_ms": (m["itl_p50_ms"], s["itl_p50_ms"]),
                   "output_tok_s": (m["output_tok_s"], s["output_tok_s"])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    report["serving"] = rows

    # 4. projection
    base8 = MODELS["llama-3-8b"]
    proj_args = EngineArgs(max_num_seqs=256, max_num_batched_tokens=8192, long_prefill_token_threshold=8192,
                           enable_prefix_caching=False)
    h100 = RooflineCost(base8, PROFILES["h100"])
    blocks = int(40 * 2**30 // (base8.kv_bytes_per_token * 16))          # ~40 GiB of KV after 16 GB of weights
    wl = poisson_workload(1e9, 1000, seed=0)
    res = simulate(with_arrivals(wl, None), base8, h100, proj_args, blocks).summary()
    report["projection"] = {"model": "llama-3-8b bf16", "hardware": "h100 profile", "kv_blocks": blocks,
                            "offline_1000_requests": res}
    print(json.dumps(report["projection"]), flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print("| rate | TTFT p50 measured / simulated ms | ITL p50 measured / simulated ms | output tok/s measured / simulated |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']} | {r['ttft_p50_ms'][0]} / {r['ttft_p50_ms'][1]} | {r['itl_p50_ms'][0]} / "
              f"{r['itl_p50_ms'][1]} | {r['output_tok_s'][0]} / {r['output_tok_s'][1]} |")


if __name__ == "__main__":
    main()
