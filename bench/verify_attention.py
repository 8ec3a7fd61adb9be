"""Decode attention of a speculative step's verification rows (issue 25): one sequence's decode and
its draft tokens, each row one key more, as the C kernel runs them together (each K/V tile loaded
once for the group) against the same rows run one by one (the same rows in reverse order: the kernel
groups only rows that continue one another, so each reads the context alone; same bits, same keys),
in one run. Per 30-layer step of the default model's attention shape (9 query heads, 3 KV heads,
head dim 64, 16-token blocks), each layer its own cache, visited in turn as a step visits them.

Usage: python bench/verify_attention.py [--ctx 250,1000,3000] [--rows 1,5,9] [--kv-dtype bfloat16] [--steps 30]
"""
import argparse
import time

import torch

from pagedserve import kernels
from pagedserve.host import describe

NH, NKV, HD, BS, LAYERS = 9, 3, 64, 16, 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="250,1000,3000")
    ap.add_argument("--rows", default="1,5,9")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    dt = getattr(torch, a.kv_dtype)
    print(f"host: {describe()}; {time.strftime('%Y-%m-%d')}; KV {a.kv_dtype}")
    print(f"{'context':>7} {'rows':>4} {'together ms':>11} {'one by one ms':>13} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in a.ctx.split(",")):
        for rows in (int(r) for r in a.rows.split(",")):
            lens = list(range(ctx, ctx + rows))
            nb = -(-lens[-1] // BS) + 1
            caches = [(torch.randn(nb, BS, NKV, HD, generator=g).to(dt), torch.randn(nb, BS, NKV, HD, generator=g).to(dt))
                      for _ in range(LAYERS)]
            table = torch.randperm(nb, generator=g)[None].expand(rows, -1).contiguous()
            q = torch.randn(rows, NH, HD, generator=g)
            orders = {"together": torch.tensor(lens), "apart": torch.tensor(lens[::-1])}
            qs = {"together": q, "apart": q.flip(0).contiguous()}
            best = {}
            for _ in range(2):
                for name, L in orders.items():
                    t0 = time.perf_counter()
                    for _ in range(a.steps):
                        for k, v in caches:
                            kernels.paged_decode_attention(qs[name], k, v, None, None, table, L, HD ** -0.5)
                    s = (time.perf_counter() - t0) / a.steps * 1e3
                    best[name] = min(best.get(name, s), s)
            print(f"{ctx:7d} {rows:4d} {best['together']:11.2f} {best['apart']:13.2f} "
                  f"{best['apart'] / best['together']:5.2f}x")


if __name__ == "__main__":
    main()
