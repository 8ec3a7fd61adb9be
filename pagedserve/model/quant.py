"""Weights kept quantized in memory (`--quantization auto | gguf | int8`) and multiplied in that form.

A PackedWeight is N rows (output channels) of K inputs, each row a run of quantized blocks:
the GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, read as they lie in the file) or our
per-channel int8 (`quantize_int8`, one float32 scale per row). pagedserve/kernels/qmatmul.c
multiplies few-row batches straight from the blocks (decode: the weight bytes are the cost, and
Q4_1 is ~5 bits a weight against 32); steps of more decode rows than the host kind's table says
(`packed_rows`), and every step carrying prompt rows, take the dense copy (or dequantized tiles)
and torch's GEMM (AMX / AVX512-BF16 where present).

`--quantization auto` (the default) keeps a GGUF file's blocks packed for the few-row products, beside
a dense copy in the compute dtype for the many-row ones where `dense_copy_plan`'s fixed rule gives one (a
small model's products: DENSE_COPY_MODEL_BYTES; `PackedWeight.dense`): prompts through the copy, generated
tokens packed up to the host kind's row count. A weight without a copy takes steps of up to `uncopied_rows`
rows packed, prompt rows too, and dequantized tiles above. All a function of the step and the file, never
of a timing, so every start answers alike. `--quantization gguf` keeps only the blocks (1/5 of the memory;
many-row products dequantize a tile at a time).

Few-row products round the activations to int8 per 32 values (GGUF's Q8 blocks, as llama.cpp does)
and multiply in integers (`qmatmul_q8`: VNNI's vpdpbusd, AVX2's vpmaddubsw) unless `--dtype float32`
was asked for: then they stay float32 (`qmatmul`), computing what the dequantized model computes.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.host import available_memory_bytes
from pagedserve.model.gemm import gemm, padded

# format -> (kernel code, weights per block, bytes per block)
FORMATS: dict[str, tuple[int, int, int]] = {
    "I8": (0, 1, 1), "Q8_0": (1, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
    "Q4_K": (4, 256, 144), "Q6_K": (5, 256, 210),
    # the file's rows interleaved in groups of 8 for int8 activations (PackedWeight.interleave)
    "Q4_0x8": (6, 32, 18), "Q4_1x8": (7, 32, 20), "Q8_0x8": (8, 32, 34), "I8x8": (9, 1, 1),
    "Q4_Kx8": (10, 256, 148),       # 4 bytes more a super-block: the 6-bit scales unpacked to bytes
    "Q6_Kx8": (11, 256, 210),
    "Q5_0x8": (12, 32, 22),         # Q8_0 rows whose quants fit 5 bits (a Q5_0 file's): nibbles + a high-bit plane
}
INTERLEAVED = {"Q4_0": "Q4_0x8", "Q4_1": "Q4_1x8", "Q8_0": "Q8_0x8", "I8": "I8x8", "Q4_K": "Q4_Kx8",
               "Q6_K": "Q6_Kx8"}
GROUPED = frozenset(INTERLEAVED.values()) | {"Q5_0x8"}
QUANTIZATIONS = ("none", "int8", "gguf")          # what the loader builds; "auto" resolves to one of them
DENSE_COPY_SHARE = 0.5    # auto: the dense copy is kept only when it takes at most this share of free memory
TILE_WEIGHTS = 1 << 21    # weights dequantized at a time for many-row GEMMs (4 MiB in bf16)
# A matrix of up to this many weights is dequantized whole into one reused buffer and multiplied by the GEMM a
# dense copy takes (pagedserve.model.gemm): tiles of TILE_WEIGHTS cost 2-5x that (per-tile F.linear and strided
# writes; a Qwen2.5-1.5B Q4_K gate_up at 256 rows: 805 ms tiles, 165 + 80 ms GEMM + dequantization, AMD).
# 64M weights: a 128 MiB buffer in bf16 at most; larger matrices (a 150k-vocabulary LM head) go by tiles.
WHOLE_WEIGHTS = 1 << 26


@dataclass(frozen=True, slots=True)
class Deferred:
    """A packed weight's bytes not made yet (the loader's: rows of the mapped model file, rewritten, permuted
    or stacked): made on first need (`PackedWeight.materialize`), or never where the packed cache's entry
    replaces them, so a warm load reads none of the file's packed tensors."""

    make: Callable[[], torch.Tensor]    # -> the (N, row bytes) uint8 data
    five_bits: bool = False             # Q8_0 rows rewritten from Q5_0 (as_q8_0): they regroup denser


