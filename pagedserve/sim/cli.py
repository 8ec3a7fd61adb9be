"""`pagedserve simulate`: how many requests per second at a latency target, with this model, on
this hardware, with this much KV memory? Runs the real scheduler on a cost model."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

from pagedserve.config import EngineArgs, parse_bytes
from pagedserve.kv_plan import SCALE_BYTES
from pagedserve.sim.cost_model import MODELS, PROFILES, ModelShape, RooflineCost
from pagedserve.sim.simulator import (SimRequest, max_rate_meeting, num_blocks_for, parse_slo, poisson_workload,
                                      simulate, with_arrivals)

DTYPE_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0, "int8": 1.0,
               "q4": 0.5625}
SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def add_simulate_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("simulation")
    g.add_argument("--model-shape", default=None, help=f"a named shape instead of --model: {', '.join(MODELS)}")
    for name in SHAPE_FLAGS:
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help="model shape (as kv-plan takes); overrides --model / --model-shape")
    g.add_argument("--weight-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="bytes per weight (default: fp32 for cpu and calibrated, bf16 on GPUs)")
    g.add_argument("--kv-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="default: --kv-cache-dtype if set, else as --weight-dtype")
    g.add_argument("--hardware", default="cpu", help=f"{', '.join(PROFILES)} or calibrated (this machine, measured)")
    g.add_argument("--calibrate", action="store_true", help="measure this machine now (else a cached fit is used)")
    g.add_argument("--calibrate-from", default=None, help="fit to a step trace of `pagedserve serve --step-trace`")
    g.add_argument("--workload", default=None, help="JSONL of {prompt_token_ids | prompt_len, max_tokens[, arrival_s, "
                                                    "priority, traffic_class]}")
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals (req/s); none: all arrive at once")
    g.add_argument("--num-requests", type=int, default=200, help="for the synthetic workload")
    g.add_argument("--input-len", type=int, default=150, help="median prompt length of the synthetic (lognormal) mix")
    g.add_argument("--output-len", type=int, default=150, help="median output length of the synthetic mix")
    g.add_argument("--slo", default=None, help='e.g. "ttft_p99<2s,itl_p99<100ms": find the highest rate meeting it')
    g.add_argument("--sim-seed", type=int, default=0)
    g.add_argument("--plot", default=None, help="PNG: KV usage over time (and latency against rate with --slo)")
    g.add_argument("--json", action="store_true")


def load_jsonl(path: str) -> list[SimRequest]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                ids = d.get("prompt_token_ids") or list(range(17, 17 + int(d["prompt_len"])))
                out.append(SimRequest(float(d.get("arrival_s", 0.0)), tuple(ids), int(d["max_tokens"]), int(d.get("n", 1)),
                                      int(d.get("priority", 0)), d.get("traffic_class")))
    return out


def resolve(ns) -> tuple[ModelShape, object, EngineArgs, int, int]:
    """The model shape, the cost model, engine args, KV blocks and max_model_len from the flags."""
    args = EngineArgs.from_cli_args(ns)
    gpu = ns.hardware in PROFILES and ns.hardware != "cpu"
    wdt = DTYPE_BYTES[ns.weight_dtype or ("bf16" if gpu else "fp32")]
    kv_name = ns.kv_dtype or (args.kv_cache_dtype if args.kv_cache_dtype != "auto" else None)
    kdt = DTYPE_BYTES[kv_name] if kv_name else wdt
    given = {k: getattr(ns, k) for k in SHAPE_FLAGS if getattr(ns, k) is not None}
    if ns.model_shape or (given and ns.model is None):
        if ns.model_shape and ns.model_shape not in MODELS:
            raise ValueError(f"--model-shape must be one of {sorted(MODELS)}, got {ns.model_shape!r}")
        base = MODELS.get(ns.model_shape)
        missing = [f"--{k.replace('_', '-')}" for k in SHAPE_FLAGS if k not in given and base is None]
        if missing:
            raise ValueError(f"simulate needs --model, --model-shape or all shape flags (missing {', '.join(missing)})")
        dims = {k: given.get(k, getattr(base, k, None)) for k in SHAPE_FLAGS}
        shape = ModelShape(**dims, weight_bytes_per_param=wdt, kv_bytes_per_value=kdt)
        max_len = args.max_model_len or 8192
    else:
        from pagedserve.model.loader import read_model_config, resolve_model
        cfg = read_model_config(resolve_model(args.model))
        shape = ModelShape.from_model_config(cfg, wdt, kdt)
        if given:
            shape = ModelShape(**{k: given.get(k, getattr(shape, k)) for k in SHAPE_FLAGS},
                               weight_bytes_per_param=wdt, kv_bytes_per_value=kdt)
        max_len = min(args.max_model_len or min(cfg.max_position_embeddings, 8192), cfg.max_position_embeddings)
    if kv_name in SCALE_BYTES:       # int8 K/V carry a float32 scale per token and head
        shape = dataclasses.replace(shape, kv_bytes_per_value=kdt + SCALE_BYTES[kv_name] / shape.head_dim)
    if ns.calibrate_from:
        from pagedserve.sim.calibrate import fit_trace
        cost = fit_trace(ns.calibrate_from, shape)
    elif ns.calibrate or ns.hardware == "calibrated":
        from pagedserve.sim.calibrate import calibrate
        cost = calibrate(args, use_cache=not ns.calibrate)
    elif ns.hardware in PROFILES:
        cost = RooflineCost(shape, PROFILES[ns.hardware])
    else:
        raise ValueError(f"--hardware must be one of {sorted(PROFILES) + ['calibrated']}, got {ns.hardware!r}")
    if args.num_kv_blocks:
        blocks = args.num_kv_blocks
    else:
        blocks = num_blocks_for(parse_bytes(args.kv_cache_memory or "4GiB", "kv_cache_memory"), shape, args.block_size)
    return shape, cost, args, blocks, max_len


def run_simulate(ns) -> int:
    shape, cost, args, blocks, max_len = resolve(ns)
    if ns.workload:
        reqs = load_jsonl(ns.workload)
        if ns.rate is not None:
            reqs = with_arrivals(reqs, ns.rate, ns.sim_seed)
    else:
        reqs = poisson_workload(ns.rate or 1e9, ns.num_requests, ns.sim_seed,
                                (math.log(ns.input_len), 1.0, 4, max_len // 2), (math.log(ns.output_len), 0.8, 4, max_len // 2))
        if ns.rate is None:
            reqs = with_arrivals(reqs, None)

    def at_rate(rate):
        rs = with_arrivals(reqs, rate, ns.sim_seed)
        return simulate(rs, shape, cost, args, blocks, max_len).summary()

    report = {"kv_blocks": blocks, "block_size": args.block_size, "weight_bytes": shape.weight_bytes}
    res = simulate(reqs, shape, cost, args, blocks, max_len)
    report["result"] = res.summary()
    curve = []
    if ns.slo:
        slo = parse_slo(ns.slo)
        rate, s = max_rate_meeting(slo, lambda r: curve.append((r, at_rate(r))) or curve[-1][1])
        report["slo"] = {"terms": slo, "max_rate": round(rate, 3), "at_max_rate": s}
    if ns.plot:
        _plot(ns.plot, res, sorted(curve))
    if ns.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0


def _print(report: dict) -> None:
    r = report["result"]
    print(f"KV pool: {report['kv_blocks']} blocks x {report['block_size']} tokens")
    print(f"{r['requests']} requests in {r['duration_s']:.1f} s ({r['steps']} steps): {r['output_tok_s']:.1f} output tok/s, "
          f"{r['preemptions']} preemptions, peak KV usage {100 * r['kv_usage_max']:.0f}%")
    for m in ("ttft", "itl", "e2e"):
        print(f"  {m:5s} p50 {r[f'{m}_p50_ms']:9.1f} ms   p90 {r[f'{m}_p90_ms']:9.1f} ms   p99 {r[f'{m}_p99_ms']:9.1f} ms")
    for name, c in r.get("classes", {}).items():
        slo = "".join(f", {k.removesuffix('_slo_met')} SLO met by {100 * c[k]:.1f}%" for k in ("ttft_slo_met", "itl_slo_met")
                      if k in c)
        print(f"  class {name}: {c['requests']} requests, TTFT p50 {c['ttft_p50_ms']:.1f} p99 {c['ttft_p99_ms']:.1f} ms, "
              f"ITL p50 {c['itl_p50_ms']:.1f} p99 {c['itl_p99_ms']:.1f} ms{slo}")
    if "slo" in report:
        s = report["slo"]
        print(f"highest rate meeting {s['terms']}: {s['max_rate']} req/s "
              f"({s['at_max_rate']['output_tok_s']} output tok/s there)")


def _plot(path: str, res, curve) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = 2 if curve else 1
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 3.8), squeeze=False)
    ax = axes[0][0]
    ax.plot([t for t, _ in res.kv_usage], [100 * u for _, u in res.kv_usage])
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_title("KV cache usage")
    if curve:
        ax = axes[0][1]
        rates = [r for r, _ in curve]
        for key, style in (("ttft_p99_ms", "o-"), ("itl_p99_ms", "s--"), ("ttft_p50_ms", "^:")):
            ax.plot(rates, [s[key] for _, s in curve], style, label=key)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("ms")
        ax.legend()
        ax.set_title("latency against rate (bisection points)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
