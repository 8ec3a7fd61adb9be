"""The C attention kernels, every ISA level this host runs x every KV cache format, against a plain
torch reference (SDPA over the dequantised, gathered context). Shapes cover: contexts shorter than,
equal to and longer than a block; block sizes that are not 16; long contexts split over threads
(flash-decoding's merge); prefill chunks after a cached prefix, one-row chunks, chunks longer than a
query tile; head dims 32/64/128 and GQA groups of 1, 3 and 4."""
import zlib

import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels, native_build
from pagedserve.model.attention import AttentionMetadata, LayerKV, paged_attention, write_kv

LEVELS = kernels.host_levels()
DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def _cache(nb, bs, nkv, hd, dt, g):
    layer = LayerKV(torch.zeros(nb, bs, nkv, hd, dtype=dt), torch.zeros(nb, bs, nkv, hd, dtype=dt),
                    *((torch.zeros(nb, bs, nkv), torch.zeros(nb, bs, nkv)) if dt == torch.int8 else ()))
    k, v = torch.randn(nb * bs, nkv, hd, generator=g), torch.randn(nb * bs, nkv, hd, generator=g)
    write_kv(layer, k, v, torch.arange(nb * bs))          # the engine's own write path quantises
    return layer


def _dequant(layer):
    if layer.k_scale is None:
        return layer.k.float(), layer.v.float()
    return layer.k.float() * layer.k_scale[..., None], layer.v.float() * layer.v_scale[..., None]


def _reference(q, layer, table, ctx, scale):
    """q: (q_len, nh, hd), the last q_len of ctx positions; causal."""
    kf, vf = _dequant(layer)
    k = kf[table].flatten(0, 1)[:ctx].transpose(0, 1)
    v = vf[table].flatten(0, 1)[:ctx].transpose(0, 1)
    pos = torch.arange(ctx - q.shape[0], ctx)
    mask = torch.arange(ctx)[None] <= pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


