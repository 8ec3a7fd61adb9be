"""Where the packed kernels stop paying, per host: a model's layer products (and its LM head) timed at
1, 2, 4, ... 256 rows of x, packed (qmatmul_q8 on int8-rounded rows, or qmatmul on float rows) against
the many-row path (the dense copy's GEMM, or dequantize + GEMM), every weight in turn as a decode step
reads them (one weight on repeat stays in cache and flatters the dense copy). Milliseconds per product.
This is how the rows of model/quant.py's PACKED_ROWS table are read (the load times nothing: a timed
crossover moved between processes and with it the answers); the suggested row count is the largest at
which packed is within 10 % of dense.

Usage: python bench/packed_rows.py [MODEL] [--dtype auto|bfloat16|float32]
"""
import argparse
import time

import torch

PASSES = 3


@torch.inference_mode()
def per_product_ms(ws, m: int, dtype, packed: bool) -> float:
    """Milliseconds per product for every weight in ws once at m rows, the best of PASSES after a warm-up."""
    xs = {w.K: torch.randn(m, w.K).to(dtype) for w in ws}
    best = float("inf")
    for i in range(PASSES + 1):
        t0 = time.perf_counter()
        for w in ws:
            w._qmatmul(xs[w.K], w.int8_act) if packed else w._many_rows(xs[w.K], None)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 1e3 * best / len(ws)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-rows", type=int, default=256)
    a = ap.parse_args()
    from pagedserve.engine.llm import LLM
    from pagedserve.host import cpu_info
    from pagedserve.model.quant import Packed, packed_rows
    llm = LLM(model=a.model, dtype=a.dtype, num_kv_blocks=64, max_num_batched_tokens=max(256, a.max_rows))
    model = llm.engine.core.model
    layer_ws = [m.weight for layer in model.layers for m in layer.products() if isinstance(m.weight, Packed)]
    head = model.head_weight
    if not layer_ws:
        raise SystemExit("no packed weights with these flags")
    name, flags = cpu_info()
    print(f"host: {name}; {' '.join(f for f in sorted(flags) if f.startswith(('avx512', 'amx', 'avx_vnni', 'avx2')))}")
    print(f"weights: {model.weights_desc}; table says {packed_rows(layer_ws[0].int8_act)}")
    dtype = model.norm.dtype
    for label, ws in (("layers", layer_ws), ("LM head", [head] if isinstance(head, Packed) else [])):
        if not ws:
            continue
        keep, m = 0, 1
        while m <= a.max_rows:
            p, d = per_product_ms(ws, m, dtype, True), per_product_ms(ws, m, dtype, False)
            keep = m if p <= 1.1 * d else keep
            print(f"{label}: {m:4d} rows  packed {p:.3f} ms  dense {d:.3f} ms  ({d / p:.2f}x)")
            m *= 2
        print(f"{label}: packed within 10 % of dense up to {keep} rows")


if __name__ == "__main__":
    main()
