"""Goodput through the server (issue 54 item 5), beside the simulator's on the same workload: the highest
interactive arrival rate at which >= 99 % of interactive requests meet both targets (first token within
--ttft-ms, longest inter-token gap within --itl-ms) while a batch class floods the engine — with traffic
classes, with priorities only, and with neither (every request priority 0, first come first served).

The workload is goodput.py's, request for request (its `workload(rate)`: a backlog of 2 x max_num_seqs
--batch-prompt-token prompts at t = 0, more arriving at 1.2x the batch class's own rate, and Poisson
interactive arrivals of 24-80-token prompts from t = --warmup s), replayed open-loop against `pagedserve serve`
(one server a mode, the same flags as the simulator's engine) with `ignore_eos` so every request's length is
the workload's. Each interactive request is streamed and timed at the client; one that has not finished by the
time the last one would have at its targets (+ --grace s) is a miss (then every request is cut, and the server
drained before the next rate). The simulator runs the same requests on this host's fitted step-time model
(`--hardware calibrated`). --trace keeps the server's step records (/debug/state) beside each request's longest
gap, both on the host's monotonic clock: which step made it.

The rate is bisected in log space as in goodput.py (fewer steps: --iters). Per mode: served and simulated
goodput, attainment there, and the batch class's output tokens per second over the window.

  python bench/goodput_served.py [--model FILE] [--itl-ms 300] [--ttft-ms 1000] [--window 30] [--iters 3]
      [--max-num-seqs 64] [--modes classes,priorities,none] [--no-sim] [--trace] [--serve-args "..."]
      [--json bench/results/goodput_served.json]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import goodput  # noqa: E402
from server_proc import serve, stop  # noqa: E402
from serving import pct  # noqa: E402

from pagedserve.sim.simulator import max_rate_meeting  # noqa: E402


def metric(base: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.split()[-1])
    return total


def drain(base: str, timeout_s: float = 120.0) -> None:
    """Wait until the server holds no request (the cut ones aborted)."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if metric(base, "pagedserve:num_requests_running") + metric(base, "pagedserve:num_requests_waiting") == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{base}: requests still held {timeout_s} s after the run was cut")


async def interactive(client, base, body, ttft_ms, itl_ms) -> dict:
    t0, first, last, worst, worst_at, n = time.perf_counter(), None, None, 0.0, None, 0
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if not (obj.get("choices") and obj["choices"][0].get("text")):
                continue
            now = time.perf_counter()
            if first is None:
                first = now - t0
            elif now - last > worst:
                worst, worst_at = now - last, time.monotonic()
            last, n = now, n + 1
    return {"ttft_ms": 1e3 * first, "worst_gap_ms": 1e3 * worst, "tokens": n,
            "met": 1e3 * first <= ttft_ms and 1e3 * worst <= itl_ms,
            "worst_gap_end": round(worst_at, 3) if worst else None}     # the host's monotonic clock, as the server's


async def batch(client, base, body) -> None:
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for _ in r.aiter_lines():
            pass


