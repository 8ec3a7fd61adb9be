"""The int8-activation products of a real GGUF file, one at a time, in CPU time of the calling thread (one
kernel thread): each distinct (type, shape) of the layers and the LM head, as the default load packs them
(8-row layouts), at 1..8 rows of x. Cold: every layer's matrix of that kind once in turn (as a decode step
reads them); hot: layer 0's again and again (in cache: the kernel's instructions alone). With --against REV
the qmatmul.c of that git revision is built beside the working tree's and the two are timed alternately in
this one process (each repetition runs old, then new), so a busy host loads both alike; best and median.

Usage: python bench/qmatmul_cpu.py --model FILE.gguf [--against HEAD] [--rows 1 8] [--reps 15]
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import gguf
import numpy as np
import torch

from pagedserve import kernels
from pagedserve.model import quant
from pagedserve.model.quant import PackedWeight

PRODUCTS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
            "ffn_up": "up", "ffn_down": "down"}


def build_at(rev: str | None, extra: list[str] = ()) -> ctypes.CDLL:
    """qmatmul.c as of git revision `rev` (None: the working tree's), compiled with the flags load() uses for
    this host's best level and `extra` ones (-DPREFETCH_ROWS=16: a variant)."""
    here = os.path.dirname(kernels.__file__)
    tmp = tempfile.mkdtemp(prefix="qmatmul-")
    for name in ("qmatmul.c", "vec16.h"):
        if rev is None:
            with open(os.path.join(here, name), "rb") as f:
                src = f.read()
        else:
            src = subprocess.run(["git", "show", f"{rev}:pagedserve/kernels/{name}"], cwd=here, check=True,
                                 capture_output=True).stdout
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(src)
    level = kernels.host_levels()[0]
    cc = kernels.compiler()
    _, flags = kernels.build_path(level, cc, "qmatmul")
    out = os.path.join(tmp, "qmatmul.so")
    subprocess.run([cc, *flags, *extra, os.path.join(tmp, "qmatmul.c"), "-o", out, "-lm"], check=True)
    lib = ctypes.CDLL(out)
    kernels._declare(lib, "qmatmul")
    return lib


def packed(t) -> PackedWeight:
    """A GGUF tensor as the default load packs it for int8 activations (Q5_0 as Q8_0, then 8-row groups)."""
    n, k = int(t.shape[1]), int(t.shape[0])
    data = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(n, -1).copy())
    fmt = t.tensor_type.name
    if fmt in quant.AS_Q8_0:
        data, fmt = quant.as_q8_0(fmt, data, k), "Q8_0"
    w = PackedWeight(fmt, data, k, int8_act=True)
    w.interleave()
    return w


def call(lib, w: PackedWeight, x: torch.Tensor, out: torch.Tensor) -> None:
    fmt, _, _ = quant.FORMATS[w.fmt]
    lib.qmatmul_q8(x.data_ptr(), x.shape[0], x.shape[1], w.K, w.data.data_ptr(), fmt, w.shape[0],
                   w.data.shape[1], out.data_ptr(), out.shape[1])


def cpu_us(lib, ws: list[PackedWeight], x: torch.Tensor, out: torch.Tensor) -> float:
    t = time.thread_time()
    for w in ws:
        call(lib, w, x, out)
    return (time.thread_time() - t) * 1e6 / len(ws)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--against", help="git revision whose qmatmul.c is timed beside the working tree's")
    ap.add_argument("--cflags", default="", help="extra compiler flags for the working tree's build")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", nargs="*", help="product names (q k v o gate up down head) to time")
    a = ap.parse_args()
    torch.set_num_threads(1)
    libs = {"new": build_at(None, a.cflags.split()) if a.cflags else kernels.load(source="qmatmul")}
    if a.against:
        libs = {"old": build_at(a.against), **libs}
    for lib in libs.values():
        lib.set_threads(1)
    r = gguf.GGUFReader(a.model)
    kinds: dict[tuple[str, str, int, int], list] = {}
    for t in r.tensors:
        parts = t.name.split(".")
        name = "head" if t.name == "output.weight" else PRODUCTS.get(parts[2]) if parts[0] == "blk" else None
        if name is None or not t.name.endswith(".weight") or (a.only and name not in a.only):
            continue
        kinds.setdefault((name, t.tensor_type.name, int(t.shape[1]), int(t.shape[0])), []).append(t)
    print(f"{os.path.basename(a.model)}; {libs['new'].qmatmul_q8_isa().decode()}; one thread; load "
          f"{os.getloadavg()[0]:.1f}; us of thread CPU time a product, best / median of {a.reps}")
    for (name, ftype, n, k), ts in kinds.items():
        ws = [packed(t) for t in ts]
        for m in a.rows:
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            hot = [ws[0]] * 8
            res = {key: {"cold": [], "hot": []} for key in libs}
            for _ in range(a.reps):
                for key, lib in libs.items():
                    res[key]["cold"].append(cpu_us(lib, ws, x, out))
                    res[key]["hot"].append(cpu_us(lib, hot, x, out))
            line = f"{name:5s} {ftype:5s}->{ws[0].fmt:7s} {n:6d}x{k:<5d} M={m}:"
            for how in ("cold", "hot"):
                for key in libs:
                    v = res[key][how]
                    line += f"  {how} {key} {min(v):8.1f} / {statistics.median(v):8.1f}"
                if "old" in libs:
                    line += f" ({min(res['old'][how]) / min(res['new'][how]):.2f}x)"
            print(line, flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
