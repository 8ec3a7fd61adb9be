"""Decode attention against this machine's memory bandwidth, measured in the same run.

For each KV cache dtype: the C kernel (reads K/V in place through block tables) and the torch path
(one batched gather of every context, then SDPA) over the same scattered block tables, on the
default model's attention shape. The caches of `--layers` layers are visited in turn, as a real
step visits its layers, and together they are larger than the last-level cache, so each call
reads from memory (this host kind reports a 480 MiB L3). Bandwidth = K/V bytes the step must read
(scales included) / kernel time; the limit is a plain `tensor.sum()` over 2 GiB, measured before
and after the cases (the best of the two: on a shared host it moves by 20% within minutes).

Usage: python bench/attention_read.py [--seqs 64 --mean-ctx 613] [--seqs 4 --ctx 4000] [--kv-dtypes ...]
       python bench/attention_read.py --targets     (both of the issue's cases, every dtype)
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from roofline import read_bandwidth_gb_s  # noqa: E402

from pagedserve import kernels  # noqa: E402
from pagedserve.model.attention import AttentionMetadata, LayerKV, decode_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
NH, NKV, HD, BS = 9, 3, 64, 16          # the default model's attention shape


def make_layer(nb, dt, g):
    k, v = torch.randn(nb, BS, NKV, HD, generator=g), torch.randn(nb, BS, NKV, HD, generator=g)
    if dt != torch.int8:
        return LayerKV(k.to(dt), v.to(dt))
    ks, vs = k.abs().amax(-1) / 127, v.abs().amax(-1) / 127
    return LayerKV((k / ks[..., None]).round().to(torch.int8), (v / vs[..., None]).round().to(torch.int8), ks, vs)


def run_case(seqs, lens, dtype_name, min_bytes, repeats):
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype_name]
    maxb = int((lens.max() + BS - 1) // BS)
    nb = int(((lens + BS - 1) // BS).sum()) + 1
    per_tok = NKV * (HD * dt.itemsize + (4 if dt == torch.int8 else 0)) * 2
    step_bytes = int(lens.sum()) * per_tok
    n_layers = max(2, -(-min_bytes // step_bytes))
    layers = [make_layer(nb, dt, g) for _ in range(n_layers)]
    bt = torch.zeros(seqs, maxb, dtype=torch.long)
    perm, k = torch.randperm(nb - 1, generator=g) + 1, 0
    for d in range(seqs):
        n = (int(lens[d]) + BS - 1) // BS
        bt[d, :n] = perm[k:k + n]
        k += n
    q = torch.randn(seqs, NH, HD, generator=g)
    md = AttentionMetadata(slot_mapping=None, num_decodes=seqs, decode_block_tables=bt, decode_context_lens=lens,
                           native=True)
    md_t = AttentionMetadata(slot_mapping=None, num_decodes=seqs, decode_block_tables=bt, decode_context_lens=lens)
    out = torch.empty_like(q)
    err = (decode_attention(q, layers[0], md_t, 0.125) - decode_attention(q, layers[0], md, 0.125, out)).abs().max()

    def timed(f):
        for lay in layers:
            f(lay)
        t = time.perf_counter()
        for _ in range(repeats):
            for lay in layers:
                f(lay)
        return (time.perf_counter() - t) / (repeats * len(layers))
    kern = timed(lambda lay: decode_attention(q, lay, md, 0.125, out))
    gather = timed(lambda lay: decode_attention(q, lay, md_t, 0.125)) if repeats else None
    gb_s = step_bytes / kern / 1e9
    return {"kv_dtype": dtype_name, "seqs": seqs, "mean_ctx": round(lens.float().mean().item()),
            "max_ctx": int(lens.max()), "layers_cycled": n_layers, "kv_mb_per_layer": round(step_bytes / 1e6, 1),
            "kernel_ms": round(kern * 1e3, 3), "torch_gather_ms": round(gather * 1e3, 3),
            "kernel_gb_s": round(gb_s, 1),
            "max_abs_diff_vs_torch": float(err)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--mean-ctx", type=int, default=613, help="contexts uniform in [20, 2 x mean - 20]")
    ap.add_argument("--ctx", type=int, default=None, help="every context this long instead")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--targets", action="store_true", help="64 x mean 613 and 4 x 4,000, every dtype")
    ap.add_argument("--min-mib", type=int, default=1536, help="K/V visited per round, in MiB (> the L3)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    assert kernels.load() is not None, "no C compiler: the kernel could not be built"
    bw0 = read_bandwidth_gb_s(torch)
    g = torch.Generator().manual_seed(1)
    cases = [(64, 613, None), (4, None, 4000)] if a.targets else [(a.seqs, a.mean_ctx, a.ctx)]
    results = []
    for seqs, mean, ctx in cases:
        lens = torch.full((seqs,), ctx) if ctx else torch.randint(20, 2 * mean - 20, (seqs,), generator=g)
        for name in a.kv_dtypes.split(","):
            results.append(run_case(seqs, lens, name, a.min_mib * 2**20, a.repeats))
    bw = max(bw0, read_bandwidth_gb_s(torch))
    print(f"read bandwidth (sum over 2 GiB, best of before/after): {bw:.1f} GB/s | kernels: "
          f"{kernels.load()._name.rsplit('/', 1)[-1]} | {torch.get_num_threads()} threads")
    for r in results:
        r["read_gb_s"] = round(bw, 1)
        r["of_read_bandwidth"] = round(r["kernel_gb_s"] / bw, 2)
        print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