def _tables(lens, bs, nb, g):
    maxb = max(-(-n // bs) for n in lens)
    perm = torch.randperm(nb - 1, generator=g) + 1
    bt, k = torch.zeros(len(lens), maxb, dtype=torch.long), 0
    for i, n in enumerate(lens):
        m = -(-n // bs)
        bt[i, :m] = perm[k:k + m]
        k += m
    assert k <= nb - 1
    return bt


def _chunked_step(chunks, shape, dt, g):
    """A cache holding the contexts of prefill chunks [(q_len, context incl. the chunk)], their block tables,
    cu_q, context lengths and queries."""
    nh, nkv, hd, bs = shape
    lens = [n for _, n in chunks]
    nb = sum(-(-n // bs) for n in lens) + 3
    layer = _cache(nb, bs, nkv, hd, dt, g)
    bt = _tables(lens, bs, nb, g)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor([a for a, _ in chunks]), 0).tolist())
    return layer, bt, cu, torch.tensor(lens), torch.randn(int(cu[-1]), nh, hd, generator=g)


SHAPES = [  # (n_heads, n_kv, head_dim, block_size)
    (9, 3, 64, 16), (4, 4, 32, 5), (8, 2, 128, 32), (4, 2, 80, 7)]     # 80: a head past 64 dims, not 128


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_kernel_matches_reference(level, dt, shape):
    lib = kernels.load(level)
    assert lib is not None, f"gcc is part of the set-up; the {level} build must succeed"
    nh, nkv, hd, bs = shape
    g = torch.Generator().manual_seed(zlib.crc32(f"{level} {dt} {shape}".encode()))
    lens = [1, bs - 1, bs, bs + 1, 100, 33, 3000]           # the 3000-token context is split and merged
    nb = sum(-(-n // bs) for n in lens) + 3
    layer = _cache(nb, bs, nkv, hd, dt, g)
    bt = _tables(lens, bs, nb, g)
    q = torch.randn(len(lens), nh, hd, generator=g)
    got = kernels.paged_decode_attention(q, layer.k, layer.v, layer.k_scale, layer.v_scale, bt,
                                         torch.tensor(lens), 0.2, lib=lib)
    for i, n in enumerate(lens):
        ref = _reference(q[i:i + 1], layer, bt[i], n, 0.2)[0]
        assert (got[i] - ref).abs().max().item() < 2e-5, f"sequence {i} (context {n})"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("chunk", [(16, 1500), (5, 2100), (1, 1030), (16, 3000), (33, 1100)], ids=str)
def test_a_lone_short_chunk_after_a_long_prefix_splits_its_keys(level, dt, chunk):
    """A chunk of one tile (<= 16 queries) has its prefix keys cut into ranges of >= 512 (one item per kv head
    would leave threads idle), merged by their (max, sum): the reference's output; and the same bits when the
    chunk shares its step with another (the cut follows from the chunk's own shape only)."""
    lib = kernels.load(level)
    nh, nkv, hd, bs = SHAPES[0]
    a, n = chunk
    g = torch.Generator().manual_seed(zlib.crc32(f"split {level} {dt} {chunk}".encode()))
    nb = -(-n // bs) + 3
    layer = _cache(nb, bs, nkv, hd, dt, g)
    bt = _tables([n], bs, nb, g)
    q = torch.randn(a, nh, hd, generator=g)
    got = kernels.paged_prefill_attention(q, layer.k, layer.v, layer.k_scale, layer.v_scale, bt,
                                          torch.tensor([0, a]), torch.tensor([n]), 0.2, lib=lib)
    assert (got - _reference(q, layer, bt[0], n, 0.2)).abs().max().item() < 2e-5
    q2 = torch.cat([q, torch.randn(40, nh, hd, generator=g)])
    both = kernels.paged_prefill_attention(q2, layer.k, layer.v, layer.k_scale, layer.v_scale, torch.cat([bt, bt]),
                                           torch.tensor([0, a, a + 40]), torch.tensor([n, n]), 0.2, lib=lib)
    assert torch.equal(both[:a], got)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_a_decode_rows_result_does_not_depend_on_the_rest_of_the_batch(dt):
    """Bit for bit: a row computed alone, or beside other rows (a speculative verification's rows of one
    sequence, other sequences long and short), gives the same output: each context is split by its own
    length only, so drafting never changes a token on a path whose activations are rounded."""
    nh, nkv, hd, bs = SHAPES[0]
    g = torch.Generator().manual_seed(7)
    lens = [700, 701, 702, 703, 704, 3000, 40, 1]          # one sequence's verification rows, then others
    nb = sum(-(-n // bs) for n in lens) + 3
    layer = _cache(nb, bs, nkv, hd, dt, g)
    bt = _tables(lens, bs, nb, g)
    q = torch.randn(len(lens), nh, hd, generator=g)
    together = kernels.paged_decode_attention(q, layer.k, layer.v, layer.k_scale, layer.v_scale, bt,
                                              torch.tensor(lens), 0.2)
    for i, n in enumerate(lens):
        alone = kernels.paged_decode_attention(q[i:i + 1], layer.k, layer.v, layer.k_scale, layer.v_scale, bt[i:i + 1],
                                               torch.tensor([n]), 0.2)
        assert torch.equal(alone[0], together[i]), f"row {i} (context {n})"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_verification_rows_sharing_their_tiles_compute_the_one_row_bits(level, dt, shape):
    """A speculative step's rows of one sequence (each one key more, through the same blocks) run
    together, each K/V tile loaded once for all of them: every row's output is, bit for bit, what it
    computes alone. Runs of 17 rows (more than a group holds), across a change of split (contexts 510
    -> 526: 64-key ranges up to 512 keys, 128 after) and of range count (255 -> 258), a short one, and a
    sliding window (never grouped: each row's keys start elsewhere); other sequences between them."""
    lib = kernels.load(level)
    nh, nkv, hd, bs = shape
    g = torch.Generator().manual_seed(zlib.crc32(f"verify {level} {dt} {shape}".encode()))
    runs = [list(range(510, 527)), list(range(255, 259)), [40], list(range(3, 8))]
    nb = sum(-(-r[-1] // bs) for r in runs) + 3
    layer = _cache(nb, bs, nkv, hd, dt, g)
    seq_tables = _tables([r[-1] for r in runs], bs, nb, g)
    lens = [n for r in runs for n in r]
    bt = torch.cat([seq_tables[i:i + 1].expand(len(r), -1) for i, r in enumerate(runs)]).contiguous()
    q = torch.randn(len(lens), nh, hd, generator=g)
    for window in (0, 100):
        together = kernels.paged_decode_attention(q, layer.k, layer.v, layer.k_scale, layer.v_scale, bt,
                                                  torch.tensor(lens), 0.2, lib=lib, window=window)
        for i, n in enumerate(lens):
            alone = kernels.paged_decode_attention(q[i:i + 1], layer.k, layer.v, layer.k_scale, layer.v_scale,
                                                   bt[i:i + 1], torch.tensor([n]), 0.2, lib=lib, window=window)
            assert torch.equal(alone[0], together[i]), f"row {i} (context {n}, window {window})"
        if not window:
            ref = _reference(q[16:17], layer, bt[16], lens[16], 0.2)[0]
            assert (together[16] - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefill_kernel_matches_reference(level, dt, shape):
    lib = kernels.load(level)
    g = torch.Generator().manual_seed(zlib.crc32(f"prefill {level} {dt} {shape}".encode()))
    chunks = [(40, 40), (37, 70), (1, 20), (300, 700), (17, 33), (16, 16)]   # (q_len, context incl. the chunk)
    layer, bt, cu, lens, q = _chunked_step(chunks, shape, dt, g)
    got = kernels.paged_prefill_attention(q, layer.k, layer.v, layer.k_scale, layer.v_scale, bt, cu, lens, 0.2,
                                          lib=lib)
    for p, (a, n) in enumerate(chunks):
        ref = _reference(q[cu[p]:cu[p + 1]], layer, bt[p], n, 0.2)
        assert (got[cu[p]:cu[p + 1]] - ref).abs().max().item() < 2e-5, f"chunk {p} ({a} of {n})"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefill_in_bf16_products_is_the_reference_within_bf16_rounding(level, shape):
    """bf16_dots (a bf16 model on a bf16 cache): where the build and host have AVX512-BF16, vdpbf16ps does both
    products, the queries (times the scale) and the probabilities rounded to bf16. Against the reference in
    float64 over the same rounded queries: within what rounding the probabilities costs (2^-9 of each, so
    2^-8 of max |v| bounds the output's error) on every chunk shape, lone chunks split over a long prefix
    included. Where the dots do not run (AVX2 builds, hosts without AVX512-BF16, head dims other than 64 and
    128, sliding windows) the call is the float32-product kernel's, bit for bit."""
    lib = kernels.load(level)
    hd = shape[2]
    g = torch.Generator().manual_seed(zlib.crc32(f"dots {level} {shape}".encode()))
    chunks = [(40, 40), (37, 70), (1, 20), (300, 700), (17, 33), (16, 1500), (5, 2100)]
    layer, bt, cu, lens, q = _chunked_step(chunks, shape, torch.bfloat16, g)
    args = (q, layer.k, layer.v, None, None, bt, cu, lens, 0.2)
    got = kernels.paged_prefill_attention(*args, lib=lib, bf16_dots=True)
    plain = kernels.paged_prefill_attention(*args, lib=lib)
    if not (kernels.bf16_dots(lib) and hd in (64, 128)):
        assert torch.equal(got, plain)
        return
    assert not torch.equal(got, plain)                        # the bf16 products ran
    qr = (q * 0.2).bfloat16().double()
    kf, vf = layer.k.double(), layer.v.double()
    for p, (a, n) in enumerate(chunks):
        k = kf[bt[p]].flatten(0, 1)[:n].transpose(0, 1)
        v = vf[bt[p]].flatten(0, 1)[:n].transpose(0, 1)
        mask = torch.arange(n)[None] <= torch.arange(n - a, n)[:, None]
        ref = F.scaled_dot_product_attention(qr[cu[p]:cu[p + 1]].transpose(0, 1)[None], k[None], v[None],
                                             attn_mask=mask, scale=1.0, enable_gqa=True)[0].transpose(0, 1)
        err = (got[cu[p]:cu[p + 1]].double() - ref).abs().max().item()
        assert err < 2 ** -8 * vf.abs().max().item(), f"chunk {p} ({a} of {n}): {err}"
    windowed = kernels.paged_prefill_attention(*args, lib=lib, window=50, bf16_dots=True)
    assert torch.equal(windowed, kernels.paged_prefill_attention(*args, lib=lib, window=50))


@pytest.mark.parametrize("dt,dots", [(dt, False) for dt in DTYPES] + [(torch.bfloat16, True)],
                         ids=["float32", "bfloat16", "int8", "bfloat16-bf16-products"])
def test_a_short_chunks_packed_lanes_compute_the_unpacked_bits(dt, dots):
    """A chunk's tile whose group x queries fit 48 lanes packs them (5 queries of a group of 3: one vector, not
    three): each lane's arithmetic is the same wherever it sits, so the output is, bit for bit, that of the
    same heads with their K/V repeated per query head (a group of one: a lane per query, nothing packed)."""
    nh, nkv = SHAPES[0][:2]
    g = torch.Generator().manual_seed(zlib.crc32(f"packed {dt}".encode()))
    chunks = [(1, 1500), (5, 700), (7, 900), (11, 40), (16, 2000), (21, 600)]
    layer, bt, cu, lens, q = _chunked_step(chunks, SHAPES[0], dt, g)
    rep = [None if t is None else t.repeat_interleave(nh // nkv, dim=2).contiguous()
           for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)]
    tail = (bt, cu, lens, 0.2)
    gqa = kernels.paged_prefill_attention(q, layer.k, layer.v, layer.k_scale, layer.v_scale, *tail, bf16_dots=dots)
    mha = kernels.paged_prefill_attention(q, *rep, *tail, bf16_dots=dots)
    assert torch.equal(gqa, mha)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_native_and_torch_paths_agree_on_a_mixed_step(dt):
    """paged_attention on one step of decodes + prefill chunks: the kernels and the torch path."""
    nh, nkv, hd, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(5)
    dec, pre = [5, 17, 200], [(30, 30), (20, 52)]
    lens = dec + [n for _, n in pre]
    nb = sum(-(-n // bs) for n in lens) + 2
    layer = _cache(nb, bs, nkv, hd, dt, g)
    bt = _tables(lens, bs, nb, g)
    cu = torch.tensor([0, 30, 50])
    common = dict(slot_mapping=None, num_decodes=3, decode_block_tables=bt[:3], decode_context_lens=torch.tensor(dec),
                  prefill_block_tables=bt[3:], prefill_cu_q=cu, prefill_context_lens=torch.tensor([30, 52]))
    q = torch.randn(3 + 50, nh, hd, generator=g)
    a = paged_attention(q, layer, AttentionMetadata(**common, native=True, native_prefill=True), 0.125)
    b = paged_attention(q, layer, AttentionMetadata(**common, native=False), 0.125)
    assert (a - b).abs().max().item() < 2e-5


def test_int8_write_is_per_token_and_head():
    """Each (token, kv head) row gets its own scale: max |x| / 127, so the row's extreme maps to +-127."""
    layer = _cache(3, 4, 2, 16, torch.int8, torch.Generator().manual_seed(0))
    k = torch.randn(2, 2, 16) * torch.tensor([[1.0], [100.0]])
    write_kv(layer, k, k, torch.tensor([5, 6]))
    s = layer.k_scale.view(-1, 2)[5:7]
    assert torch.allclose(s, k.abs().amax(-1) / 127)
    assert layer.k.view(-1, 2, 16)[5:7].abs().amax(-1).eq(127).all()
    assert (layer.k.view(-1, 2, 16)[5:7].float() * s[..., None] - k).abs().max() <= s.max() / 2 + 1e-6


def test_every_build_is_keyed_by_the_host(monkeypatch):
    """Each level's build is its own file, and its cache key changes with the host's CPU flags."""
    import os
    cc = kernels.compiler()
    for level in LEVELS:
        lib = kernels.load(level)
        assert os.path.basename(lib._name).startswith(f"paged_attention-{level}-")
        assert lib.paged_attention_isa().decode() == level
        assert kernels.build_path(level, cc)[0] == lib._name
    here = kernels.build_path("generic", cc)[0]
    monkeypatch.setattr(native_build, "cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    assert kernels.build_path("generic", cc)[0] != here


def test_a_level_the_cpu_cannot_run_is_refused(monkeypatch):
    """Forcing AVX-512 code onto an AVX2 host would die with SIGILL; it is a ValueError naming the knob."""
    monkeypatch.setattr(native_build, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "f16c", "bmi2"}))
    assert kernels.host_levels() == ["avx2", "generic"]
    with pytest.raises(ValueError, match="PAGEDSERVE_KERNEL_ISA"):
        kernels.load("avx512")


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_the_torch_paths_block_gather_is_indexing_bit_for_bit(dt):
    """attention._blocks (index_select over the pool as rows of blocks) gives x[bt] exactly, for a prefill chunk's
    table (1-D) and the decode rows' tables (2-D), values and int8 scales; a pool view that is not contiguous
    takes x[bt] itself."""
    from pagedserve.model.attention import _blocks
    g = torch.Generator().manual_seed(11)
    layer = _cache(40, 16, 3, 64, dt, g)
    for bt in (torch.tensor([7, 3, 39, 0, 12]), torch.randint(0, 40, (4, 6), generator=g)):
        for x in (layer.k, layer.v, layer.k_scale, layer.v_scale):
            if x is not None:
                assert torch.equal(_blocks(x, bt), x[bt])
        strided = layer.k.transpose(1, 2)
        assert torch.equal(_blocks(strided, bt), strided[bt])
    assert _blocks(None, bt) is None
