"""Dense GEMMs with bounded shapes.

Where oneDNN computes a CPU GEMM (bfloat16 and float16 on AVX-512 hosts, AMX tiles included), it JIT-
compiles a kernel and builds a primitive (code + scratchpad) for every new (M, N, K) and keeps them
in caches. A serving step's row count M is the number of tokens the scheduler put in it, which takes
hundreds of values over a day, so every new M costs a compile and memory that is not given back
(issue 22: +1.1 MiB RSS per request on an AMX host, float32 flat). Here M is padded up to a bucket:
exact up to 16 rows (decode batches), then 8 buckets per power of two (at most 12.5 % padded rows),
so a model meets at most (its weight shapes) x len(buckets_up_to(max tokens per step)) GEMM shapes
(2048 tokens: 72 buckets; the default model's 5 weight shapes: 360, within oneDNN's default primitive
cache of 1024), all of them in its first few hundred requests. float32 runs through MKL, which keeps
no per-shape state, and is not padded (its results stay exactly those of an unpadded GEMM).
Bounded is not flat: a bucket a step first reaches hundreds or thousands of requests in adds its
kernels then (~0.5 MiB a layer shape, ~4 MiB an LM-head shape, measured on an AVX512-BF16 host), so
RSS climbs in steps for as long as new buckets turn up (stop 42: 20 MiB from request 200 to 600 on
a tiny bf16 model, flat in float32). Warmup builds every bucket's kernels at load instead, as vLLM
captures its CUDA graphs for every batch size before serving: RSS reaches its level before the KV
plan reads the free memory, and no step pays a compile. `serve` defers it to the engine thread's idle
time after the port answers 200 (Warmup.step, issue 56): the first request waits for at most one
product's build, and RSS is flat once the server has had a few idle seconds."""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Hashable, Iterable

import torch
import torch.nn.functional as F

from pagedserve.host import cpu_info

EXACT_ROWS = 16             # row counts up to this are their own bucket
BUCKETS_PER_OCTAVE = 8      # above it: M rounded up to a multiple of 2**(floor(log2 M) - 3)


def bucket(m: int) -> int:
    """The row count a GEMM of m rows is computed at."""
    if m <= EXACT_ROWS:
        return m
    step = (1 << (m.bit_length() - 1)) // BUCKETS_PER_OCTAVE      # m is in [2**k, 2**(k+1)): 2**k / 8
    return -(-m // step) * step


def buckets_up_to(m: int) -> list[int]:
    """Every bucket a step of 1..m rows can use."""
    return sorted({bucket(i) for i in range(1, m + 1)})


@functools.cache
def pads_rows(dtype: torch.dtype, device_type: str) -> bool:
    """Whether GEMMs in `dtype` on this device pad their rows: bf16/fp16 on CPUs where torch gives
    them to oneDNN (AVX-512: avx512bw, avx512vl, avx512dq). PAGEDSERVE_GEMM_BUCKETS=1 or 0 decides
    instead (tests use it to run the padded path on any host)."""
    forced = os.environ.get("PAGEDSERVE_GEMM_BUCKETS")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"PAGEDSERVE_GEMM_BUCKETS must be 0 or 1, got {forced!r}")
    if forced:
        return forced == "1"
    if device_type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    flags = cpu_info()[1]
    return torch.backends.mkldnn.is_available() and all(f in flags for f in ("avx512bw", "avx512vl", "avx512dq"))


def padded(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) with zero rows appended up to bucket(M) where this dtype pads; x itself otherwise.
    Callers slice the product's first M rows."""
    m = x.shape[0]
    if not pads_rows(x.dtype, x.device.type):
        return x
    mb = bucket(m)
    if mb == m:
        return x
    out = x.new_zeros((mb, *x.shape[1:]))
    out[:m] = x
    return out


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) at a bucketed row count."""
    xp = padded(x)
    y = F.linear(xp, w, b)
    return y if xp is x else y[: x.shape[0]]


_WARMED: set[tuple[Hashable, int]] = set()    # (product key, bucket) already run in this process

Product = tuple[Hashable, Callable[[torch.Tensor], object], int, torch.dtype, int, int]


class Warmup:
    """Every bucket in (first, last] rows of each product run once, unless this process already has:
    `products` are (key, fn(x), K, x's dtype, first, last); a key names what the GEMM library keys its
    kernels by (the weight's shape, layout and dtype, the form of the call), so the layers that share
    a shape are run once, and so are engines that load the same model again. A job that `run()`
    does at once, or `step()` a slice at a time: `serve` builds them in the engine thread's idle time
    after /health answers 200 (issue 56: ~1-3.7 s of the start-up on 2 cores), a request waiting at
    most one product's build. A padded product's result does not depend on whether its bucket was
    built ahead: only when its kernel is compiled moves. `note`: why an empty job has nothing to do."""

    def __init__(self, products: Iterable[Product] = (), note: str = ""):
        self.products = list(products)
        self.note = note
        self.keys = {p[0] for p in self.products}
        self._todo = ((key, fn, k, dtype, m) for key, fn, k, dtype, first, last in self.products
                      for m in buckets_up_to(last) if m > first)
        self.done = not self.products
        self.built, self.seconds = 0, 0.0

    def step(self, budget_s: float = float("inf")) -> bool:
        """Build pending buckets for about budget_s (at least one); False once none remains (True: call again)."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for key, fn, k, dtype, m in self._todo:
                if (key, m) in _WARMED:
                    continue
                fn(torch.zeros(m, k, dtype=dtype))
                _WARMED.add((key, m))
                self.built += 1
                if time.perf_counter() - t0 >= budget_s:
                    self.seconds += time.perf_counter() - t0
                    return True
        self.seconds += time.perf_counter() - t0
        self.done = True
        return False

    def run(self) -> str:
        """Build every pending bucket now; returns the line logged."""
        self.step()
        return self.line()

    def line(self) -> str:
        if not self.products:
            return self.note
        return (f"{self.built} built ({len(self.keys)} distinct products, every row bucket) in {self.seconds:.2f} s"
                if self.done else f"{len(self.keys)} distinct products, every row bucket: pending")
