"""The packed/dense crossover of the layers' products timed two ways on the default model (default flags):
warm, by `model/quant.py: measure_crossover` given one weight (the first layer's gate_up, on repeat: it
stays in cache; the load's probe until stop 42), and cold, as a step meets the weights (every layer's
gate_up in turn, so each product reads its weight from memory), then what the load measures now
(measure_crossover over every layer product in turn). Milliseconds per product, packed (qmatmul) / dense
copy (GEMM).

Usage: python bench/crossover_cold.py
"""
import time

import torch

from pagedserve.engine.llm import LLM
from pagedserve.model.quant import measure_crossover


def per_product_ms(fn, weights, x) -> float:
    for w in weights:                   # warm-up pass
        fn(w, x)
    best = float("inf")
    for _ in range(3):                  # the fastest of 3
        t0 = time.perf_counter()
        for w in weights:
            fn(w, x)
        best = min(best, (time.perf_counter() - t0) / len(weights))
    return best * 1e3


def main() -> None:
    llm = LLM(num_kv_blocks=64)
    model = llm.engine.model
    ws = [layer.gate_up_proj.weight for layer in model.layers]
    if not hasattr(ws[0], "_qmatmul") or ws[0].dense is None:
        raise SystemExit("the default flags did not give packed weights with dense copies on this host")
    packed = lambda w, x: w._qmatmul(x, w.int8_act)      # noqa: E731
    dense = lambda w, x: w._many_rows(x, None)            # noqa: E731
    print("warm (measure_crossover on one weight):", measure_crossover(ws[0], model.norm.dtype)[1])
    cells = []
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, ws[0].K).to(model.norm.dtype)
        cells.append(f"{m}: {per_product_ms(packed, ws, x):.3f}/{per_product_ms(dense, ws, x):.3f} ms")
    print(f"cold ({len(ws)} layers' gate_up in turn): packed/dense at rows " + ", ".join(cells))
    products = [getattr(layer, f"{p}_proj").weight for layer in model.layers for p in ("qkv", "o", "gate_up", "down")]
    print("as at load (measure_crossover on every product):", measure_crossover(products, model.norm.dtype)[1])


if __name__ == "__main__":
    main()
