"""Packed weights (--quantization gguf | int8): every kernel code path this host runs (each ISA level x
each block format x batches that take the in-register path, the chunked one and the dequantize +
GEMM one) against gguf's own dequantizer and torch's fp32 F.linear."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.model import quant
from pagedserve.model.quant import FORMATS, INTERLEAVED, PackedWeight, quantize_int8

LEVELS = kernels.host_levels()
GGUF_FORMATS = [f for f in FORMATS if f != "I8" and f not in quant.GROUPED]     # the file's layouts
# where the f16 scale fields of each block lie (byte offsets), the rest is random quants
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    _, per_block, block_bytes = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, k // per_block, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[fmt]:
        scales = rng.uniform(-0.02, 0.02, size=(n, k // per_block)).astype(np.float16)
        data[:, :, off:off + 2] = scales.view(np.uint8).reshape(n, k // per_block, 2)
    if fmt == "Q6_K":          # int8 scales: keep them moderate
        data[:, :, 192:208] = rng.integers(-40, 40, size=(n, k // per_block, 16)).astype(np.int8).view(np.uint8)
    return data.reshape(n, -1)


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    lib = kernels.load(request.param, source="qmatmul")
    assert lib is not None and lib.qmatmul_isa().decode() == request.param
    monkeypatch.setattr(quant, "_lib", lambda: lib)
    return request.param


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_dequantize_equals_gguf(level, fmt):
    n, k = 48, 512
    raw = random_blocks(fmt, n, k)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).astype(np.float32))
    w = PackedWeight(fmt, torch.from_numpy(raw), k)
    torch.testing.assert_close(w.dequantize(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.dequantize(torch.bfloat16), ref.bfloat16(), rtol=0, atol=0)
    rows = torch.tensor([5, 0, 47, 5])
    torch.testing.assert_close(w.dequantize(rows=rows), ref[rows], rtol=1e-6, atol=1e-7)
    for bad in ([48], [-1]):
        with pytest.raises(IndexError):
            w.dequantize(rows=torch.tensor(bad))


@pytest.mark.parametrize("fmt", [*GGUF_FORMATS, "I8"])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 40])
def test_matmul_matches_fp32(level, fmt, m):
    n, k = 70, 768          # 70 rows: not a multiple of the kernel's 16-row work items
    if fmt == "I8":
        w = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(1)))
    else:
        w = PackedWeight(fmt, torch.from_numpy(random_blocks(fmt, n, k, seed=m)), k)
    dense = w.dequantize()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    ref = F.linear(x.double(), dense.double()).float()
    w.small_m = 16          # m = 40 takes the dequantize + GEMM path
    got = w.matmul(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    got16 = w.matmul(x.bfloat16())
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_int8_is_per_output_channel():
    w = torch.randn(6, 64) * torch.tensor([1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0])[:, None]
    d = quantize_int8(w).dequantize()
    err = (d - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert (err <= 0.5 / 127 + 1e-6).all()       # half a step of each row's own scale


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="Q4_1 weight of 576 inputs"):
        PackedWeight("Q4_1", torch.zeros(4, 100, dtype=torch.uint8), 576)
    with pytest.raises(ValueError, match="Q4_K"):
        PackedWeight("Q4_K", torch.zeros(4, 144 * 2, dtype=torch.uint8), 576)    # 576 is not a multiple of 256


def test_packed_rows_come_from_the_host_kind_not_a_timing(monkeypatch):
    """packed_rows reads a table by the int8 kernels' ISA and AMX (the same answer on every start: nothing
    is timed), float activations their own row, PAGEDSERVE_PACKED_ROWS or --packed-rows pin both."""
    monkeypatch.delenv("PAGEDSERVE_PACKED_ROWS", raising=False)
    isa = quant._lib().qmatmul_q8_isa().decode()
    from pagedserve.host import cpu_info
    want = quant.PACKED_ROWS.get((isa, "amx_bf16" in cpu_info()[1]), quant.PACKED_ROWS_OTHER)
    assert quant.packed_rows(True)[:2] == want and isa in quant.packed_rows(True)[2]
    assert quant.packed_rows(True) == quant.packed_rows(True)
    assert quant.packed_rows(False)[:2] == quant.PACKED_ROWS_FLOAT
    assert quant.packed_rows(True, 7) == (7, 7, "pinned by --packed-rows")
    monkeypatch.setenv("PAGEDSERVE_PACKED_ROWS", "3")
    assert quant.packed_rows(False)[:2] == (3, 3)
    with pytest.raises(ValueError, match="packed_rows"):
        quant.packed_rows(True, 0)
    for flags in (quant.PACKED_ROWS.values(), [quant.PACKED_ROWS_OTHER, quant.PACKED_ROWS_FLOAT]):
        assert all(r >= 1 and h >= 1 for r, h in flags)


def test_every_isa_the_int8_kernels_report_has_its_rows():
    """The row tables are keyed by the name qmatmul_q8_isa returns: every name qmatmul.c can report (its
    Q8_DOT_ISA defines) but the scalar fallback has a row of its own, so no vector host falls to the scalar
    rows (AVX2 hosts' name is "maddubs"; the table said "avx2" until stop 63, and AVX2 hosts ran 8 packed
    decode rows, 1 for the LM head: a whole 152k-row head dequantized per step of 2 rows or more)."""
    import os
    import re
    src = open(os.path.join(os.path.dirname(quant.__file__), "..", "kernels", "qmatmul.c")).read()
    names = set(re.findall(r'#define Q8_DOT_ISA "(\w+)"', src))
    assert {"vnni512", "avxvnni", "maddubs", "scalar"} <= names, names
    for isa in names - {"scalar"}:
        assert (isa, False) in quant.PACKED_ROWS and (isa, False) in quant.UNCOPIED_ROWS, isa
    assert {k[0] for k in quant.PACKED_ROWS} | {k[0] for k in quant.UNCOPIED_ROWS} <= names


@pytest.mark.parametrize("fmt", [*GGUF_FORMATS, "I8"])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 11])
def test_int8_activation_kernel_is_the_q8_rounded_product(level, fmt, m):
    """qmatmul_q8 (the bf16 path's few-row products) computes, in integers, exactly the product of the
    dequantized weights with x rounded to int8 per 32 values: only the float summation order differs.
    Its products' instruction is the one the level names (vpdpbusd on -vnni builds)."""
    n, k = 70, 768
    if fmt == "I8":
        w = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(1)))
    else:
        w = PackedWeight(fmt, torch.from_numpy(random_blocks(fmt, n, k, seed=m)), k)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    x[0, :64] = 0.0                                  # all-zero blocks: scale 0, no NaN
    dense = w.dequantize().double()
    ref = F.linear(quant.q8_round(x).double(), dense)
    got = w._qmatmul(x, int8_act=True)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = F.linear(x.double(), dense)               # and it is close to the unrounded product
    assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max()
    isa = quant._lib().qmatmul_q8_isa().decode()
    assert isa == ("vnni512" if level == "avx512-vnni" else "avxvnni" if level == "avx2-vnni" else
                   "scalar" if level == "generic" else "maddubs")