class Packed:
    """What a packed product is to the model (PackedLinear, FusedDecode): one matrix's rows as the qmatmul
    kernels read them, up to small_m rows of x in-register, dense above."""

    __slots__ = ()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, prompt: bool = False) -> torch.Tensor:
        """x (M, K) @ W.T -> (M, N) in x's dtype: packed up to small_m rows, the dense copy or dequantized
        tiles above. `prompt` (the step carries prompt rows): the dense copy at any row count where there is
        one, so a prompt is read by the same arithmetic whatever its length or company."""
        if x.shape[0] > self.small_m or (prompt and self.dense is not None):
            return self._many_rows(x, bias)
        y = self._qmatmul(x, self.int8_act)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if bias is None else y + bias

    def _many_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dense is not None:
            return gemm(x if x.dtype == self.dense.dtype else x.to(self.dense.dtype), self.dense, bias)
        return self._dense_matmul(x, bias)

    def _qmatmul(self, x: torch.Tensor, int8_act: bool = False) -> torch.Tensor:
        """The in-register kernels: x in float32, or rounded to int8 blocks of 32 (`int8_act`)."""
        x32 = x.float().contiguous()
        out = torch.empty(x32.shape[0], self.shape[0], dtype=torch.float32)
        self._qmatmul_into(x32, int8_act, out, 0)
        return out


