"""Goodput (issue 54 item 5): the highest interactive arrival rate at which >= 99 % of interactive requests
meet both their TTFT and ITL targets (each request's first token within --ttft-ms, its longest inter-token gap
within --itl-ms), while a batch class floods the engine — with traffic classes, with priorities only, and with
neither (every request priority 0, first come first served). The papers' metric (DistServe, Sarathi-Serve):
throughput that counts only requests served within their targets.

Simulator side (`pagedserve simulate`'s engine: the real scheduler on this host's fitted step-time model, or a
named roofline profile): the batch flood is a backlog of --batch-prompt-token prompts (--batch-out out, priority
10) all waiting at t = 0, 1.5x what the batch class alone drains in the window; interactive requests (24-80-token prompts,
--inter-out out, priority 0) arrive as a Poisson process; the rate is bisected in log space. Also printed: the
batch class's output tokens per second over the run at the goodput rate, against the batch class alone.

  python bench/goodput.py [--model FILE] [--hardware calibrated|cpu|a10g|h100|...] [--itl-ms 150]
      [--ttft-ms 1000] [--batch-prompt 1500] [--batch-out 256] [--window 60] [--min-inter 30] [--inter-out 64]
      [--max-num-batched-tokens 1024] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys

from pagedserve.config import EngineArgs
from pagedserve.sim.simulator import SimRequest, max_rate_meeting, simulate

MODES = ("classes", "priorities", "none")


def batch_prompt(rng, a) -> SimRequest:
    return SimRequest(0.0, tuple(rng.randrange(17, 30000) for _ in range(a.batch_prompt)), a.batch_out, 1, 10)


def capacity(a, shape, cost, blocks: int, max_len: int) -> float:
    """The batch class's requests per second alone (a backlog of 2 x max_num_seqs prompts run to the end)."""
    rng = random.Random(a.seed)
    reqs = [batch_prompt(rng, a) for _ in range(2 * a.max_num_seqs)]
    res = simulate(reqs, shape, cost, engine_args("none", a), blocks, max_len)
    return len(reqs) / res.duration_s


def workload(rate: float, a, cap: float, priorities: bool) -> list[SimRequest]:
    """The flood: 2 x max_num_seqs batch prompts waiting at t = 0, then more arriving as a Poisson process at
    1.2x what the batch class alone drains (`cap` req/s) until the window's end (its queue only grows); and
    rate x --window interactive requests arriving as a Poisson process from t = 0.5 s (--warmup where given)."""
    rng = random.Random(a.seed)
    batch, t = [batch_prompt(rng, a) for _ in range(2 * a.max_num_seqs)], 0.0
    while t < a.window + getattr(a, "warmup", 0.5):
        t += rng.expovariate(1.2 * cap)
        batch.append(SimRequest(t, batch_prompt(rng, a).prompt_token_ids, a.batch_out, 1, 10))
    if not priorities:
        batch = [SimRequest(r.arrival_s, r.prompt_token_ids, r.output_len, 1, 0) for r in batch]
    t, inter = getattr(a, "warmup", 0.5), []
    for _ in range(round(rate * a.window)):
        inter.append(SimRequest(t, tuple(rng.randrange(17, 30000) for _ in range(rng.randint(24, 80))),
                                a.inter_out, 1, 0))
        t += rng.expovariate(rate)
    return batch + inter


def engine_args(mode: str, a) -> EngineArgs:
    classes = [{"name": "interactive", "priority": 0, "itl_p99_ms": a.itl_ms, "ttft_p99_ms": a.ttft_ms},
               {"name": "batch", "priority": 10}] if mode == "classes" else None
    return EngineArgs(model=a.model, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                      traffic_classes=classes)


