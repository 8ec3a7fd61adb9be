"""The packed-weight kernels alone: one token's worth of the model's matrices (cold: each read once,
as in decode) and each matrix in cache (hot) (bench/packed_rows.py: against the dense path); for
float32 activations (qmatmul) and int8-rounded ones (qmatmul_q8, the bf16 path) side by side, the latter
on the file's rows and on rows interleaved in groups of 8 (what a load with int8 activations makes of
them: PackedWeight.interleave).

Usage: python bench/qmatmul.py [--quantization gguf|int8] [--dtype float32|bfloat16]
"""
import argparse
import copy
import time

import torch


def step_ms(ws, rows: int, q8: bool) -> float:
    """Milliseconds for every weight in ws once (cold, as a decode step reads them) at `rows` rows of x,
    the best of 5."""
    xs = {w.K: torch.randn(rows, w.K) for w in ws}
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for w in ws:
            w._qmatmul(xs[w.K], q8)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    from pagedserve import kernels
    from pagedserve.host import cpu_info
    from pagedserve.model.loader import load_model, resolve_model
    dtype = getattr(torch, a.dtype)
    model, _ = load_model(resolve_model(None), dtype, "cpu", a.quantization)
    print(f"host: {cpu_info()[0]}; kernels {kernels.load(source='qmatmul').qmatmul_isa().decode()}; "
          f"{torch.get_num_threads()} threads; weights {model.weights_desc}")
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    ws = [getattr(layer, n).weight for layer in model.layers for n in names]
    print(f"int8-activation products: {kernels.load(source='qmatmul').qmatmul_q8_isa().decode()}")
    nbytes = sum(w.nbytes for w in ws)
    blocks_per_row = {w.K: w.K // 32 for w in ws}
    layer0 = {n: getattr(model.layers[0], n).weight for n in names}
    grouped = [copy.copy(w) for w in ws]
    for w in grouped:
        w.interleave()
    passes = [("float32 x (qmatmul)", ws, False, layer0), ("int8 x (qmatmul_q8), file rows", ws, True, layer0)]
    if grouped[0].fmt != ws[0].fmt:                    # the format has an 8-row layout
        passes.append((f"int8 x (qmatmul_q8), {grouped[0].fmt}", grouped, True, dict(zip(names, grouped))))
    for kind, pws, q8, hot in passes:
        for m in (1, 2, 4, 8):
            ms = step_ms(pws, m, q8)
            print(f"{kind}: one step of {m} row(s), cold (every layer matrix once): {ms:.2f} ms, "
                  f"{nbytes / ms / 1e6:.1f} GB/s")
        for n in names:
            w = hot[n]
            x = torch.randn(1, w.K)
            for _ in range(20):
                w._qmatmul(x, q8)
            t = time.perf_counter()
            for _ in range(200):
                w._qmatmul(x, q8)
            dt = (time.perf_counter() - t) / 200
            per_block = dt / (w.shape[0] * blocks_per_row[w.K]) * torch.get_num_threads()
            print(f"  {n:13s} {str(tuple(w.shape)):13s} hot: {1e6 * dt:7.1f} us, {1e9 * per_block:.2f} ns per 32 "
                  f"weights per thread")


if __name__ == "__main__":
    main()
