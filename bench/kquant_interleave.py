"""K-quant products (Q4_K, Q6_K) with int8 activations on the file's rows against their 8-row layouts (Q4_Kx8,
Q6_Kx8: PackedWeight.interleave): random blocks in the shapes of a 768-wide, 24-layer Llama (no K-quant file is
bundled), every matrix once per step (cold, as decode reads them), best of 5.

Usage: python bench/kquant_interleave.py [Q4_K Q6_K]
"""
import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "model")]
from qmatmul import step_ms  # noqa: E402
from test_quant import random_blocks  # noqa: E402

from pagedserve.model.quant import PackedWeight  # noqa: E402

SHAPES = [(960, 768), (768, 768), (4096, 768), (768, 2048)] * 24


def main():
    for fmt in sys.argv[1:] or ["Q4_K", "Q6_K"]:
        ws = [PackedWeight(fmt, torch.from_numpy(random_blocks(fmt, n, k, seed=i)), k, int8_act=True)
              for i, (n, k) in enumerate(SHAPES)]
        grouped = [copy.copy(w) for w in ws]
        for w in grouped:
            w.interleave()
        for rows in (1, 2, 4, 8):
            a, b = step_ms(ws, rows, True), step_ms(grouped, rows, True)
            print(f"{fmt}: {rows} row(s): file rows {a:.2f} ms, {grouped[0].fmt} {b:.2f} ms ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
