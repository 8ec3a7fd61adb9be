"""One stream, offline against served (issue 23 item 4): the offline per-token time of `LLM.generate` and the
inter-token latency of the same requests streamed from `pagedserve serve` by a light client (httpx, one
process), in one run, alternating; plus the server's CPU per token by thread (the engine's main thread, the
OpenMP worker, the HTTP thread), to show where served time goes. A heavier client (guidellm:
bench/guidellm_side_by_side.py) competes with the engine for the same cores; this one measures the server.

Requests: 256 random prompt tokens, 128 out (ignore_eos, greedy), as guidellm's one-stream run.
Per-token time = (last token time - first token time) / (tokens - 1) per request; medians over requests.

Usage: python bench/served_itl.py [--requests 8] [--rounds 2] [--serve-args "..."] [--json OUT]
       (--serve-args --no-engine-process: the engine core in the server's process; by default its own)
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server_proc import process_tree, serve  # noqa: E402

PROMPT_TOKENS, OUT_TOKENS = 256, 128


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def offline(n: int, seed: int) -> list[float]:
    """Per-token ms of each request through LLM.generate (run in a child: its own process, like the server)."""
    from pagedserve import LLM, SamplingParams
    llm = LLM(num_kv_blocks=256)
    sp = SamplingParams(max_tokens=OUT_TOKENS, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts(1, seed + 1)[0]}], sp, use_tqdm=False)       # warm-up
    out = []
    for ids in prompts(n, seed):
        o = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        m, k = o.metrics, len(o.outputs[0].token_ids)
        out.append((m.last_token_time - m.first_token_time) / (k - 1) * 1e3)
    return out


def thread_cpu(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds of every thread of pid's process tree, by (process, thread)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[(p, int(tid))] = (int(fields[11]) + int(fields[12])) / tick
    return out


def served(n: int, seed: int, serve_args: list[str]) -> dict:
    srv, base = serve(serve_args)
    try:
        def one(ids):
            times = []
            body = {"prompt": ids, "max_tokens": OUT_TOKENS, "stream": True, "ignore_eos": True,
                    "temperature": 0}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        times.append(time.perf_counter())
            return times
        one(prompts(1, seed + 1)[0])                                    # warm-up
        c0, client0 = thread_cpu(srv.pid), time.process_time()
        per, gaps, ntok = [], [], 0
        for ids in prompts(n, seed):
            ts = one(ids)
            ntok += len(ts)
            per.append((ts[-1] - ts[0]) / (len(ts) - 1) * 1e3)
            gaps += [(b - a) * 1e3 for a, b in zip(ts, ts[1:])]
        c1, client = thread_cpu(srv.pid), time.process_time() - client0
    finally:
        srv.terminate()
        srv.wait()
    ms = {t: (c1[t] - c0.get(t, 0.0)) / ntok * 1e3 for t in c1}
    front = (srv.pid, srv.pid)
    cores = [t for t in ms if t[0] == t[1] and t != front]          # the engine core's process: its main thread
    named = {"server main thread": round(ms.get(front, 0.0), 3)}
    if cores:
        named["engine core process's main thread"] = round(sum(ms[t] for t in cores), 3)
    others = sorted((v for t, v in ms.items() if t != front and t not in cores and v > 0.01), reverse=True)
    return {"per_token_ms": per, "itl_p50_ms": statistics.median(gaps), "itl_p99_ms": sorted(gaps)[int(0.99 * len(gaps))],
            "cpu_ms_per_token": {**named, "other threads (OpenMP worker, HTTP, ...)": [round(x, 3) for x in others]},
            "client_cpu_ms_per_token": round(client / ntok * 1e3, 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(offline(a.requests, a.seed)))
        return
    from pagedserve.host import describe
    print(f"host: {describe()}")
    rounds = []
    for r in range(a.rounds):
        p = subprocess.run([sys.executable, __file__, "--child", "--requests", str(a.requests), "--seed", str(a.seed)],
                           capture_output=True, text=True, check=True)
        off = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        srv = served(a.requests, a.seed, a.serve_args.split())
        o, s = statistics.median(off), statistics.median(srv["per_token_ms"])
        rounds.append({"offline_per_token_ms": o, "served_per_token_ms": s, "served_itl_p50_ms": srv["itl_p50_ms"],
                       "served_itl_p99_ms": srv["itl_p99_ms"], "ratio_itl_p50": srv["itl_p50_ms"] / o,
                       "cpu": srv["cpu_ms_per_token"], "client_cpu_ms_per_token": srv["client_cpu_ms_per_token"]})
        print(f"round {r + 1}: offline {o:.2f} ms/token; served {s:.2f} ms/token, ITL p50 {srv['itl_p50_ms']:.2f} "
              f"(x{srv['itl_p50_ms'] / o:.2f} offline), p99 {srv['itl_p99_ms']:.2f}; server CPU per token "
              f"{srv['cpu_ms_per_token']}; client {srv['client_cpu_ms_per_token']} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
