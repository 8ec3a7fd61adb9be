"""Decode attention for a batch of sequences, reading K/V through block tables: the C kernel (no
copy) against the torch fallback (one batched gather of every context, padded to the longest, then
SDPA). Both on the same random cache and the same scattered block tables; prints ms per layer.

Usage: python bench/attention_read.py [--seqs 64] [--max-ctx 1200]
"""
import argparse
import json
import time

import torch

from pagedserve.kernels import native_lib, paged_decode_attention
from pagedserve.model.attention import AttentionMetadata, _decode_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--max-ctx", type=int, default=1200)
    a = ap.parse_args()
    assert native_lib() is not None, "no C compiler: the kernel could not be built"
    torch.manual_seed(0)
    D, nh, nkv, hd, bs = a.seqs, 9, 3, 64, 16        # the default model's attention shape
    lens = torch.randint(20, a.max_ctx, (D,))
    maxb = int((lens.max() + bs - 1) // bs)
    nb = D * maxb + 1
    kc, vc = torch.randn(nb, bs, nkv, hd), torch.randn(nb, bs, nkv, hd)
    bt = torch.zeros(D, maxb, dtype=torch.long)
    perm, k = torch.randperm(nb - 1) + 1, 0
    for d in range(D):
        n = (int(lens[d]) + bs - 1) // bs
        bt[d, :n] = perm[k:k + n]
        k += n
    q = torch.randn(D, nh, hd)
    md = AttentionMetadata(slot_mapping=None, num_decodes=D, decode_block_tables=bt, decode_context_lens=lens,
                           decode_mask=(torch.arange(maxb * bs)[None] < lens[:, None])[:, None, None, :])
    err = (_decode_attention(q, kc, vc, md, 0.125) - paged_decode_attention(q, kc, vc, bt, lens, 0.125)).abs().max()
    res = {"seqs": D, "mean_ctx": round(lens.float().mean().item()), "max_ctx": int(lens.max()),
           "max_abs_diff": float(err)}
    for name, f in (("torch_gather_ms", lambda: _decode_attention(q, kc, vc, md, 0.125)),
                    ("kernel_ms", lambda: paged_decode_attention(q, kc, vc, bt, lens, 0.125))):
        f()
        t = time.perf_counter()
        for _ in range(10):
            f()
        res[name] = round((time.perf_counter() - t) / 10 * 1e3, 2)
    kv_bytes = int(lens.sum()) * nkv * hd * 4 * 2
    res["kv_bytes_read_mb"] = round(kv_bytes / 1e6, 1)
    res["kernel_gb_s"] = round(kv_bytes / res["kernel_ms"] / 1e6, 1)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
