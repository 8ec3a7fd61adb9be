"""Offline throughput on a shared workload (../shared/bench/workload.py), pagedserve next to HF
transformers' continuous batching (hf_cb.py) and static batching (hf_static.py, batch 16), run one
after the other in this one invocation; prints each RESULT and the ratios.

Usage: python bench/throughput.py --workload mixed64 [--no-baselines] [--max-num-batched-tokens N] ...
       python bench/throughput.py --kv-cache-dtypes float32,bfloat16,int8 --baselines hf_cb.py
       (one pagedserve run per KV cache dtype, then the chosen baselines)
       python bench/throughput.py --paths float32:none,bfloat16:none,bfloat16:gguf --baselines hf_cb.py \
           --baseline-dtypes float32,bfloat16   (one run per --dtype:--quantization; baselines per dtype)
       python bench/throughput.py --paths auto:auto,auto:auto:ngram,auto:auto --no-baselines
           (a third field: speculative decoding, ngram = adaptive n-gram drafting, ngram-always = always;
           draft / draft-always = method draft_model with --draft PATH [--draft-quantization Q]; --spec-k
           draft tokens; invariant = --batch-invariant)
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench"))


def load_workload(name: str) -> list[dict]:
    sys.path.insert(0, HERE)          # bench/workload.py: the shared generator's copy (the baselines stay in SHARED)
    import workload
    return workload.make(name)


def run_ours(reqs, args, kv_cache_dtype: str = "auto", dtype: str = "auto", quantization: str = "none",
             spec: str | None = None) -> dict:
    import torch
    from pagedserve import LLM, SamplingParams
    invariant, spec = spec == "invariant", None if spec == "invariant" else spec
    t0 = time.perf_counter()
    llm = LLM(batch_invariant=invariant, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              long_prefill_token_threshold=args.chunk, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
              quantization=quantization,
              speculative_config=None if not spec else {"num_speculative_tokens": args.spec_k,
                                                        "adaptive": not spec.endswith("-always")} | (
                  {"method": "ngram"} if spec.startswith("ngram") else
                  {"model": args.draft, "quantization": args.draft_quantization}))
    load_s = time.perf_counter() - t0
    eng = llm.engine
    llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
    steps = []
    t = time.perf_counter()
    for r in reqs:
        eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = len(o.outputs[0].token_ids)
        steps.append(eng.core.last_stats)
    wall = time.perf_counter() - t
    ok = all(got.get(r["id"]) == r["max_tokens"] for r in reqs)
    p_tok = sum(len(r["prompt_token_ids"]) for r in reqs)
    o_tok = sum(r["max_tokens"] for r in reqs)
    step_s = sum(s.step_s for s in steps)
    fwd_s = sum(s.forward_s for s in steps)
    busy = [s for s in steps if s.num_running >= 48]
    busy_out = (sum(s.step_s - s.forward_s for s in busy) / max(1e-9, sum(s.step_s for s in busy))) if busy else None
    sp = eng.core.scheduler.spec_stats
    return {"engine": "pagedserve", "dtype": dtype, "quantization": quantization, "speculative": spec,
            "draft_tokens": sp.num_draft_tokens, "accepted_tokens": sp.num_accepted_tokens,
            "weights": eng.core.model.weights_desc + (" batch-invariant" if invariant else ""), "weights_mb": round(eng.core.weights_bytes / 2**20, 1),
            "kv_cache_dtype": eng.core.kv_cache_dtype_name, "n_requests": len(reqs), "load_s": round(load_s, 2), "wall_s": round(wall, 2),
            "prompt_tokens": p_tok, "output_tokens": o_tok, "output_tok_s": round(o_tok / wall, 2),
            "total_tok_s": round((p_tok + o_tok) / wall, 2), "token_counts_ok": ok, "steps": len(steps),
            "share_outside_forward": round(1 - fwd_s / step_s, 3),
            "share_outside_forward_at_48plus_running": None if busy_out is None else round(busy_out, 3),
            "max_running": max(s.num_running for s in steps), "preemptions": sum(s.num_preemptions for s in steps),
            "max_num_batched_tokens": args.max_num_batched_tokens, "chunk": args.chunk,
            "threads": torch.get_num_threads()}


def run_baseline(script: str, wl_path: str, extra: list[str]) -> dict:
    cmd = [sys.executable, os.path.join(SHARED, script), wl_path, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"engine": script, "error": p.stderr[-2000:]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mixed64")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: one pagedserve run each")
    ap.add_argument("--paths", default="auto:auto", help="comma-separated dtype:quantization[:ngram|ngram-always], "
                                                          "one run each")
    ap.add_argument("--spec-k", type=int, default=4, help="num_speculative_tokens of a path with ngram or draft")
    ap.add_argument("--draft", default=None, help="the draft model of a path with draft | draft-always")
    ap.add_argument("--draft-quantization", default=None, help="its speculative_config quantization")
    ap.add_argument("--baselines", default="hf_cb.py,hf_static.py", help="comma-separated shared drivers")
    ap.add_argument("--baseline-dtypes", default="float32", help="comma-separated: each baseline once per dtype")
    a = ap.parse_args()
    reqs = load_workload(a.workload)
    from pagedserve.host import describe
    print(f"host: {describe()}")
    ours = []
    for path in a.paths.split(","):
        dtype, quant, spec = (path.split(":") + [None])[:3]
        for kv in a.kv_cache_dtypes.split(","):
            ours.append(run_ours(reqs, a, kv, dtype, quant, spec))
            print("RESULT " + json.dumps(ours[-1]), flush=True)
    if not a.no_baselines:
        wl_path = os.path.join("/tmp", f"{a.workload}.jsonl")
        with open(wl_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in reqs)
        base = []
        for script in a.baselines.split(","):
            for dt in a.baseline_dtypes.split(","):
                r = run_baseline(script, wl_path, ["16", dt] if script == "hf_static.py" else ["--dtype", dt])
                r["dtype"] = dt
                base.append(r)
                print("RESULT " + json.dumps(r), flush=True)
        for o in ours:
            for r in base:
                if "output_tok_s" in r:
                    print(f"RATIO pagedserve ({o['weights']}, KV {o['kv_cache_dtype']}) / {r['engine']} {r['dtype']}: "
                          f"{o['output_tok_s'] / r['output_tok_s']:.2f}x output tok/s")


if __name__ == "__main__":
    main()
