"""What the open dashboard costs the engine: mixed64 (../shared/bench/workload.py) sent at once over
HTTP to one `pagedserve serve` (a child process), alternately with nobody watching and with a
dashboard client reading /debug/state/stream at --fps frames per second (what /dashboard does),
--rounds times each, in one run. Reports the wall time of each run, the engine's mean step time
(from /metrics) and the ratio watched / unwatched.

Usage: python bench/dashboard_overhead.py [--rounds 2] [--fps 4] [--dtype auto]
"""
import argparse
import asyncio
import json
import os
import sys
import threading
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def send_all(base: str, reqs: list[dict]) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=httpx.Limits(max_connections=80)) as c:
        t = time.perf_counter()
        rs = await asyncio.gather(*(c.post("/v1/completions", json={
            "prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"], "ignore_eos": True, "temperature": 0})
            for r in reqs))
        wall = time.perf_counter() - t
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return wall


def watcher(base: str, fps: float, stop: threading.Event, frames: list) -> None:
    with httpx.stream("GET", base + f"/debug/state/stream?fps={fps}", timeout=None) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(len(line))
            if stop.is_set():
                return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fps", type=float, default=4.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", default="mixed64")
    args = ap.parse_args()
    from bench.server_proc import serve
    from bench.throughput import load_workload
    from pagedserve.host import describe
    print("host:", describe())
    reqs = load_workload(args.workload)
    srv, base = serve(["--dtype", args.dtype, "--num-kv-blocks", "2048", "--max-num-seqs", "64",
                       "--no-enable-prefix-caching"])
    try:
        asyncio.run(send_all(base, reqs[:4]))            # warm-up
        rows = []
        for k in range(2 * args.rounds):
            watched = k % 2 == 1
            stop, frames = threading.Event(), []
            th = threading.Thread(target=watcher, args=(base, args.fps, stop, frames), daemon=True) if watched else None
            if th:
                th.start()
                time.sleep(0.5)
            s0, n0 = metric(base, "pagedserve:iteration_seconds_sum"), metric(base, "pagedserve:iteration_seconds_count")
            wall = asyncio.run(send_all(base, reqs))
            s1, n1 = metric(base, "pagedserve:iteration_seconds_sum"), metric(base, "pagedserve:iteration_seconds_count")
            stop.set()
            row = {"watched": watched, "wall_s": round(wall, 2), "steps": int(n1 - n0),
                   "mean_step_ms": round(1e3 * (s1 - s0) / max(1, n1 - n0), 2), "frames": len(frames),
                   "frame_kb": round(sum(frames) / max(1, len(frames)) / 1024, 1)}
            rows.append(row)
            print("RESULT", json.dumps(row), flush=True)
        off = [r for r in rows if not r["watched"]]
        on = [r for r in rows if r["watched"]]
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)          # noqa: E731
        print(f"wall watched / unwatched: {mean(on, 'wall_s') / mean(off, 'wall_s'):.4f}; "
              f"mean step watched / unwatched: {mean(on, 'mean_step_ms') / mean(off, 'mean_step_ms'):.4f}")
    finally:
        srv.terminate()
        srv.wait(timeout=60)


if __name__ == "__main__":
    main()
