"""Five experiments that show the seed's claims on the default model, each a table + a PNG plot.

Usage: python bench/experiments.py [memory|static|chunked|prefix|blocksize|all] [--out bench/results]

a. memory     paged vs contiguous (max_model_len per request) allocation, same pool and request mix
b. static     static vs continuous batching: the seed's A/B/C example (+ queued requests) and mixed64
c. chunked    16 steady decodes while a 4,000-token prompt arrives: inter-token latency, chunked off/on
d. prefix     requests sharing a 1,000-token system prompt: TTFT and hit rate, prefix caching off/on
e. blocksize  block size 8..128: tail waste against step time
"""
import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from throughput import load_workload  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as p
    return p


def save(fig, out_dir, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=90)


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def drive(eng, add, on_step=None):
    """Run the engine until idle; `add(step_index)` may add requests; returns finished outputs by id."""
    done, i = {}, 0
    add(i)
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.finished:
                done[o.request_id] = o
        if on_step:
            on_step(i, eng, outs, now - t)
        i += 1
        add(i)
    return done


# ---------------------------------------------------------------- a. memory
def exp_memory(out_dir):
    reqs = load_workload("mixed16")
    pool, max_len = 1024, 2048
    rows, series = [], {}
    for policy in ("paged", "contiguous"):
        llm = LLM(num_kv_blocks=pool, kv_allocation=policy, max_model_len=max_len, max_num_seqs=64)
        eng = llm.engine
        per_tok = eng.core.model_config.kv_bytes_per_token(4)
        per_block = per_tok * eng.args.block_size
        live, alloc, running = [], [], []

        def on_step(i, e, outs, dt):
            live.append(sum(r.num_computed_tokens for r in e.core.scheduler.running) * per_tok)
            alloc.append((e.core.kv.pool.num_usable_blocks - e.core.kv.num_free_blocks) * per_block)
            running.append(len(e.core.scheduler.running))

        t = time.perf_counter()
        drive(eng, lambda i: [eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                                              SamplingParams(max_tokens=min(64, r["max_tokens"]), ignore_eos=True))
                              for r in reqs] if i == 0 else None, on_step)
        wall = time.perf_counter() - t
        waste = 1 - sum(live) / max(1, sum(alloc))
        series[policy] = (live, alloc)
        rows.append([policy, max(running), f"{max(alloc) / 2**20:.1f}", f"{100 * waste:.1f}%", len(live), f"{wall:.1f}"])
    # the same memory, three KV cache dtypes: bytes per token decide how many requests fit at once
    mem = 96 * 16 * 46080                        # 96 float32 blocks of the default model (67.5 MiB)
    kv_rows = []
    for kv in ("float32", "bfloat16", "int8"):
        llm = LLM(kv_cache_memory=mem, kv_cache_dtype=kv, max_model_len=max_len, max_num_seqs=64)
        eng = llm.engine
        running = []
        t = time.perf_counter()
        drive(eng, lambda i: [eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                                              SamplingParams(max_tokens=min(64, r["max_tokens"]), ignore_eos=True))
                              for r in reqs] if i == 0 else None,
              lambda i, e, outs, dt: running.append(len(e.core.scheduler.running)))
        kv_rows.append([kv, eng.core.kv_cache_bytes_per_token, eng.core.kv.pool.num_blocks, max(running), len(running),
                        eng.core.counters.preemptions, f"{time.perf_counter() - t:.1f}"])
    p = plt()
    fig, ax = p.subplots(figsize=(8, 4))
    for policy, (live, alloc) in series.items():
        ax.plot([x / 2**20 for x in alloc], label=f"{policy}: allocated")
        ax.plot([x / 2**20 for x in live], "--", label=f"{policy}: live")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV MiB")
    ax.set_title(f"mixed16 (outputs capped at 64), pool {pool} blocks, max_model_len {max_len}")
    ax.legend()
    save(fig, out_dir, "exp_memory.png")
    return table(["allocation", "max concurrent requests", "peak allocated MiB", "waste (1 - live/allocated)",
                  "steps", "wall s"], rows) + f"\n\nKV cache dtype, pool of {mem / 2**20:.0f} MiB each:\n\n" + table(
        ["--kv-cache-dtype", "bytes/token", "blocks", "max concurrent requests", "steps", "preemptions", "wall s"],
        kv_rows)


