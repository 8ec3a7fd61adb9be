"""Q4_K products on the file's rows against Q4_Kx8 (rows regrouped 8 at a time, PackedWeight.interleave), with
int8 activations: random Q4_K blocks in the shapes of a 768-wide, 24-layer Llama (no Q4_K file is bundled), every
matrix once per step (cold), best of 5.

Usage: python bench/q4k_interleave.py
"""
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))
from test_quant import random_blocks
from pagedserve.model.quant import PackedWeight
shapes = [(960, 768), (768, 768), (4096, 768), (768, 2048)] * 24      # a Llama-ish 768-wide model, 24 layers
ws = [PackedWeight("Q4_K", torch.from_numpy(random_blocks("Q4_K", n, k, seed=i)), k, int8_act=True) for i, (n, k) in enumerate(shapes)]
gs = [copy.copy(w) for w in ws]
for g in gs: g.interleave()
for name, pws in (("Q4_K rows", ws), ("Q4_Kx8", gs)):
    for m in (1, 2, 4, 8):
        xs = {k: torch.randn(m, k) for k in (768, 2048)}
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for w in pws: w._qmatmul(xs[w.K], True)
            best = min(best, time.perf_counter() - t)
        print(f"{name}: {m} rows {best*1e3:.2f} ms")
