"""This machine's limits and where a mixed64 run spends its time, in one run.

1. Limits: memory read bandwidth (a sum over a buffer larger than the last-level cache, the best of
   one measure before and one after the run) and GEMM
   GFLOP/s of `F.linear` on the model's own shapes for each dtype this CPU multiplies.
2. A profiled mixed64 run (offline engine, the shared workload): timers around every phase of the
   forward pass. A GEMM of a step that mixes decode rows and prefill rows is split between "decode
   GEMMs" and "prefill GEMMs" in proportion to the rows (its FLOPs are); the LM head runs only on
   the rows that sample. Each line gets its achieved GFLOP/s or GB/s and its share of the limit.

3. --prefill 4000:256: one prompt of 4,000 tokens in chunks of 256, alone; per chunk, the time in
   prefill attention and in the GEMMs (the issue's test: attention's share no more than the GEMMs').

Usage: python bench/roofline.py [--workload mixed64] [--requests N] [--kv-cache-dtype auto] [--json F]
       python bench/roofline.py --prefill 4000:256 [--kv-cache-dtype ...]
       [--pythonpath DIR]   (profile another checkout, e.g. a git worktree of an older commit)
"""
import argparse
import json
import os
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_name_and_flags() -> tuple[str, list[str]]:
    from pagedserve.host import cpu_info
    name, flags = cpu_info()
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
            "amx_tile", "amx_bf16", "amx_int8")
    return name, [f for f in keep if f in flags]


def read_bandwidth_gb_s(torch, mib: int = 2048, repeats: int = 5) -> float:
    x = torch.ones(mib * 2**18)          # fp32: bigger than the 480 MiB L3 some hosts of this kind report
    x.sum()
    t = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    return mib * 2**20 * repeats / (time.perf_counter() - t) / 1e9


def gemm_table(torch, shapes: dict[str, tuple[int, int]], rows=(1, 64, 256, 1024), dtypes=None) -> list[dict]:
    import torch.nn.functional as F
    out = []
    for dt in dtypes:
        for name, (k, n) in shapes.items():
            w = torch.randn(n, k).to(dt)
            for m in rows:
                x = torch.randn(m, k).to(dt)
                F.linear(x, w)
                reps = max(3, int(2e9 / (2 * m * n * k)))
                t = time.perf_counter()
                for _ in range(reps):
                    F.linear(x, w)
                dt_s = (time.perf_counter() - t) / reps
                out.append({"dtype": str(dt).removeprefix("torch."), "shape": name, "k": k, "n": n, "rows": m,
                            "gflop_s": round(2 * m * n * k / dt_s / 1e9, 1)})
    return out


class Profile:
    """Timers patched around the forward pass's phases; `current` is the step being run."""

    def __init__(self):
        self.time = defaultdict(float)
        self.work = defaultdict(float)       # FLOPs or bytes, per line
        self.rows = (0, 0)                   # (decode rows, prefill rows) of the running step

    def add(self, line, seconds, work=0.0):
        self.time[line] += seconds
        self.work[line] += work


def install(prof: Profile, eng):
    """Wrap the phases. Names differ between checkouts; a name a checkout lacks is skipped."""
    import pagedserve.model.attention as attention
    import pagedserve.model.llama as llama
    runner = eng.core.runner
    cfg = eng.core.model_config
    kv_tok_layer = eng.core.kv_cache_bytes_per_token / cfg.num_layers
    lm_head_depth = [0]

    lin = llama.linear

    def linear(x, w, b=None, *form):
        t = time.perf_counter()
        y = lin(x, w, b, *form)
        dt = time.perf_counter() - t
        flops = 2.0 * x.shape[0] * w.shape[0] * w.shape[1]
        if lm_head_depth[0]:
            prof.add("LM head", dt, flops)
            return y
        d, p = prof.rows
        if d + p == 0:
            d = 1
        prof.add("decode GEMMs", dt * d / (d + p), flops * d / (d + p))
        prof.add("prefill GEMMs", dt * p / (d + p), flops * p / (d + p))
        return y
    llama.linear = linear

    model = runner.model
    logits_fn = model.compute_logits

    def compute_logits(h):
        lm_head_depth[0] += 1
        try:
            return logits_fn(h)
        finally:
            lm_head_depth[0] -= 1
    model.compute_logits = compute_logits

    def timed(line, fn, work_of):
        def w(*a, **k):
            t = time.perf_counter()
            y = fn(*a, **k)
            prof.add(line, time.perf_counter() - t, work_of(*a, **k))
            return y
        return w

    nh, hd = cfg.num_heads, cfg.head_dim

    def decode_bytes(q, kv, md, *a, **k):
        return float(md.decode_context_lens.sum()) * kv_tok_layer

    def prefill_flops(q, kv, md, *a, **k):
        # causal: query i of a chunk with `c` keys after it attends c - (q_len - 1 - i) keys; QK and PV
        tot = 0.0
        for ql, ctx in md.prefill_shapes():
            tot += ql * ctx - ql * (ql - 1) / 2
        return tot * nh * hd * 4

    if hasattr(attention, "decode_attention"):
        attention.decode_attention = timed("decode attention", attention.decode_attention, decode_bytes)
        attention.prefill_attention = timed("prefill attention", attention.prefill_attention, prefill_flops)
    else:   # the first wave's layout: a C decode kernel and a per-sequence SDPA for prefill chunks
        kern = attention.paged_decode_attention
        attention.paged_decode_attention = timed(
            "decode attention", kern,
            lambda q, kc, vc, bt, lens, *a, **k: float(lens.sum()) * kv_tok_layer)
        pre = attention._prefill_attention
        attention._prefill_attention = timed(
            "prefill attention", pre,
            lambda q, kc, vc, p, s: (q.shape[0] * p.context_len - q.shape[0] * (q.shape[0] - 1) / 2) * nh * hd * 4)

    class TimedSampler:           # the runner also calls sampler.forget(...)
        def __init__(self, inner):
            self.inner, self.call = inner, timed("sampling", inner, lambda *a, **k: 0.0)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *a, **k):
            return self.call(*a, **k)
    runner.sampler = TimedSampler(runner.sampler)

    execute = runner.execute

    def ex(so):
        prof.rows = (so.num_decode_tokens, so.num_prefill_tokens)
        t = time.perf_counter()
        r = execute(so)
        prof.add("step (runner)", time.perf_counter() - t)
        return r
    runner.execute = ex