# ---------------------------------------------------------------- b. static vs continuous
def _batching_run(policy, reqs, max_num_seqs):
    llm = LLM(num_kv_blocks=2048, scheduling_policy=policy, max_num_seqs=max_num_seqs)
    eng = llm.engine
    arrival, idle = {}, [0]

    def on_step(i, e, outs, dt):
        # slots of max_num_seqs not doing useful work while requests wait: static batching keeps
        # finished rows' slots empty until the whole batch ends; continuous refills them next step
        if e.core.scheduler.waiting:
            idle[0] += max(0, max_num_seqs - len(e.core.scheduler.running))

    def add(i):
        if i == 0:
            for r in reqs:
                arrival[r["id"]] = time.perf_counter()
                eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                                SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
    steps = [0]
    t = time.perf_counter()
    done = drive(eng, add, lambda *a: (steps.__setitem__(0, steps[0] + 1), on_step(*a)))
    wall = time.perf_counter() - t
    lat = statistics.mean(o.metrics.finished_time - o.metrics.arrival_time for o in done.values())
    toks = sum(r["max_tokens"] for r in reqs)
    return steps[0], idle[0], toks / wall, lat


def exp_static(out_dir):
    abc = [{"id": n, "prompt_token_ids": list(range(1000 + 10 * k, 1016 + 10 * k)), "max_tokens": m}
           for k, (n, m) in enumerate([("A", 2), ("B", 8), ("C", 20), ("D", 20), ("E", 8), ("F", 2)])]
    mixed = load_workload("mixed64")
    rows, bars = [], {}
    for name, reqs, seqs in (("A/B/C (+D/E/F queued)", abc, 3), ("mixed64", mixed, 16)):
        for policy in ("static", "continuous"):
            steps, idle, tps, lat = _batching_run(policy, reqs, seqs)
            rows.append([name, policy, seqs, steps, idle, f"{tps:.1f}", f"{lat:.2f}"])
            bars[(name, policy)] = (tps, lat)
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(9, 3.5))
    for ax, k, label in ((axes[0], 0, "output tok/s"), (axes[1], 1, "mean latency s")):
        names = list(dict.fromkeys(n for n, _ in bars))
        for j, policy in enumerate(("static", "continuous")):
            ax.bar([i + 0.4 * j for i in range(len(names))], [bars[(n, policy)][k] for n in names], 0.4, label=policy)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names)
        ax.set_ylabel(label)
        ax.legend()
    save(fig, out_dir, "exp_static.png")
    return table(["workload", "policy", "max_num_seqs", "iterations", "idle slot-iterations while requests wait", "output tok/s", "mean latency s"], rows)


