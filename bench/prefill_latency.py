"""Time to first token of one prompt alone, by prompt length: the prefill step(s) and the first token, prefix
caching off, default flags (or --dtype / --quantization), best and median of --repeats; different token ids each
repeat. Compare trees or flags by running it in each, alternating (the machine is shared).

Usage: python bench/prefill_latency.py [--lengths 16,64,106,128,256,512] [--repeats 5] [--dtype auto]
           [--quantization auto]
"""
import argparse
import json
import time

from pagedserve import LLM, SamplingParams
from pagedserve.host import describe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16,64,106,128,256,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    a = ap.parse_args()
    print(f"host: {describe()}")
    eng = LLM(num_kv_blocks=512, enable_prefix_caching=False, dtype=a.dtype, quantization=a.quantization).engine
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        ms = []
        for rep in range(a.repeats):
            eng.add_request(f"p{n}-{rep}", {"prompt_token_ids": [100 + (j * 7 + rep) % 5000 for j in range(n)]},
                            SamplingParams(max_tokens=1))
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            ms.append(1e3 * (time.perf_counter() - t))
        ms.sort()
        rows.append({"prompt_tokens": n, "best_ms": round(ms[0], 1), "median_ms": round(ms[len(ms) // 2], 1)})
        print(f"prompt {n:5d}: best {ms[0]:7.1f} ms, median {ms[len(ms) // 2]:7.1f} ms ({ms[0] / n:.3f} ms a token)")
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