async def replay(base: str, mode: str, reqs, inter: frozenset, a) -> dict:
    """Send each request at its arrival time; cut everything --grace s after the window."""
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        out, tasks = {}, []
        gen0, t0 = metric(base, "pagedserve:generation_tokens_total"), time.perf_counter()

        async def send(i, r):
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            body = {"prompt": list(r.prompt_token_ids), "max_tokens": r.output_len, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            if mode == "classes":
                body["traffic_class"] = "interactive" if i in inter else "batch"
            else:
                body["priority"] = r.priority
            if i in inter:
                out[i] = await interactive(client, base, body, a.ttft_ms, a.itl_ms)
                out[i]["arrival_s"] = round(r.arrival_s, 2)
            else:
                await batch(client, base, body)
        for i, r in enumerate(reqs):
            tasks.append(asyncio.create_task(send(i, r)))
        steps: dict[int, dict] = {}

        async def trace():                            # the server's step records (/debug/state keeps its last 300)
            while True:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    for st in (await client.get(base + "/debug/state", timeout=30)).json().get("steps", []):
                        steps[st["step"]] = st
                await asyncio.sleep(10.0)
        tracer = asyncio.create_task(trace()) if a.trace else None
        last_inter = max(reqs[i].arrival_s for i in inter)
        # the last request's whole stream at its targets (first token, then every gap at the ITL target), + grace
        deadline = t0 + last_inter + a.ttft_ms / 1e3 + a.inter_out * a.itl_ms / 1e3 + a.grace
        pending = [tasks[i] for i in inter]
        while pending and time.perf_counter() < deadline:
            done, _ = await asyncio.wait(pending, timeout=max(0.05, deadline - time.perf_counter()))
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            pending = [t for t in pending if not t.done()]
        wall = time.perf_counter() - t0
        gen = metric(base, "pagedserve:generation_tokens_total") - gen0
        if tracer is not None:
            tracer.cancel()
            tasks.append(tracer)
        for t in tasks:
            t.cancel()
        errors = [repr(e) for e in await asyncio.gather(*tasks, return_exceptions=True)
                  if isinstance(e, Exception) and not isinstance(e, asyncio.CancelledError)]
    met = sum(out[i]["met"] for i in out)             # an unfinished interactive request is a miss
    inter_tokens = sum(out[i]["tokens"] for i in out)
    return {"rate": None, "miss": 1.0 - met / len(inter), "attainment": round(met / len(inter), 4),
            "interactive": len(inter), "interactive_done": len(out),
            "ttft_p99_ms": p99([o["ttft_ms"] for o in out.values()]),
            "worst_gap_p99_ms": p99([o["worst_gap_ms"] for o in out.values()]),
            "batch_out_tok_s": round((gen - inter_tokens) / wall, 2), "wall_s": round(wall, 1),
            "errors": errors[:3], "num_errors": len(errors),
            "requests": [{k: round(v, 1) if isinstance(v, float) and k != "worst_gap_end" else v
                          for k, v in out[i].items()} for i in sorted(out)],
            **({"steps": [steps[k] for k in sorted(steps)]} if a.trace else {})}


def p99(xs: list[float]) -> float | None:
    return None if not xs else round(pct(xs, 99), 1)


def serve_flags(mode: str, a) -> list[str]:
    flags = ["--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
             "--max-model-len", str(a.max_model_len)] + ([] if a.model is None else ["--model", a.model])
    flags += shlex.split(a.serve_args)
    ea = goodput.engine_args(mode, a)
    if ea.traffic_classes is not None:
        flags += ["--traffic-classes", json.dumps(ea.traffic_classes)]
    return flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--hardware", default="calibrated", help="the simulator's cost model (goodput.py's)")
    ap.add_argument("--itl-ms", type=float, default=300.0)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--batch-prompt", type=int, default=1500)
    ap.add_argument("--batch-out", type=int, default=256)
    ap.add_argument("--window", type=float, default=30.0, help="seconds of interactive arrivals")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds the flood runs before the first interactive arrival (both sides)")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="seconds past the last interactive arrival + TTFT target + inter-out x ITL target")
    ap.add_argument("--min-inter", type=int, default=15, help="the search starts at the rate giving this many")
    ap.add_argument("--inter-out", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--modes", default=",".join(goodput.MODES))
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--serve-args", default="", help="more `pagedserve serve` flags (e.g. --num-threads 1)")
    ap.add_argument("--trace", action="store_true", help="keep the server's step records (/debug/state) in the JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "goodput_served.json"))
    a = ap.parse_args()
    from pagedserve.host import describe
    shape, cost, blocks, max_len = goodput.resolve(a)
    cap = goodput.capacity(a, shape, cost, blocks, max_len)
    lo = a.min_inter / a.window
    print(f"host: {describe()}; targets TTFT <= {a.ttft_ms:g} ms, longest gap <= {a.itl_ms:g} ms for >= 99 % of the "
          f"interactive requests; flood {a.batch_prompt} -> {a.batch_out} tokens, the batch class alone "
          f"{cap:.2f} req/s by the simulator's model; window {a.window:g} s, rates from {lo:g}/s", flush=True)
    report = {}
    for mode in a.modes.split(","):
        row = {}
        if not a.no_sim:
            curve = []

            def at_sim(rate, mode=mode, curve=curve):
                curve.append(goodput.run(mode, rate, a, cap, shape, cost, blocks, max_len))
                return curve[-1]
            rate, best = max_rate_meeting({"miss": 0.01}, at_sim, lo=lo, hi=2 * lo, iters=a.iters, cap=64.0)
            row["simulated"] = {"goodput_req_s": round(rate, 3), "at_goodput": best,
                                "curve": sorted(curve, key=lambda r: r["rate"])}
            print(f"{mode:11} simulated goodput {rate:.3f} req/s (attainment there {best['attainment']})", flush=True)
        srv, base = serve(serve_flags(mode, a))
        try:
            with httpx.Client(timeout=300) as c:           # warm-up: the first forward passes are slower
                c.post(base + "/v1/completions", json={"prompt": list(range(300, 500)), "max_tokens": 8})
            curve = []

            def at_served(rate, mode=mode, curve=curve):
                reqs = goodput.workload(rate, a, cap, priorities=mode != "none")
                inter = frozenset(range(len(reqs) - round(rate * a.window), len(reqs)))
                r = asyncio.run(replay(base, mode, reqs, inter, a))
                r["rate"] = round(rate, 4)
                drain(base)
                curve.append(r)
                print(f"  {mode} served at {rate:.3f}/s: {json.dumps({k: v for k, v in r.items() if k != 'requests'})}",
                      flush=True)
                return r
            rate, best = max_rate_meeting({"miss": 0.01}, at_served, lo=lo, hi=2 * lo, iters=a.iters, cap=64.0)
        finally:
            stop(srv)
        row["served"] = {"goodput_req_s": round(rate, 3), "at_goodput": best,
                         "curve": sorted(curve, key=lambda r: r["rate"])}
        print(f"{mode:11} served goodput {rate:.3f} req/s (attainment there {best['attainment']}, batch "
              f"{best['batch_out_tok_s']} out tok/s)", flush=True)
        report[mode] = row
    print("| mode | served goodput (req/s) | attainment there | batch out tok/s there | simulated goodput |")
    print("|---|---|---|---|---|")
    for mode, row in report.items():
        s = row["served"]
        at = s["at_goodput"]
        print(f"| {mode} | {s['goodput_req_s']} | {at['attainment']} | {at['batch_out_tok_s']} "
              f"| {row['simulated']['goodput_req_s'] if 'simulated' in row else '-'} |")
    if a.json:
        os.makedirs(os.path.dirname(a.json), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "host": describe(), "report": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
