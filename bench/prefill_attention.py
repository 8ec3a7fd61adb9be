"""Prefill attention by chunk length and context: the C kernel's float32 products against its bf16 products
(`bf16_dots`, AVX512-BF16 hosts; a bf16 model on a bf16 cache), on the default model's attention shape
(9 heads, 3 kv heads, head dim 64), a bf16 cache over scattered blocks, one chunk a call; per call and per
step of 30 layers (the median of --repeats). Chunks of few queries show the lane packing (5 queries of a
group of 3 fill one vector: 1 to 5 cost alike, 6 to 10 two vectors, 11 to 16 a full tile).

Usage: python bench/prefill_attention.py [--cases 16@1024,16@4096,64@2048,256@4096,1@3500,5@3500,6@3500,...]
           [--repeats 30]
"""
import argparse
import inspect
import json
import time

import torch

from pagedserve import kernels
from pagedserve.host import describe

NH, NKV, HD, BS, LAYERS = 9, 3, 64, 16, 30
CASES = "16@1024,16@4096,64@2048,256@4096,1@3500,5@3500,6@3500,10@3500,11@3500,16@3500,17@3500"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES, help="QUERIES@CONTEXT, comma-separated (the chunk is the context's end)")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    print(f"host: {describe()}; bf16 products here: {getattr(kernels, 'bf16_dots', lambda: False)()}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for case in a.cases.split(","):
        q_len, ctx = map(int, case.split("@"))
        nb = ctx // BS + 2
        k = (torch.randn(nb, BS, NKV, HD, generator=g) * 0.5).bfloat16()
        v = torch.randn(nb, BS, NKV, HD, generator=g).bfloat16()
        bt = torch.randperm(nb, generator=g)[: -(-ctx // BS)].long()[None]
        q = torch.randn(q_len, NH, HD, generator=g)
        cu, cl, out = torch.tensor([0, q_len]), torch.tensor([ctx]), torch.empty(q_len, NH, HD)
        row = {"queries": q_len, "context": ctx}
        for name, dots in (("float32_products", False), ("bf16_products", True)):
            # a tree from before bf16 products (an A/B run with PYTHONPATH): float32 products only
            kw = {"bf16_dots": dots} if "bf16_dots" in inspect.signature(kernels.paged_prefill_attention).parameters \
                else {}
            ts = []
            for i in range(a.repeats + 3):
                t = time.perf_counter()
                kernels.paged_prefill_attention(q, k, v, None, None, bt, cu, cl, 0.125, out, **kw)
                if i >= 3:
                    ts.append(time.perf_counter() - t)
            row[f"{name}_step_ms"] = round(sorted(ts)[len(ts) // 2] * LAYERS * 1e3, 2)
        rows.append(row)
        print(f"{q_len:4d} queries at {ctx:5d}: a step of {LAYERS} layers {row['float32_products_step_ms']:7.2f} ms "
              f"float32 products, {row['bf16_products_step_ms']:7.2f} ms bf16 products")
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