@dataclass(eq=False, slots=True)
class PackedWeight(Packed):
    fmt: str                    # a key of FORMATS
    data: torch.Tensor          # (N, row_bytes) uint8
    K: int                      # inputs per row
    small_m: int = 8            # decode rows up to which qmatmul takes the product (packed_rows, at load)
    int8_act: bool = False      # few-row products round x to int8 blocks (set at load: int8_activations)
    dense: torch.Tensor | None = None   # (N, K) in the compute dtype for many-row products (--quantization auto)
    deferred: Deferred | None = None    # bytes not made yet: `data` is a meta tensor of their shape

    def __post_init__(self) -> None:
        _, per_block, block_bytes = FORMATS[self.fmt]
        want = 4 + self.K if self.fmt in ("I8", "I8x8") else self.K // per_block * block_bytes
        if self.K % 32 or self.K % per_block or self.data.dtype != torch.uint8 or self.data.dim() != 2 \
                or self.data.shape[1] != want:
            raise ValueError(f"{self.fmt} weight of {self.K} inputs needs ({self.K // 32} x 32)-input rows of "
                             f"{want} bytes, got {tuple(self.data.shape)} {self.data.dtype}")
        self.data = self.data.contiguous()

    def materialize(self) -> None:
        """Deferred bytes made real (nothing when they are)."""
        if self.deferred is not None:
            self.data, self.deferred = self.deferred.make().contiguous(), None

    @property
    def grouped(self) -> bool:
        """Rows interleaved 8 at a time (interleave): int8 activations only."""
        return self.fmt in GROUPED

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.K

    @property
    def nbytes(self) -> int:
        """The packed bytes and the dense copy's, if any."""
        return self.data.numel() + (0 if self.dense is None else self.dense.numel() * self.dense.element_size())

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """All rows (or the given row indices: embedding lookups) as a dense (n, K) tensor."""
        self.materialize()
        n = self.data.shape[0] if rows is None else rows.numel()
        native = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32      # what the kernel writes
        if out is None or out.dtype != native:
            out = torch.empty(n, self.K, dtype=native)
        idx = None if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
        if idx is not None and idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < self.data.shape[0]):
            raise IndexError(f"row index out of range for {self.data.shape[0]} rows")    # as nn.Embedding would
        self._dequant_into(out, idx)
        return out if out.dtype == dtype else out.to(dtype)

    def _dequant_into(self, out: torch.Tensor, idx: torch.Tensor | None = None, first: int = 0) -> None:
        """Rows idx (or rows first .. first + len(out)) into out, float32 or bfloat16."""
        _lib().qdequant(self.data[first].data_ptr(), FORMATS[self.fmt][0], self.K, self.data.shape[1],
                        None if idx is None else idx.data_ptr(), out.shape[0], out.data_ptr(),
                        int(out.dtype == torch.bfloat16))

    def interleave(self) -> None:
        """For int8 activations (qmatmul_q8): the rows regrouped 8 at a time, so one vpdpbusd multiplies
        4 inputs with 8 output rows (each format's layout is described in qmatmul.c, after ggml's
        Q4_0_8x8): per 32-block the 8 rows' scales, then their bytes 4 at a time (8-bit weights + 128,
        unsigned; I8's row scales once, first; the K-quants keep their super-blocks). The file's bytes
        (Q4_K: +3 %, its 6-bit scales as bytes); dequantize still gives the file's rows. A matrix whose
        N is not a multiple of 8 stays as it is. Done once at load, after every row-wise change (fusing,
        permuting, dense copies)."""
        self.materialize()
        fmt, N = INTERLEAVED.get(self.fmt), self.data.shape[0]
        if fmt is None or N % 8:
            return
        if self.fmt == "Q8_0" and _fits_5_bits(self.data, self.K):    # a Q5_0 file's rows (as_q8_0): 5.5 bits
            self.data, self.fmt = _interleave_q5_0(self.data, self.K), "Q5_0x8"     # a weight read, not 8.5
            return
        nb, bb = self.K // 32, FORMATS[self.fmt][2]
        if self.fmt in ("Q4_K", "Q6_K"):
            self.data, self.fmt = (_interleave_q4k if self.fmt == "Q4_K" else _interleave_q6k)(self.data, self.K), fmt
            return
        if self.fmt == "I8":                                    # [f32 scale][K x int8] per row
            scales = self.data[:, :4].reshape(N // 8, 32)
            q = (self.data[:, 4:] ^ 0x80).reshape(N // 8, 8, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(N // 8, -1)
            self.data, self.fmt = torch.cat([scales, q], -1).reshape(N, 4 + self.K).contiguous(), fmt
            return
        head = 4 if self.fmt == "Q4_1" else 2                   # f16 d (and Q4_1's f16 m) before the bytes
        g = self.data.view(N // 8, 8, nb, bb).transpose(1, 2)  # (groups, blocks, 8 rows, block bytes)
        scales = g[..., :head].reshape(N // 8, nb, 8, head // 2, 2).transpose(2, 3).reshape(N // 8, nb, 8 * head)
        q = g[..., head:] ^ 0x80 if self.fmt == "Q8_0" else g[..., head:]
        q = q.reshape(N // 8, nb, 8, -1, 4).transpose(2, 3).reshape(N // 8, nb, -1)
        self.data = torch.cat([scales, q], -1).reshape(N, nb * bb).contiguous()
        self.fmt = fmt

    def _dense_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Dequantize TILE_WEIGHTS at a time (a few MB that stay in cache) and multiply each tile, at
        x's bucketed row count (pagedserve.model.gemm)."""
        N = self.data.shape[0]
        rows = min(N, max(16, TILE_WEIGHTS // self.K) // 8 * 8)     # whole groups of 8 (interleaved)
        if x.dtype not in (torch.float32, torch.bfloat16):        # the kernel writes only those two
            return gemm(x, self.dequantize(x.dtype), bias)
        if N * self.K <= WHOLE_WEIGHTS:       # the whole matrix into one reused buffer, then the copy's own GEMM
            scratch = _scratch(x.dtype, N * self.K).view(N, self.K)
            self._dequant_into(scratch)
            return gemm(x, scratch, bias)
        m, x = x.shape[0], padded(x)
        scratch = _scratch(x.dtype, rows * self.K)
        if rows == N:
            self._dequant_into(scratch.view(N, self.K))
            out = F.linear(x, scratch.view(N, self.K), bias)
            return out if x.shape[0] == m else out[:m]
        out = torch.empty(x.shape[0], N, dtype=x.dtype)
        for n0 in range(0, N, rows):
            tile = scratch[: (min(N, n0 + rows) - n0) * self.K].view(-1, self.K)
            self._dequant_into(tile, first=n0)
            out[:, n0:n0 + tile.shape[0]] = F.linear(x, tile)
        out = out if x.shape[0] == m else out[:m]
        return out if bias is None else out + bias

    @property
    def packed_bytes(self) -> int:
        return self.data.numel()

    def _qmatmul_into(self, x32: torch.Tensor, int8_act: bool, out: torch.Tensor, col: int) -> None:
        """out[:, col:col + N] = x32 (float32, contiguous) @ W.T: out's rows are its full width apart."""
        if self.grouped and not int8_act:
            raise ValueError(f"{self.fmt} weights are multiplied with int8 activations only")
        lib, N = _lib(), self.data.shape[0]
        (lib.qmatmul_q8 if int8_act else lib.qmatmul)(x32.data_ptr(), x32.shape[0], self.K, self.K,
                                                      self.data.data_ptr(), FORMATS[self.fmt][0], N,
                                                      self.data.shape[1], out[:, col:].data_ptr(), out.shape[1])

    def permute_rows(self, perm: torch.Tensor) -> PackedWeight:
        if self.grouped:
            raise ValueError("an interleaved weight's rows are not permuted (interleave after)")
        if self.deferred is not None:
            later = Deferred(lambda make=self.deferred.make: make()[perm], self.deferred.five_bits)
            return PackedWeight(self.fmt, _meta(*self.data.shape), self.K, self.small_m, self.int8_act, deferred=later)
        return PackedWeight(self.fmt, self.data[perm], self.K, self.small_m, self.int8_act,
                            None if self.dense is None else self.dense[perm])


def _meta(rows: int, width: int) -> torch.Tensor:
    """A deferred weight's stand-in: its bytes' shape, no storage (made directly: torch.cat or indexing on meta
    tensors imports torch._dynamo, ~3 s and ~100 MB)."""
    return torch.empty(rows, width, dtype=torch.uint8, device="meta")


def _by_rows(rewrite, data: torch.Tensor, rows: int) -> torch.Tensor:
    """A row-wise rewrite of (N, row bytes) done `rows` at a time, so its temporaries stay small."""
    return torch.cat([rewrite(data[i:i + rows]) for i in range(0, data.shape[0], rows)])


def _fits_5_bits(data: torch.Tensor, K: int) -> bool:
    """Whether every quant of these Q8_0 rows lies in [-16, 15] (Q5_0's range)."""
    q = data.view(data.shape[0], K // 32, 34)[..., 2:].view(torch.int8)
    return bool(((q >= -16) & (q <= 15)).all())


def _interleave_q5_0(data: torch.Tensor, K: int) -> torch.Tensor:
    """Q8_0 rows whose quants fit 5 bits as Q5_0x8 (qmatmul.c): per 8 rows and 32-block, d x 8, the Q5_0
    nibbles in Q4_0x8's chunks (lane c: row c's bytes 4h .. 4h+3; low nibble input i, high nibble 16 + i),
    then each row's 32 fifth bits as a u32 (bit i: input i), of q + 16 in 0..31. 22 bytes a block, as the file's."""
    if data.shape[0] > (rows := max(8, (1 << 21) // K // 8 * 8)):     # whole groups of 8, a slice at a time
        return _by_rows(lambda d: _interleave_q5_0(d, K), data, rows)
    N, nb = data.shape[0], K // 32
    b, G = data.view(N, nb, 34), N // 8
    u = b[..., 2:].view(torch.int8).to(torch.int64) + 16                        # (N, nb, 32) in 0..31
    qs = ((u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)).to(torch.uint8)       # (N, nb, 16)
    qh = (((u >> 4) & 1) << torch.arange(32)).sum(-1).view(torch.uint8).view(N, nb, 8)[..., :4]   # little-endian u32
    d = b[..., :2].reshape(G, 8, nb, 2).transpose(1, 2).reshape(G, nb, 16)
    qs = qs.reshape(G, 8, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(G, nb, 128)
    qh = qh.reshape(G, 8, nb, 4).transpose(1, 2).reshape(G, nb, 32)
    return torch.cat([d, qs, qh], -1).reshape(N, nb * 22).contiguous()


def _interleave_q4k(data: torch.Tensor, K: int) -> torch.Tensor:
    """Q4_K rows (144-byte super-blocks) as Q4_Kx8 (qmatmul.c): per 8 rows and super-block, d x 8, dmin x 8,
    the sub-block scales and minima as bytes [sub-block][row], then each sub-block pair's 32 bytes a row
    in 8 chunks of 4 bytes a row."""
    N, ns = data.shape[0], K // 256
    g = data.view(N // 8, 8, ns, 144).transpose(1, 2)               # (groups, super-blocks, 8 rows, 144)
    d, dmin = (g[..., o:o + 2].reshape(N // 8, ns, 16) for o in (0, 2))
    q = g[..., 4:16].to(torch.int16)                                 # ggml's get_scale_min_k4, for all 8
    lo, hi = q[..., :4], q[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)
    mn = torch.cat([q[..., 4:8] & 63, (hi >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    sc, mn = (t.to(torch.uint8).transpose(-1, -2).reshape(N // 8, ns, 64) for t in (sc, mn))
    qs = g[..., 16:].reshape(N // 8, ns, 8, 4, 8, 4).permute(0, 1, 3, 4, 2, 5).reshape(N // 8, ns, 1024)
    return torch.cat([d, dmin, sc, mn, qs], -1).reshape(N, ns * 148).contiguous()


def _interleave_q6k(data: torch.Tensor, K: int) -> torch.Tensor:
    """Q6_K rows (210-byte super-blocks) as Q6_Kx8 (qmatmul.c): per 8 rows and super-block, d x 8, the int8
    scales [group][row], then the ql and qh bytes in chunks of 4 bytes a row per 32-byte run."""
    N, ns = data.shape[0], K // 256
    g = data.view(N // 8, 8, ns, 210).transpose(1, 2)               # (groups, super-blocks, 8 rows, 210)
    d = g[..., 208:210].reshape(N // 8, ns, 16)
    sc = g[..., 192:208].transpose(-1, -2).reshape(N // 8, ns, 128)
    ql = g[..., :128].reshape(N // 8, ns, 8, 4, 8, 4).permute(0, 1, 3, 4, 2, 5).reshape(N // 8, ns, 1024)
    qh = g[..., 128:192].reshape(N // 8, ns, 8, 2, 8, 4).permute(0, 1, 3, 4, 2, 5).reshape(N // 8, ns, 512)
    return torch.cat([d, sc, ql, qh], -1).reshape(N, ns * 210).contiguous()


class PackedParts(Packed):
    """Rows of differently packed weights stacked: a fused projection whose parts the file gives
    different types (q|k|v where a Q4_K_M file has v in Q6_K, or gate|up of mixed recipes). Each part
    is multiplied by its own kernel into its own columns of one output, so every part stays packed; the
    many-row path has one dense copy of the whole matrix (or dequantizes part by part)."""

    __slots__ = ("parts", "dense")

    def __init__(self, parts: Sequence[PackedWeight]):
        if len(parts) < 2 or len({p.K for p in parts}) != 1 or not all(isinstance(p, PackedWeight) for p in parts):
            raise ValueError("PackedParts stacks two or more PackedWeights of one K, got "
                             + ", ".join(f"{type(p).__name__} {getattr(p, 'shape', '')}" for p in parts))
        self.parts, self.dense = list(parts), None

    @property
    def fmt(self) -> str:
        return "+".join(p.fmt for p in self.parts)

    @property
    def K(self) -> int:
        return self.parts[0].K

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.data.shape[0] for p in self.parts), self.K

    @property
    def grouped(self) -> bool:
        return all(p.grouped for p in self.parts)

    @property
    def packed_bytes(self) -> int:
        return sum(p.packed_bytes for p in self.parts)

    @property
    def nbytes(self) -> int:
        return self.packed_bytes + (0 if self.dense is None else self.dense.numel() * self.dense.element_size())

    @property
    def small_m(self) -> int:
        return self.parts[0].small_m

    @small_m.setter
    def small_m(self, m: int) -> None:
        for p in self.parts:
            p.small_m = m

    @property
    def int8_act(self) -> bool:
        return self.parts[0].int8_act

    @int8_act.setter
    def int8_act(self, on: bool) -> None:
        for p in self.parts:
            p.int8_act = on

    def interleave(self) -> None:
        for p in self.parts:
            p.interleave()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def _dense_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.cat([p._dense_matmul(x, None) for p in self.parts], -1)
        return out if bias is None else out + bias

    def _qmatmul_into(self, x32: torch.Tensor, int8_act: bool, out: torch.Tensor, col: int) -> None:
        for p in self.parts:
            p._qmatmul_into(x32, int8_act, out, col)
            col += p.data.shape[0]


def stack_rows(parts: list[PackedWeight]) -> Packed:
    """Fused projections (q|k|v, gate|up): one PackedWeight where the parts share a format, else the
    runs of one format each stacked (PackedParts)."""
    # a Q5_0 file's rows (Q8_0 after as_q8_0) apart from wider Q8_0 ones: they regroup denser (interleave)
    kinds = [(p.fmt, p.deferred.five_bits if p.deferred else p.fmt == "Q8_0" and _fits_5_bits(p.data, p.K))
             for p in parts]
    runs: list[list[PackedWeight]] = []
    for i, p in enumerate(parts):
        if i and kinds[i] == kinds[i - 1]:
            runs[-1].append(p)
        else:
            runs.append([p])
    stacked = [cat_rows(r) if len(r) > 1 else r[0] for r in runs]
    return stacked[0] if len(stacked) == 1 else PackedParts(stacked)


# GGUF types the kernels read after a lossless rewrite at load: each 32-block's values are d (f16) times
# small integers, so they are Q8_0 blocks exactly (the same d, the integers as int8). 8.5 bits a weight
# read instead of 5.5 (Q5_0) / 4.5 (IQ4_NL): a kernel of their own would read less.
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)     # ggml's kvalues_iq4nl
AS_Q8_0 = ("Q5_0", "IQ4_NL")


def as_q8_0(fmt: str, data: torch.Tensor, K: int) -> torch.Tensor:
    """(N, row bytes) of Q5_0 (f16 d, u32 high bits, 16 bytes of nibbles: w = d (q - 16)) or IQ4_NL (f16 d,
    16 bytes of nibble indices: w = d table[q]) blocks -> the same values as Q8_0 blocks (f16 d, 32 x int8).
    Nibble j holds element j (low half) and element j + 16 (high half), as ggml lays them."""
    if data.shape[0] > (rows := max(1, (1 << 22) // K)):     # the widened temporaries: ~16 bytes a weight
        return _by_rows(lambda d: as_q8_0(fmt, d, K), data, rows)
    N, nb = data.shape[0], K // 32
    bb = {"Q5_0": 22, "IQ4_NL": 18}[fmt]
    b = data.reshape(N, nb, bb)
    d, qs = b[..., :2], b[..., bb - 16:].to(torch.int16)
    q = torch.cat([qs & 15, qs >> 4], -1)                                       # (N, nb, 32): elements 0..31
    if fmt == "Q5_0":
        qh = b[..., 2:6].to(torch.int64)
        bits = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        high = (bits[..., None] >> torch.arange(32)) & 1
        q = (q | (high << 4).to(torch.int16)) - 16
    else:
        q = torch.tensor(IQ4NL_VALUES, dtype=torch.int16)[q.long()]
    return torch.cat([d, q.to(torch.int8).view(torch.uint8)], -1).reshape(N, nb * 34).contiguous()


def choose_quantization(asked: str, source_kind: str, dtype_asked: str, device: str,
                        tp_size: int) -> tuple[str, bool, str]:
    """What `--quantization` builds ("none" | "gguf" | "int8"), whether packed weights get a dense copy
    for many-row products, and why (logged at load). `auto` keeps a
    GGUF file's blocks packed for the few-row products (beside a dense copy: see the module doc) on
    one CPU rank; it is dense (none) for an HF folder (its weights are not quantized: `int8` would
    change them), for `--dtype float32` (the exact path: what HF computes, batch-invariant), on CUDA
    (the packed kernels are CPU code) and under tensor parallelism (packed weights are not sharded)."""
    if asked != "auto":
        return asked, False, f"--quantization {asked}"
    if device != "cpu":
        return "none", False, f"auto: dense on {device} (the packed kernels run on CPUs)"
    if tp_size > 1:
        return "none", False, "auto: dense under tensor parallelism (packed weights are not sharded)"
    if source_kind != "gguf":
        return "none", False, "auto: dense (an HF folder's weights are not quantized; --quantization int8 would round them)"
    if dtype_asked == "float32":
        return "none", False, "auto: dense for --dtype float32 (the exact path: HF's arithmetic, batch-invariant)"
    if kernels.load(source="qmatmul") is None:
        return "none", False, "auto: dense (the native qmatmul kernels could not be built)"
    return "gguf", True, ("auto: the GGUF file's blocks packed for few-row products, dense copies for many-row ones "
                          "where dense_copy_plan gives them")


def int8_activations(dtype_asked: str, quantization: str) -> tuple[bool, str]:
    """Whether few-row products with packed weights round their activations to int8 blocks, and why:
    yes unless `--dtype float32` was asked for (the exact path: what the dequantized model computes).
    With bfloat16 / float16 the activations are rounded anyway; with `auto` the default is held to the
    closeness rule on every host (it is bfloat16 on AMX / AVX512-BF16 hosts, float32 elsewhere).
    PAGEDSERVE_INT8_ACTIVATIONS=0|1 decides instead (an A/B knob for benchmarks)."""
    if quantization == "none":
        return False, "no packed weights"
    env = os.environ.get("PAGEDSERVE_INT8_ACTIVATIONS")
    if env in ("0", "1"):
        return env == "1", "PAGEDSERVE_INT8_ACTIVATIONS"
    if dtype_asked == "float32":
        return False, "--dtype float32: the exact path"
    return True, f"--dtype {dtype_asked}: held to the closeness rule"


def leaves(weights: list[Packed]) -> list[PackedWeight]:
    """Every PackedWeight under these packed weights (a fused one's parts), in order."""
    return [p for w in weights for p in (w.parts if isinstance(w, PackedParts) else [w])]


def interleaves(int8_act: bool) -> bool:
    """Whether packed weights are regrouped 8 rows at a time (PackedWeight.interleave): for int8 activations,
    unless PAGEDSERVE_INTERLEAVE=0 (an A/B knob for benchmarks)."""
    return int8_act and os.environ.get("PAGEDSERVE_INTERLEAVE") != "0"


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """What qmatmul_q8 multiplies: x (M, K) rounded to int8 per 32 values (d = max|x| / 127, round half
    to even), as float32. The reference for tests and accuracy figures."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Fused projections (q|k|v, gate|up): rows stacked; the parts must share format and K."""
    if len({(p.fmt, p.K) for p in parts}) != 1:
        raise ValueError("cannot fuse packed weights of different formats: " + ", ".join(p.fmt for p in parts))
    if parts[0].fmt in GROUPED:
        raise ValueError("interleaved weights are not fused (interleave after)")
    if any(p.deferred for p in parts):        # made when the stack is: one product's parts at a time
        make = lambda: torch.cat([p.deferred.make() if p.deferred else p.data for p in parts])   # noqa: E731
        later = Deferred(make, all(p.deferred and p.deferred.five_bits for p in parts))
        return PackedWeight(parts[0].fmt, _meta(sum(p.data.shape[0] for p in parts), parts[0].data.shape[1]),
                            parts[0].K, deferred=later)
    return PackedWeight(parts[0].fmt, torch.cat([p.data for p in parts]), parts[0].K)


def quantize_int8(w: torch.Tensor) -> PackedWeight:
    """Per output channel: scale = max|w| / 127, q = round(w / scale); row = [float32 scale][K x int8]."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-30)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return PackedWeight("I8", torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], dim=1), w.shape[1])


_SCRATCH = threading.local()     # per thread: engines in one process may step at the same time


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """One reused buffer per (thread, dtype) for dequantized tiles: a fresh allocation of megabytes per
    call would page-fault on every GEMM."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(max(numel, TILE_WEIGHTS), dtype=dtype)
    return buf[:numel]


def _lib():
    lib = kernels.load(source="qmatmul")
    if lib is None:
        raise RuntimeError("--quantization needs the native qmatmul kernels, which could not be built "
                           "(no C compiler?); run with --quantization none")
    return lib


# Decode rows up to which the packed kernels take a product, by the host's kind (no timing at load: a timed
# crossover moved between processes — 4, 32 and 256 rows on one host — and with it every answer). Keyed by
# the int8 kernels' ISA and whether bf16 GEMMs run on AMX tiles; (layers, LM head). bench/packed_rows.py
# measures both sides per product on a host, which is how the rows below were read (BENCHMARKS.md).
PACKED_ROWS = {
    ("vnni512", True): (32, 1),     # Intel with AMX: the dense copy's bf16 GEMM wins from ~32 rows (head: ~2)
    ("vnni512", False): (128, 16),  # AMD Zen 4 (AVX512-VNNI/BF16): packed level with dense to ~256 (SmolLM2)
    ("avxvnni", False): (64, 8),
    # AVX2 without VNNI (the kernels' ISA name, qmatmul_q8_isa: "maddubs"; keyed "avx2" until stop 63, a name no
    # kernel reports, so these hosts fell to PACKED_ROWS_OTHER). The dense side is float32 there (no bf16 GEMM),
    # a whole weight dequantized per call: packed wins long. Measured (AMD EPYC AVX2, 2026-12-07, Qwen2.5-Coder-0.5B
    # Q4_K_M, ms packed / dequantized + GEMM, layer 0's products and the head timed alone as bench/packed_rows.py does): gate_up Q5_0 at 64 rows
    # 8.1 / 27.8, at 128 16.7 / 36.3, at 256 33.4 / 53.9; down Q6_K 128 rows 8.9 / 10.9, 256 23.3 / 20.7; the LM head
    # (Q8_0, 152k x 896) at 16 rows 39.6 / 362, at 64 179 / 374.
    ("maddubs", False): (128, 64),
}
PACKED_ROWS_OTHER = (8, 1)          # scalar kernels, or an ISA not in the table
PACKED_ROWS_FLOAT = (16, 8)         # float activations (--dtype float32 with packed weights): FMA kernels


# Rows up to which the packed kernels take the products of a weight WITHOUT a dense copy (dense_copy_plan), prompt
# steps too: above them its product dequantizes the matrix into a reused buffer (WHOLE_WEIGHTS) and runs the GEMM a
# copy would, which costs the copy's GEMM plus one dequantization per call. Measured on AMD Zen 4 (2026-12-06, load
# ~6, ms per product at 256 rows, packed / dequantize + GEMM / the dense copy's GEMM): Qwen2.5-1.5B's Q4_K gate_up
# 252 / 191 / 199, Q6_K down 147 / 122 / 90, the 0.5B's Q8_0 gate_up 69 / 53 / 48: packed loses by 256 rows on the
# K-quants, so the dense side takes over where it does with a copy (PACKED_ROWS); the head's row count is the
# layers' (its copy's 16 rows were a crossover against a copy, not against a dequantization of the whole head).
# On Zen 4 the step as a whole says otherwise (2026-12-08, quiet, Qwen2.5-Coder Q4_K_M files, mixed64, default flags
# against every row packed): 0.5B 138.6 -> 152.9 tok/s, peak RSS 1,273 -> 1,090 MB (no GEMM kernels built per row
# bucket, no dequantization buffer); per product at 1,024 rows the two are level (1.5B: 64-73 ms packed, 61-64
# dequantized + GEMM), and a prompt step's layers run in the one native call of the decode path. So there a
# weight without a copy is packed at every row count a step of the default budget takes, and some more.
UNCOPIED_ROWS = {("vnni512", True): 32, ("vnni512", False): 4096, ("avxvnni", False): 64, ("maddubs", False): 128}
UNCOPIED_ROWS_OTHER = 16


def uncopied_rows(int8_act: bool, forced: int | None = None) -> int | None:
    """Rows up to which a packed weight without a dense copy takes its products packed (UNCOPIED_ROWS by this
    host's kind; `forced`: --packed-rows / PAGEDSERVE_PACKED_ROWS pin it as they pin packed_rows). None for
    float activations (--dtype float32 with packed weights): packed_rows' own rows, as before."""
    pinned = _pinned_rows(forced)
    if pinned is not None:
        return pinned
    return UNCOPIED_ROWS.get(_host_kind(), UNCOPIED_ROWS_OTHER) if int8_act else None


def _pinned_rows(forced: int | None) -> int | None:
    """The row count --packed-rows (or PAGEDSERVE_PACKED_ROWS) pins, or None."""
    if forced is None and os.environ.get("PAGEDSERVE_PACKED_ROWS"):
        forced = int(os.environ["PAGEDSERVE_PACKED_ROWS"])
    if forced is not None and forced < 1:
        raise ValueError(f"packed_rows must be a positive integer, got {forced}")
    return forced


def _host_kind() -> tuple[str, bool]:
    """The int8 kernels' ISA and whether bf16 GEMMs run on AMX tiles: the key of the row tables."""
    from pagedserve.host import cpu_info
    return _lib().qmatmul_q8_isa().decode(), "amx_bf16" in cpu_info()[1]


def packed_rows(int8_act: bool, forced: int | None = None) -> tuple[int, int, str]:
    """(layers' rows, LM head's rows, why): how many decode rows of a step the packed kernels take, from
    PACKED_ROWS by this host's kind; `forced` (--packed-rows / PAGEDSERVE_PACKED_ROWS) for both instead.
    A constant of the host kind, so every start computes the same numbers; steps that carry a prompt's
    rows take the dense copy whatever their size (Packed.matmul)."""
    pinned = _pinned_rows(forced)
    if pinned is not None:
        return pinned, pinned, "pinned by --packed-rows"
    if not int8_act:
        return (*PACKED_ROWS_FLOAT, "float activations")
    isa, amx = _host_kind()
    return (*PACKED_ROWS.get((isa, amx), PACKED_ROWS_OTHER), f"the table for {isa}{' + AMX' if amx else ''}")


class PackedLinear(nn.Module):
    """A linear layer whose weight stays packed; `linear()` in llama.py dispatches on the weight."""

    def __init__(self, weight: Packed, bias: bool = False):
        super().__init__()
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(weight.shape[0], device="meta")) if bias else None
        self.transposed = False


class PackedEmbedding(nn.Module):
    """Token embeddings looked up by dequantizing only the rows asked for (also a tied LM head)."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dense is not None:
            return F.embedding(ids, self.weight.dense).to(self.dtype)
        return self.weight.dequantize(self.dtype, rows=ids)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight, packed or dense."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(w.nbytes for w in packed_weights(model))


def packed_weights(model: nn.Module) -> list[Packed]:
    """Every PackedWeight of the model, each once (a tied LM head is the embedding's)."""
    seen: dict[int, Packed] = {}
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedEmbedding)):
            seen.setdefault(id(m.weight), m.weight)
    return list(seen.values())


def add_dense_copies(model: nn.Module, dtype: torch.dtype, free_bytes: int | None = None) -> str:
    """Give the packed weights dense_copy_plan picks a dense copy in `dtype` for their many-row products;
    the others multiply packed up to uncopied_rows and dequantize tiles above. Returns the line logged."""
    copied, line = dense_copy_plan(model, dtype, free_bytes)
    make_dense_copies(copied, dtype)
    return line


def make_dense_copies(ws: list[Packed], dtype: torch.dtype) -> None:
    for w in ws:
        w.dense = w.dequantize(dtype)


# Dense copies by the model's size: a model whose products' copies take at most this many bytes in the compute
# dtype gets one for every product's weight; a larger model gets none. Measured (AMD Zen 4, mixed64, alternating,
# docs/benchmarks-history.md stop 50): SmolLM2-135M (Q4_1, 576 wide; copies 257 MiB) ran 309.1 / 324.5 tok/s with
# copies against 228.0 / 247.6 without (-25 %), while Qwen2.5-Coder-0.5B (Q4_K_M, 896 wide; products' copies
# 0.9 GiB) ran 131.4 with and 137.4 without (no loss) at 1.86 GB peak RSS instead of 3.0 GB. A small model's matrices are
# small: its many-row steps are short and the per-call costs a copy saves weigh most, at the least memory. Fixed,
# not timed: the same file gives the same arithmetic on every start.
DENSE_COPY_MODEL_BYTES = 512 * 2**20


def dense_copy_plan(model: nn.Module, dtype: torch.dtype, free_bytes: int | None = None,
                    limit_bytes: int | None = None) -> tuple[list[Packed], str]:
    """Which packed weights get a dense copy (--quantization auto), and the line logged: the weights of the
    model's products (the layers' and the LM head, a tied embedding's included) when their copies take at most
    DENSE_COPY_MODEL_BYTES (or `limit_bytes`) and DENSE_COPY_SHARE of the free memory; an untied embedding
    never (its lookups dequantize only the rows asked for)."""
    ws = packed_weights(model)
    if not ws:
        return [], "dense copies: none needed (no packed weights)"
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, PackedEmbedding)}
    lookups -= {id(m.weight) for m in model.modules() if isinstance(m, PackedLinear)}
    lookups -= {id(getattr(model, "head_weight", None))}
    products = [w for w in ws if id(w) not in lookups]
    need = sum(w.shape[0] * w.K for w in products) * dtype.itemsize
    limit = DENSE_COPY_MODEL_BYTES if limit_bytes is None else limit_bytes
    free = available_memory_bytes() if free_bytes is None else free_bytes
    mib, dt = (lambda b: f"{b / 2**20:.0f} MiB"), str(dtype).removeprefix("torch.")
    none = f"dense copies: 0 of {len(ws)} packed weights, 0 MiB ("
    if not products:
        return [], none + "only embedding lookups, which dequantize the rows asked for)"
    if need > limit:
        return [], none + (f"the products' copies would take {mib(need)} in {dt}, above the {mib(limit)} a model "
                           "gets them at): many-row products packed up to uncopied_rows, dequantized tiles above")
    if need > DENSE_COPY_SHARE * free:
        return [], none + (f"{mib(need)} would exceed {DENSE_COPY_SHARE:.0%} of {mib(free)} free): many-row "
                           "products packed up to uncopied_rows, dequantized tiles above")
    return products, (f"dense copies: {len(products)} of {len(ws)} packed weights, {mib(need)} in {dt} (a model "
                      f"whose copies take at most {mib(limit)}: many-row products run on them"
                      + (f"; {len(ws) - len(products)} embedding lookups without)" if len(products) < len(ws) else ")"))


def describe(model: nn.Module) -> str:
    """e.g. 'packed Q4_1 x 210, Q8_0 x 1' for the memory-plan line (' + dense copies' with them)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedEmbedding)):
            counts[m.weight.fmt] = counts.get(m.weight.fmt, 0) + 1
    if not counts:
        return "dense"
    copies = " + dense copies" if any(w.dense is not None for w in packed_weights(model)) else ""
    return "packed " + ", ".join(f"{k} x {v}" for k, v in sorted(counts.items())) + copies