@pytest.mark.parametrize("fmt", list(INTERLEAVED))
@pytest.mark.parametrize("m", [1, 2, 5, 8, 11, 40])
def test_interleaved_rows_multiply_and_dequantize_as_the_files(level, fmt, m, monkeypatch):
    """Rows interleaved in groups of 8 (the load does it for int8 activations): the same products as the
    file's rows up to float summation order (both the q8-rounded product), the same rows back from
    dequantize (all, a list: embedding lookups, tiles from a group's first row), and the float kernel
    refused. 72 rows: a 16-row work item and a last one of 8; K of 768: 24 blocks."""
    n, k = 72, 768
    raw = (quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(m))).data if fmt == "I8"
           else torch.from_numpy(random_blocks(fmt, n, k, seed=m)))
    rows_w = PackedWeight(fmt, raw.clone(), k, int8_act=True)
    w = PackedWeight(fmt, raw.clone(), k, int8_act=True)
    w.interleave()
    cols = raw.shape[1] // 144 * 148 if fmt == "Q4_K" else raw.shape[1]     # Q4_Kx8: 6-bit scales as bytes
    assert w.fmt == INTERLEAVED[fmt] and w.data.shape == (n, cols)
    assert not torch.equal(w.data[:, :raw.shape[1]], raw)
    dense = rows_w.dequantize()
    assert torch.equal(w.dequantize(), dense)
    assert torch.equal(w.dequantize(torch.bfloat16), rows_w.dequantize(torch.bfloat16))
    ids = torch.tensor([5, 0, 71, 5, 8, 63])
    assert torch.equal(w.dequantize(rows=ids), dense[ids])
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    x[0, :64] = 0.0
    ref = F.linear(quant.q8_round(x).double(), dense.double())
    got = w._qmatmul(x, int8_act=True)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    torch.testing.assert_close(got, rows_w._qmatmul(x, int8_act=True), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if m > 16:                    # many rows: tiles of 16 rows (the last of 8) dequantized from the groups
        monkeypatch.setattr(quant, "TILE_WEIGHTS", 16 * k)
        exact = F.linear(x.double(), dense.double())
        torch.testing.assert_close(w.matmul(x).double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())
    with pytest.raises(ValueError, match="int8 activations only"):
        w._qmatmul(x, int8_act=False)
    with pytest.raises(ValueError, match="interleave after"):
        w.permute_rows(torch.arange(n))


@pytest.mark.skipif(not {"avx512-vnni", "avx2-vnni"} <= set(LEVELS),
                    reason="compares the avx512-vnni build with the avx2-vnni one: needs AVX512-VNNI and AVX-VNNI")
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "I8", "Q4_K", "Q6_K"])
def test_sixteen_row_products_are_the_eight_row_ones_to_the_bit(fmt, monkeypatch):
    """The avx512-vnni build multiplies two 8-row groups a zmm; each lane does what the avx2-vnni build's
    8-row path does, in its order: the same float32 bits (so a batch's rows, a verification's and a
    decode step's stay what a one-row step computes). 88 rows: 16-row work items, the last of 8."""
    n, k = 88, 512
    raw = (quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(7))).data if fmt == "I8"
           else torch.from_numpy(random_blocks(fmt, n, k, seed=7)))
    w = PackedWeight(fmt, raw, k, int8_act=True)
    w.interleave()
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(8))     # 8 rows, then 5 (Q6_K: the 8-row path)
    outs = []
    for lvl in ("avx512-vnni", "avx2-vnni"):
        lib = kernels.load(lvl, source="qmatmul")
        monkeypatch.setattr(quant, "_lib", lambda lib=lib: lib)
        outs.append(w._qmatmul(x, int8_act=True))
    assert torch.equal(outs[0], outs[1])


