"""Real GGUF files with default flags, next to llama.cpp's llama-server on the same file, in one run.

For each file: one stream (short8, requests one after another: decode speed as one user sees it) and
mixed64 (all at once: throughput), pagedserve offline with default flags in a process of its own (its
peak RSS its own), then llama-server (`../shared/bench/llama_server_client.py`, 2 threads,
`--cache-ram 0`, 1 slot for short8, 16 for mixed64) on the same requests; token counts are checked on
both sides. Prints a table of ratios and writes the rows as JSON lines.

Memory at equal token capacity: our KV pool gets the tokens llama-server's `-c` gives (4,096 for short8, 20,480
for mixed64: `--num-kv-blocks` = that / block size) unless --num-kv-blocks says otherwise (0: the engine's own
sizing). Each side's peak RSS is its process's high-water mark (ru_maxrss; llama-server's from its client); ours
is also given by phase: the RSS after each start-up phase (model read, dense copies, ...), the high-water mark
of the load, and the RSS after the load, after the warm-up request and after the workload.

Usage: python bench/real_models.py build/models/qwen2.5-coder-0.5b-q4_k_m.gguf [...more files]
           [--llama-server build/llama/bin/llama-server] [--workloads short8,mixed64] [--out FILE.jsonl]
           [--num-kv-blocks N]   (ours at a given pool; default: llama-server's -c in blocks; 0: ours)
           [--claims]            (write the rows into BENCHMARKS.md's first table: bench/claims.py)
(the files: ../shared/bench/real_models.sh build/models; llama-server: ../shared/bench/build_llama_server.sh)
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench"))
sys.path.insert(0, HERE)
LLAMA_CTX = {"short8": 4096, "mixed64": 20480}     # llama-server's -c per workload (run_llama): the token capacity
LLAMA_SLOTS = {"short8": 1, "mixed64": 16}


def rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(model: str, workload: str, num_kv_blocks: int | None, flags: dict | None = None) -> dict:
    """One workload through LLM(model) with default flags (or `flags`: engine arguments; a warm-up request first)."""
    from pagedserve import LLM, SamplingParams
    import workload as wl
    reqs = wl.make(workload)
    t0 = time.perf_counter()
    llm = LLM(model, **({} if not num_kv_blocks else {"num_kv_blocks": num_kv_blocks}), **(flags or {}))
    load_s = time.perf_counter() - t0
    eng = llm.engine
    rss = {f"after {p['phase']}": p["rss_mb"] for p in eng.startup.as_dict()["phases"]}
    rss |= {"load high-water": peak_rss_mb(), "after load": rss_now_mb()}
    llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
    rss["after warm-up"] = rss_now_mb()
    sp = lambda r: SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)   # noqa: E731
    t = time.perf_counter()
    got = {}
    if workload == "short8":              # one stream: each request alone
        for r in reqs:
            out = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]}], sp(r), use_tqdm=False)
            got[r["id"]] = len(out[0].outputs[0].token_ids)
    else:
        for r in reqs:
            eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]}, sp(r))
        while eng.has_unfinished_requests():
            for o in eng.step():
                got[o.request_id] = len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t
    rss["after workload"] = rss_now_mb()
    out_tokens = sum(r["max_tokens"] for r in reqs)
    return {"engine": f"pagedserve {json.dumps(flags) if flags else '(default flags)'}", "model": os.path.basename(model), "workload": workload,
            "weights": eng.core.model.weights_desc, "kv_blocks": eng.core.kv.pool.num_usable_blocks,
            "kv_tokens": eng.core.kv.pool.num_usable_blocks * eng.info.block_size,
            "token_counts_ok": all(got.get(r["id"]) == r["max_tokens"] for r in reqs),
            "load_s": round(load_s, 2), "wall_s": round(wall, 2), "output_tok_s": round(out_tokens / wall, 2),
            "rss_after_load_mb": round(rss["after load"]), "peak_rss_mb": round(peak_rss_mb()),
            "rss_by_phase_mb": {k: round(v) for k, v in rss.items()}}


def child(args: list[str], env: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{args[:3]} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def run_llama(server: str, model: str, workload: str) -> dict:
    import workload as wl
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{workload}.jsonl")
        with open(path, "w") as f:
            for r in wl.make(workload):
                f.write(json.dumps(r) + "\n")
        seq = workload == "short8"
        args = [os.path.join(SHARED, "llama_server_client.py"), model, path, "--np", str(LLAMA_SLOTS[workload]),
                "--ctx", str(LLAMA_CTX[workload]), "--extra=--cache-ram 0", "--log", os.path.join(d, "llama.log")]
        res = child(args + (["--sequential"] if seq else []), dict(os.environ, LLAMA_SERVER=server))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-server", default=os.path.join(os.path.dirname(HERE), "build/llama/bin/llama-server"))
    ap.add_argument("--workloads", default="short8,mixed64")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "real_models.jsonl"))
    ap.add_argument("--flags", default=None, help='engine arguments as JSON for our side, e.g. {"quantization": "gguf"}')
    ap.add_argument("--no-llama", action="store_true", help="our side only")
    ap.add_argument("--claims", action="store_true", help="update BENCHMARKS.md's table (bench/claims.py)")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:                                   # a child: one model, one workload, ours
        print("RESULT " + json.dumps(run_ours(a.models[0], a.side, a.num_kv_blocks,
                                              json.loads(a.flags) if a.flags else None)), flush=True)
        return
    rows = []
    for model in a.models:
        for w in a.workloads.split(","):
            blocks = LLAMA_CTX[w] // 16 if a.num_kv_blocks is None else a.num_kv_blocks   # 16: the block size
            extra = ["--num-kv-blocks", str(blocks)] + ([] if a.flags is None else ["--flags", a.flags])
            ours = child([os.path.abspath(__file__), model, "--side", w, *extra])
            llama = run_llama(a.llama_server, model, w) if os.path.exists(a.llama_server) and not a.no_llama else None
            rows += [ours] + ([llama] if llama else [])
            ratio = f"{ours['output_tok_s'] / llama['output_tok_s']:.2f}x" if llama else "-"
            print(f"{os.path.basename(model):34} {w:8} ours {ours['output_tok_s']:8.2f} tok/s "
                  f"(peak RSS {ours['peak_rss_mb']} MB, ok {ours['token_counts_ok']}) | llama-server "
                  f"{llama['output_tok_s'] if llama else '-':>8} tok/s (peak RSS {llama['peak_rss_mb'] if llama else '-'} MB, "
                  f"ok {llama['token_counts_ok'] if llama else '-'}) | {ratio}", flush=True)
            print("    ours, RSS MB by phase (at " + f"{ours['kv_tokens']} KV tokens): "
                  + ", ".join(f"{k} {v}" for k, v in ours["rss_by_phase_mb"].items()), flush=True)
    print("\n| model | workload | pagedserve tok/s | llama-server tok/s | ratio | peak RSS ours / llama (MB) | RSS ratio |")
    print("|---|---|---|---|---|---|---|")
    for ours, llama in zip(rows[::2], rows[1::2]) if not a.no_llama else ():
        print(f"| {ours['model']} | {ours['workload']} | {ours['output_tok_s']} | {llama['output_tok_s']} | "
              f"{ours['output_tok_s'] / llama['output_tok_s']:.2f}x | {ours['peak_rss_mb']} / {llama['peak_rss_mb']} | "
              f"{ours['peak_rss_mb'] / llama['peak_rss_mb']:.2f}x |")
    if a.claims and not a.no_llama:
        record_claims(rows, " ".join(["python", "bench/real_models.py", *sys.argv[1:]]))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def record_claims(rows: list[dict], command: str) -> None:
    """One claim row per (file, workload), and one peak-RSS row for mixed64 across the files."""
    import claims
    what = {"short8": "one stream (short8 sequential)", "mixed64": "mixed64 (all at once)"}
    aim = {"short8": " (aim 1.2x)", "mixed64": " (aim 2x)"}
    rss = []
    for k, (ours, llama) in enumerate(zip(rows[::2], rows[1::2])):
        ok = "" if ours["token_counts_ok"] and llama["token_counts_ok"] else " (token counts NOT ok)"
        claims.update(f"real:{ours['model']}:{ours['workload']}", benchmarks=None,
                      command=f"`{command}`" if k == 0 else "same",
                      claim=f"Real file {ours['model']}, {what.get(ours['workload'], ours['workload'])}, default flags",
                      ours=f"{ours['output_tok_s']} tok/s{ok}",
                      reference=f"llama-server {llama['output_tok_s']} tok/s (`--cache-ram 0`, same file)",
                      ratio=f"**{ours['output_tok_s'] / llama['output_tok_s']:.2f}x**{aim.get(ours['workload'], '')}")
        if ours["workload"] == "mixed64":
            rss.append((ours["model"], ours["peak_rss_mb"], llama["peak_rss_mb"], ours["kv_tokens"]))
    if rss:
        claims.update("real:peak-rss", benchmarks=None, command="same",
                      claim="Peak RSS at equal token capacity, real files, mixed64 (" + " / ".join(m for m, *_ in rss) + ")",
                      ours=" / ".join(f"{o:,} MB ({t:,} KV tokens)" for _, o, _, t in rss),
                      reference="llama-server " + " / ".join(f"{l:,} MB" for _, _, l, _ in rss),
                      ratio=" / ".join(f"**{o / l:.2f}x**" for _, o, l, _ in rss) + " (aim 1.3x)")
    claims.write_table(claims.load())


if __name__ == "__main__":
    main()