def prefill_chunks(llm, eng, a):
    """One long prompt, chunked; a row per chunk: its keys, attention s, GEMM s, attention / GEMMs."""
    import random
    from pagedserve import SamplingParams
    n, chunk = (int(x) for x in a.prefill.split(":"))
    rng = random.Random(0)
    llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=2), use_tqdm=False)
    prof = Profile()
    install(prof, eng)
    eng.add_request("long", {"prompt_token_ids": [rng.randrange(17, 49152) for _ in range(n)]},
                    SamplingParams(max_tokens=1, ignore_eos=True))
    rows, done = [], 0
    while eng.has_unfinished_requests():
        before = dict(prof.time)
        eng.step()
        d = {k: prof.time.get(k, 0.0) - before.get(k, 0.0) for k in prof.time}
        gemm = d.get("prefill GEMMs", 0.0) + d.get("decode GEMMs", 0.0) + d.get("LM head", 0.0)
        att = d.get("prefill attention", 0.0)
        done += eng.core.last_stats.num_prefill_tokens
        step = d.get("step (runner)", 0.0)
        if not step:
            continue
        rows.append({"keys": min(done, n), "step_ms": round(1e3 * step, 1), "attention_ms": round(1e3 * att, 1),
                     "gemm_ms": round(1e3 * gemm, 1), "attention_share": round(att / step, 3),
                     "gemm_share": round(gemm / step, 3)})
    print("| keys after chunk | step ms | attention ms | GEMMs ms | attention share | GEMM share |")
    for r in rows:
        print(f"| {r['keys']:>6} | {r['step_ms']:>7} | {r['attention_ms']:>8} | {r['gemm_ms']:>8} | "
              f"{100 * r['attention_share']:>5.1f}% | {100 * r['gemm_share']:>5.1f}% |")
    worst = max(rows, key=lambda r: r["attention_share"] - r["gemm_share"])
    print("RESULT " + json.dumps({"prompt": n, "chunk": chunk, "kv_cache_dtype": getattr(eng, "kv_cache_dtype_name", "float32"),
                                  "chunks": len(rows), "worst": worst,
                                  "chunks_attention_over_gemm": sum(r["attention_share"] > r["gemm_share"]
                                                                    for r in rows)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mixed64")
    ap.add_argument("--requests", type=int, default=None, help="first N requests of the workload")
    ap.add_argument("--kv-cache-dtype", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--prefill", default=None, help="PROMPT:CHUNK, e.g. 4000:256: per-chunk attention vs GEMMs")
    ap.add_argument("--pythonpath", default=None, help="import pagedserve from this checkout")
    a = ap.parse_args()
    if a.pythonpath:
        sys.path.insert(0, os.path.abspath(a.pythonpath))
    sys.path.insert(0, HERE)
    import torch
    from throughput import load_workload
    from pagedserve import LLM, SamplingParams

    name, flags = cpu_name_and_flags()
    kw = {k: v for k, v in (("kv_cache_dtype", a.kv_cache_dtype), ("dtype", a.dtype),
                                             ("quantization", a.quantization)) if v is not None}
    if a.prefill:
        chunk = int(a.prefill.split(":")[1])
        llm = LLM(num_kv_blocks=4096, long_prefill_token_threshold=chunk, **kw)
        if not hasattr(llm.engine, "kv_cache_bytes_per_token"):    # older checkouts
            llm.engine.core.kv_cache_bytes_per_token = llm.engine.core.model_config.kv_bytes_per_token(4)
        return prefill_chunks(llm, llm.engine, a)
    llm = LLM(num_kv_blocks=4096, max_num_seqs=64, **kw)
    eng = llm.engine
    if not hasattr(eng, "kv_cache_bytes_per_token"):    # older checkouts
        eng.core.kv_cache_bytes_per_token = eng.core.model_config.kv_bytes_per_token(4)
    cfg = eng.core.model_config
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv": (h, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim), "o": (cfg.num_heads * cfg.head_dim, h),
              "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, cfg.vocab_size)}
    dtypes = [torch.float32] + ([torch.bfloat16] if "avx512_bf16" in flags or "amx_bf16" in flags else [])
    bw = read_bandwidth_gb_s(torch)
    gemms = gemm_table(torch, shapes, dtypes=dtypes)

    reqs = load_workload(a.workload)[: a.requests]
    llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
    prof = Profile()
    install(prof, eng)
    for r in reqs:
        eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
    t = time.perf_counter()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    wall = time.perf_counter() - t
    out_tok = sum(r["max_tokens"] for r in reqs)
    bw = max(bw, read_bandwidth_gb_s(torch))   # best of before/after: a shared host's bandwidth moves

    def peak(dtype, rows):   # the best measured GEMM rate of the model's shapes at about this many rows
        return max(g["gflop_s"] for g in gemms if g["dtype"] == dtype and g["rows"] == rows)
    wdt = str(next(eng.core.runner.model.parameters()).dtype).removeprefix("torch.")
    lines = []
    accounted = 0.0
    limits = {"decode GEMMs": ("GFLOP/s", peak(wdt, 64)), "prefill GEMMs": ("GFLOP/s", peak(wdt, 256)),
              "LM head": ("GFLOP/s", peak(wdt, 64)), "decode attention": ("GB/s", bw),
              "prefill attention": ("GFLOP/s", peak(wdt, 256)), "sampling": (None, None)}
    for line, (unit, limit) in limits.items():
        s = prof.time.get(line, 0.0)
        accounted += s
        rate = (prof.work[line] / s / 1e9) if s and unit else None
        lines.append({"line": line, "s": round(s, 2), "share": round(s / wall, 3), "unit": unit,
                      "achieved": None if rate is None else round(rate, 1),
                      "limit": None if limit is None else round(limit, 1),
                      "of_limit": None if rate is None else round(rate / limit, 2)})
    lines.append({"line": "the rest (scheduler, inputs, norms, RoPE, K/V write, output processing)",
                  "s": round(wall - accounted, 2), "share": round((wall - accounted) / wall, 3)})
    res = {"host": name, "flags": flags, "threads": torch.get_num_threads(), "read_gb_s": round(bw, 1),
           "workload": a.workload, "requests": len(reqs), "steps": steps, "wall_s": round(wall, 2),
           "output_tok_s": round(out_tok / wall, 1), "weights": getattr(eng.core.model, "weights_desc", wdt),
           "kv_cache_dtype": getattr(eng, "kv_cache_dtype_name", "float32"), "lines": lines, "gemms": gemms}
    print(f"host: {name} | {' '.join(flags)} | {res['threads']} threads | read {bw:.1f} GB/s")
    print("GEMM GFLOP/s (F.linear, model shapes):")
    for dt in dtypes:
        d = str(dt).removeprefix("torch.")
        for sname in shapes:
            row = [g for g in gemms if g["dtype"] == d and g["shape"] == sname]
            print(f"  {d:9s} {sname:8s} " + "  ".join(f"{g['rows']:>5} rows {g['gflop_s']:>7.1f}" for g in row))
    print(f"\n{a.workload}: {len(reqs)} requests, {steps} steps, {wall:.1f} s, {res['output_tok_s']} output tok/s "
          f"(weights {res['weights']}, KV {res['kv_cache_dtype']})")
    print(f"| {'line':<40} | {'s':>6} | {'share':>6} | {'achieved':>14} | {'limit':>14} | {'of limit':>8} |")
    for ln in lines:
        ach = "" if ln.get("achieved") is None else f"{ln['achieved']} {ln['unit']}"
        lim = "" if ln.get("limit") is None else f"{ln['limit']} {ln['unit']}"
        ofl = "" if ln.get("of_limit") is None else f"{100 * ln['of_limit']:.0f}%"
        print(f"| {ln['line'][:40]:<40} | {ln['s']:>6} | {100 * ln['share']:>5.1f}% | {ach:>14} | {lim:>14} | {ofl:>8} |")
    print("RESULT " + json.dumps({k: v for k, v in res.items() if k != "gemms"}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