# ---------------------------------------------------------------- c. chunked prefill
def exp_chunked(out_dir):
    rng = random.Random(0)
    runs = [("chunked off", dict(enable_chunked_prefill=False)),
            ("chunk 1024", dict(long_prefill_token_threshold=1024)),
            ("chunk 512", dict(long_prefill_token_threshold=512)),
            ("chunk 256", dict(long_prefill_token_threshold=256))]
    decodes = [[rng.randrange(17, 49152) for _ in range(32)] for _ in range(16)]
    long_prompt = [rng.randrange(17, 49152) for _ in range(4000)]
    rows, curves = [], {}
    for name, kw in runs:
        llm = LLM(num_kv_blocks=1024, max_num_batched_tokens=4096, **kw)
        eng = llm.engine
        last, itl = {}, []
        t0 = [None]

        def add(i):
            if i == 0:
                for k, p in enumerate(decodes):
                    eng.add_request(f"d{k}", {"prompt_token_ids": p}, SamplingParams(max_tokens=90, ignore_eos=True),
                                    stream=True)
            if i == 20:
                eng.add_request("long", {"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=4, ignore_eos=True))

        def on_step(i, e, outs, dt):
            now = time.perf_counter()
            if t0[0] is None:
                t0[0] = now
            for o in outs:     # a stream's output carries the tokens new since the last one
                if o.request_id.startswith("d") and o.outputs[0].token_ids:
                    if o.request_id in last:
                        itl.append((now - t0[0], now - last[o.request_id]))
                    last[o.request_id] = now
        drive(eng, add, on_step)
        xs = [d for _, d in itl]
        curves[name] = itl
        rows.append([name, f"{1000 * pct(xs, 50):.0f}", f"{1000 * pct(xs, 99):.0f}", f"{1000 * max(xs):.0f}"])
    p = plt()
    fig, ax = p.subplots(figsize=(8, 4))
    for name, pts in curves.items():
        ax.plot([t for t, _ in pts], [1000 * d for _, d in pts], ".", ms=3, label=name)
    ax.set_xlabel("time s")
    ax.set_ylabel("inter-token latency of the 16 decodes, ms")
    ax.set_yscale("log")
    ax.set_title("a 4,000-token prompt arrives at step 20")
    ax.legend()
    save(fig, out_dir, "exp_chunked.png")
    return table(["prefill", "ITL p50 ms", "ITL p99 ms", "ITL max ms"], rows)


# ---------------------------------------------------------------- d. prefix caching
def exp_prefix(out_dir):
    rng = random.Random(1)
    system = [rng.randrange(17, 49152) for _ in range(1000)]
    users = [[rng.randrange(17, 49152) for _ in range(rng.randint(10, 40))] for _ in range(8)]
    rows, ttfts = [], {}
    for on in (False, True):
        llm = LLM(num_kv_blocks=1024, enable_prefix_caching=on)
        eng = llm.engine
        ts = []
        for k, u in enumerate(users):
            out = llm.generate([{"prompt_token_ids": system + u}], SamplingParams(max_tokens=4, ignore_eos=True),
                               use_tqdm=False)[0]
            ts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        c = eng.core.counters
        hit = c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0
        ttfts["on" if on else "off"] = ts
        rows.append(["on" if on else "off", f"{1000 * ts[0]:.0f}", f"{1000 * statistics.mean(ts[1:]):.0f}",
                     f"{100 * hit:.1f}%"])
    p = plt()
    fig, ax = p.subplots(figsize=(7, 3.5))
    for k, ts in ttfts.items():
        ax.plot(range(1, len(ts) + 1), [1000 * t for t in ts], "o-", label=f"prefix caching {k}")
    ax.set_xlabel("request (each: the same 1,000-token system prompt + its own question)")
    ax.set_ylabel("TTFT ms")
    ax.legend()
    save(fig, out_dir, "exp_prefix.png")
    return table(["prefix caching", "TTFT 1st request ms", "mean TTFT requests 2-8 ms", "hit rate (tokens)"], rows)


# ---------------------------------------------------------------- e. block size
def exp_blocksize(out_dir):
    reqs = load_workload("mixed16")
    rows, pts = [], []
    for bs in (8, 16, 32, 64, 128):
        llm = LLM(num_kv_blocks=16384 // bs, block_size=bs)
        eng = llm.engine
        per_tok = eng.core.model_config.kv_bytes_per_token(4)
        waste, step_s = [], []

        def on_step(i, e, outs, dt):
            live = sum(r.num_computed_tokens for r in e.core.scheduler.running)
            held = sum(len(e.core.kv.block_ids(r.request_id)) for r in e.core.scheduler.running) * bs
            if held:
                waste.append((held - live) / held)
            step_s.append(dt)
        t = time.perf_counter()
        drive(eng, lambda i: [eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                                              SamplingParams(max_tokens=min(64, r["max_tokens"]), ignore_eos=True))
                              for r in reqs] if i == 0 else None, on_step)
        wall = time.perf_counter() - t
        w = statistics.mean(waste)
        ms = 1000 * statistics.median(step_s)
        pts.append((bs, w, ms))
        rows.append([bs, f"{100 * w:.2f}%", f"{ms:.1f}", f"{wall:.1f}", per_tok * bs // 1024])
    p = plt()
    fig, ax = p.subplots(figsize=(7, 3.5))
    ax.plot([b for b, _, _ in pts], [100 * w for _, w, _ in pts], "o-", label="tail waste %")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("tail waste % of held KV")
    ax2 = ax.twinx()
    ax2.plot([b for b, _, _ in pts], [m for _, _, m in pts], "s--", color="C1", label="median step ms")
    ax2.set_ylabel("median step ms")
    fig.legend(loc="upper center")
    save(fig, out_dir, "exp_blocksize.png")
    return table(["block size", "mean tail waste", "median step ms", "wall s", "KiB per block"], rows)


EXPERIMENTS = {"memory": exp_memory, "static": exp_static, "chunked": exp_chunked, "prefix": exp_prefix,
               "blocksize": exp_blocksize}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("which", nargs="?", default="all", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name in (EXPERIMENTS if a.which == "all" else [a.which]):
        t = time.perf_counter()
        md = EXPERIMENTS[name](a.out)
        print(f"\n### {name} ({time.perf_counter() - t:.0f} s)\n\n{md}\n", flush=True)


if __name__ == "__main__":
    main()
