"""How many mixed64-sized requests a KV pool of a given size admits, per --kv-cache-dtype: the
engine sizes its pool from --kv-cache-memory (the same arithmetic as serving), and requests of the
workload, each holding prompt + max_tokens tokens in whole blocks, are admitted in order until the
pool is full (the workload is cycled if it all fits).

Usage: python bench/kv_capacity.py [--memory 1GiB] [--workload mixed64]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import load_workload  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", default="1GiB")
    ap.add_argument("--workload", default="mixed64")
    a = ap.parse_args()
    from pagedserve.engine.llm_engine import LLMEngine
    reqs = load_workload(a.workload)
    for kv in ("float32", "bfloat16", "int8"):
        eng = LLMEngine(kv_cache_memory=a.memory, kv_cache_dtype=kv, max_num_seqs=4096)
        bs, free = eng.args.block_size, eng.core.kv.pool.num_blocks - 1        # block 0 is the null block
        n = 0
        while True:
            r = reqs[n % len(reqs)]
            need = -(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // bs)
            if need > free:
                break
            free -= need
            n += 1
        mean = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs) / len(reqs)
        print("RESULT " + json.dumps({"kv_cache_dtype": kv, "memory": a.memory, "bytes_per_token":
                                      eng.core.kv_cache_bytes_per_token, "blocks": eng.core.kv.pool.num_blocks,
                                      "tokens": eng.core.kv.pool.num_blocks * bs, "requests_admitted": n,
                                      "mean_request_tokens": round(mean)}), flush=True)


if __name__ == "__main__":
    main()