def run(mode: str, rate: float, a, cap: float, shape, cost, blocks: int, max_len: int) -> dict:
    reqs = workload(rate, a, cap, priorities=mode != "none")
    backlog = len(reqs) - round(rate * a.window)
    inter = frozenset(range(backlog, len(reqs)))
    res = simulate(reqs, shape, cost, engine_args(mode, a), blocks, max_len, watch=inter)
    met = res.attainment(a.ttft_ms, a.itl_ms, inter)
    batch_tokens = res.output_tokens - sum(reqs[i].output_len for i, *_ in res.finished if i in inter)
    return {"rate": round(rate, 4), "miss": 1.0 - met, "attainment": round(met, 4), "interactive": len(inter),
            "interactive_done": sum(i in inter for i, *_ in res.finished),
            "flood_outlasted_window": sum(i not in inter for i, *_ in res.finished) < backlog,
            "batch_out_tok_s": round(batch_tokens / res.duration_s, 2), "steps": res.steps,
            "sim_s": round(res.duration_s, 2)}


def resolve(a):
    """The model shape, cost model, KV blocks and max_model_len, as `pagedserve simulate` resolves them."""
    from pagedserve.sim.cli import add_simulate_flags, resolve as sim_resolve
    ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(ap)
    add_simulate_flags(ap)
    argv = ["--hardware", a.hardware, "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--max-num-seqs", str(a.max_num_seqs)] + ([] if a.model is None else ["--model", a.model]) + \
        ([] if getattr(a, "max_model_len", None) is None else ["--max-model-len", str(a.max_model_len)])
    shape, cost, _, blocks, max_len = sim_resolve(ap.parse_args(argv))
    return shape, cost, blocks, max_len


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--hardware", default="calibrated")
    ap.add_argument("--itl-ms", type=float, default=150.0)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--batch-prompt", type=int, default=1500)
    ap.add_argument("--batch-out", type=int, default=256)
    ap.add_argument("--window", type=float, default=60.0, help="simulated seconds of interactive arrivals")
    ap.add_argument("--min-inter", type=int, default=30, help="the search starts at the rate giving this many")
    ap.add_argument("--inter-out", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from pagedserve.host import describe
    shape, cost, blocks, max_len = resolve(a)
    print(f"host: {describe()}; cost: {type(cost).__name__} ({a.hardware}); KV pool {blocks} blocks")
    cap = capacity(a, shape, cost, blocks, max_len)
    lo = a.min_inter / a.window
    print(f"targets: TTFT <= {a.ttft_ms:g} ms and longest gap <= {a.itl_ms:g} ms for >= 99 % of the interactive "
          f"requests (rate x {a.window:g} s; rates from {lo:g}/s); flood: {a.batch_prompt}-token prompts -> "
          f"{a.batch_out}, {2 * a.max_num_seqs} waiting at t = 0 and 1.2x the batch class's own rate arriving "
          f"(alone it runs {cap:.2f} a second: {cap * a.batch_out:.1f} out tok/s)")
    report = {}
    for mode in MODES:
        curve = []

        def at(rate, mode=mode, curve=curve):
            curve.append(run(mode, rate, a, cap, shape, cost, blocks, max_len))
            return curve[-1]
        rate, best = max_rate_meeting({"miss": 0.01}, at, lo=lo, hi=4 * lo, iters=6, cap=64.0)
        report[mode] = {"batch_alone_out_tok_s": round(cap * a.batch_out, 2), "goodput_req_s": round(rate, 3), "at_goodput": best,
                        "curve": sorted(curve, key=lambda r: r["rate"])}
        capped = " (the search's cap: at least this)" if rate >= 64.0 else f" (below {lo:g}: none tried)" \
            if rate == 0 else ""
        print(f"{mode:11} goodput {rate:7.3f} interactive req/s{capped}; there: attainment {best['attainment']:.3f}, "
              f"batch {best['batch_out_tok_s']} out tok/s ({best['batch_out_tok_s'] / (cap * a.batch_out):.0%} of alone), "
              f"flood outlasted the window: {best['flood_outlasted_window']}", flush=True)
    base = report["none"]["goodput_req_s"]
    for mode in ("classes", "priorities"):
        g = report[mode]["goodput_req_s"]
        print(f"{mode} / none: {g / base:.2f}x" if base else f"{mode}: {g} req/s (none: 0)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "report": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
