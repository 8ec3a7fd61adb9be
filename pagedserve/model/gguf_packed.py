"""A GGUF file's packed matrices, read only where they are needed (issues 51 and 56).

The loader maps the file copy-on-write (gguf's reader: one np.memmap) and gives each matrix the qmatmul
kernels read a PackedWeight whose bytes are Deferred: a meta tensor of their shape, and how to make them
from the file (a view of the mapped rows; Q5_0 / IQ4_NL rewritten to Q8_0; q/k rows permuted; fused parts
stacked). The model is built on those shapes, so the packed cache's key (packed_cache.py) is known before a
byte of them is read; on a hit the entry's bytes replace them and the file's packed tensors are never
touched. On a miss `make_packed` makes them one weight at a time, each regrouped for its kernel before the
next is read, and gives back the mapped pages it read, so the load's high-water mark stays near the
weights' final size instead of the file plus every stage of its rewriting."""
from __future__ import annotations

import mmap

import torch

from pagedserve.model.quant import AS_Q8_0, FORMATS, Deferred, Packed, PackedWeight, _meta, as_q8_0, leaves


class FileSpans:
    """The spans of one mapped GGUF file that deferred reads have touched, until their pages are given back."""

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None        # the reader's mapping (np.memmap keeps it as _mmap)
        self.read: list[tuple[int, int]] = []   # (file offset, bytes)

    def attach(self, reader) -> None:
        self.mm = getattr(reader.data, "_mmap", None)

    def release(self) -> None:
        """Drop the pages of the spans read so far from this process's memory: nothing was written to them
        (copy-on-write, never modified), so a later touch reads the same bytes back from the file (a matrix
        kept as a view of the file, one no kernel regroups, pages in again as it is used)."""
        page = mmap.PAGESIZE
        for start, n in self.read:
            lo, hi = -(-start // page) * page, (start + n) // page * page     # whole pages inside the span only
            if self.mm is not None and hi > lo:
                self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        self.read.clear()


def packed_matrix(t, spans: FileSpans) -> PackedWeight:
    """Tensor `t` of the mapped file as a PackedWeight of its kernel's format, its bytes deferred."""
    name, K, rows = t.tensor_type.name, int(t.shape[0]), int(t.data.shape[0])
    fmt = "Q8_0" if name in AS_Q8_0 else name
    width = K // FORMATS[fmt][1] * FORMATS[fmt][2]

    def make() -> torch.Tensor:
        spans.read.append((int(t.data_offset), int(t.n_bytes)))
        view = torch.from_numpy(t.data)          # the mapped rows themselves (copy-on-write: writable, no copy)
        return as_q8_0(name, view, K) if name in AS_Q8_0 else view

    return PackedWeight(fmt, _meta(rows, width), K, deferred=Deferred(make, five_bits=name == "Q5_0"))


def pending(weights: list[Packed]) -> bool:
    """Whether any of these weights' bytes are still deferred."""
    return any(p.deferred is not None for p in leaves(weights))


def make_packed(weights: list[Packed], spans: FileSpans, regroup: set[int]) -> int:
    """Every deferred weight's bytes made from the file, one weight at a time: its parts read (and stacked),
    regrouped for int8 activations if its id is in `regroup` (the kernels' products: what the model's
    choose_gemm_form would regroup after), then the file pages read for it given back. Returns the number
    of leaves made."""
    made = 0
    for w in weights:
        for p in leaves([w]):
            if p.deferred is not None:
                p.materialize()
                if id(w) in regroup:
                    p.interleave()
                spans.release()
                made += 1
    return made