def test_interleave_keeps_what_it_cannot_group():
    """Row counts that are not a multiple of 8 stay as read (every format the kernels read has a layout)."""
    for fmt, n in (("Q6_K", 12), ("Q4_K", 12), ("Q4_1", 70)):
        w = PackedWeight(fmt, torch.from_numpy(random_blocks(fmt, n, 256)), 256)
        before = w.data.clone()
        w.interleave()
        assert w.fmt == fmt and torch.equal(w.data, before)
    w = quantize_int8(torch.randn(12, 256))
    w.interleave()
    assert w.fmt == "I8"


def test_q8_round_is_ggufs_q8_0():
    """q8_round (the reference above) rounds as GGUF's own Q8_0 quantizer does."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    raw = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float32))
    torch.testing.assert_close(quant.q8_round(x), ref, rtol=0, atol=2e-3 * x.abs().max().item())


def test_activations_are_rounded_unless_float32_was_asked_for(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_INT8_ACTIVATIONS", raising=False)
    assert quant.int8_activations("float32", "gguf") == (False, "--dtype float32: the exact path")
    for asked in ("auto", "bfloat16", "float16"):
        assert quant.int8_activations(asked, "int8")[0]
    assert not quant.int8_activations("auto", "none")[0]
    monkeypatch.setenv("PAGEDSERVE_INT8_ACTIVATIONS", "0")
    assert quant.int8_activations("bfloat16", "gguf") == (False, "PAGEDSERVE_INT8_ACTIVATIONS")


@pytest.mark.parametrize("int8_act", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_row_products_follow_int8_act(level, dtype, int8_act):
    """matmul() takes qmatmul_q8 when int8_act is set (at load) and the float kernel otherwise."""
    w = PackedWeight("Q4_1", torch.from_numpy(random_blocks("Q4_1", 32, 256)), 256)
    w.int8_act = int8_act
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = w.matmul(x).double()
    xr = quant.q8_round(x) if int8_act else x.float()
    ref = F.linear(xr.double(), w.dequantize().double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5          # bf16: the output's own rounding
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * ref.abs().max().item())
    if dtype == torch.float32:                               # and the two differ: the test can tell them apart
        other = F.linear((x.float() if int8_act else quant.q8_round(x)).double(), w.dequantize().double())
        assert (got - other).abs().max() > 1e-4 * ref.abs().max()


def test_auto_quantization_rule():
    """--quantization auto: packed (with a dense copy) only for a GGUF file on one CPU rank without
    --dtype float32; dense otherwise; an explicit choice is kept as asked."""
    choose = quant.choose_quantization
    assert choose("auto", "gguf", "auto", "cpu", 1)[:2] == ("gguf", True)
    assert choose("auto", "gguf", "bfloat16", "cpu", 1)[:2] == ("gguf", True)
    for args, why in ((("gguf", "float32", "cpu", 1), "--dtype float32"), (("hf", "auto", "cpu", 1), "HF folder"),
                      (("gguf", "auto", "cuda", 1), "cuda"), (("gguf", "auto", "cpu", 2), "tensor parallelism")):
        q, copy, line = choose("auto", *args)
        assert (q, copy) == ("none", False) and why in line
    for asked in ("none", "gguf", "int8"):
        assert choose(asked, "gguf", "auto", "cpu", 1) == (asked, False, f"--quantization {asked}")


def _q41(n=64, k=256, seed=0):
    return PackedWeight("Q4_1", torch.from_numpy(random_blocks("Q4_1", n, k, seed)), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_copy_serves_the_many_row_products(dtype):
    """With a dense copy, rows above small_m are F.linear on the copy (not dequantized tiles), rows up
    to it the packed kernel; a step carrying prompt rows takes the copy at every row count (without a
    copy, prompt or not, the packed kernel up to small_m)."""
    w = _q41()
    w.int8_act, w.small_m = True, 4
    w.dense = w.dequantize(dtype)
    x = torch.randn(9, w.K, generator=torch.Generator().manual_seed(3)).to(dtype)
    torch.testing.assert_close(w.matmul(x), F.linear(x, w.dense), rtol=0, atol=0)
    torch.testing.assert_close(w.matmul(x[:4]), w._qmatmul(x[:4], True).to(dtype), rtol=0, atol=0)
    for m in (1, 4, 9):
        torch.testing.assert_close(w.matmul(x[:m], prompt=True), F.linear(x[:m], w.dense), rtol=0, atol=0)
    dense, w.dense = w.dense, None
    torch.testing.assert_close(w.matmul(x[:4], prompt=True), w._qmatmul(x[:4], True).to(dtype), rtol=0, atol=0)
    w.dense = dense
    assert w.nbytes == w.data.numel() + w.dense.numel() * dtype.itemsize


def test_dense_copies_are_skipped_when_memory_is_short():
    from pagedserve.model.quant import PackedEmbedding, PackedLinear, add_dense_copies, describe
    w, e = _q41(), _q41(32, 256, 1)
    model = torch.nn.ModuleDict({"a": PackedLinear(w), "b": PackedLinear(w), "emb": PackedEmbedding(e, torch.float32)})
    model.head_weight = e                   # a tied LM head: the embedding is a product's weight too (copied)
    need = (64 + 32) * 256 * 4
    line = add_dense_copies(model, torch.float32, free_bytes=need)          # more than half of free: skipped
    assert line.startswith("dense copies: 0 of 2") and "50% of" in line and w.dense is None
    assert "dense copies" not in describe(model)
    line = add_dense_copies(model, torch.float32, free_bytes=4 * need)
    assert line.startswith("dense copies: 2 of 2 packed weights") and w.dense is not None and e.dense is not None
    assert describe(model) == "packed Q4_1 x 3 + dense copies"
    ids = torch.tensor([0, 31, 5])                                           # lookups read the copy: same rows
    torch.testing.assert_close(model["emb"](ids), e.dequantize(rows=ids), rtol=0, atol=0)
