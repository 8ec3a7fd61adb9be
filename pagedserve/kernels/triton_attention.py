"""Paged attention in Triton: the attention path on CUDA (and, through Triton's interpreter, on the CPU in
tests). Three kernels read and write the pool in place, in the layout of model/attention.py:

  write_kv          this step's K/V rows into their slots (slot mapping), int8 with one scale per token and
                    kv head, rounded as torch.round (half to even) so the pool holds what the torch path writes
  decode_attention  one query row per sequence, split over the context (flash-decoding): a program per
                    (row, kv head, split) loads each K/V tile once for the whole GQA group; a second kernel
                    merges the splits by their log-sum-exp
  prefill_attention the step's prefill chunks (varlen: cu_q), each reading its context through its block
                    table (a cached prefix, then the chunk) with the causal mask offset by the prefix; a
                    program per (chunk, kv head, BLOCK_Q query tokens) holds BLOCK_Q x group rows

Every kernel takes any block size (tiles gather positions through the block table, so odd sizes and partial
last blocks need nothing special), float32 / bfloat16 / float16 caches and the int8 one, sliding windows
(key > query - window) and Gemma 2's soft-cap. Accumulation is float32; float32 products use IEEE
precision (no TF32), so a float32 model computes what the torch path computes up to summation order.

Without CUDA the kernels run in Triton's interpreter (numpy, one program at a time): that is how `make test`
checks them against the torch reference without a GPU. The interpreter is chosen when triton is imported
(TRITON_INTERPRET=1, which this module sets when no GPU is visible and triton is not imported yet).
"""
from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton                               # noqa: E402
import triton.language as tl                # noqa: E402
from triton import knobs                    # noqa: E402

FULL = 1 << 30              # the window argument of full attention
SPLIT_TOKENS = 256          # context positions per decode split (a split is one program's share)
MERGE_LANES = 32            # the merge kernel's split lanes, at least: one compiled variant up to 8,192 positions


def _next_pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def _write_kv_kernel(X, C, S, SLOT, stride_xt, stride_xh, stride_cs, stride_ch, stride_ss, stride_sh,
                     HD: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    md = d < HD
    slot = tl.load(SLOT + t).to(tl.int64)
    x = tl.load(X + t * stride_xt + h * stride_xh + d, mask=md, other=0.0)
    dst = C + slot * stride_cs + h * stride_ch + d
    if INT8:
        xf = x.to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-8) / 127.0
        y = tl.div_rn(xf, s)
        r = tl.floor(y)                       # round half to even, as torch.round
        f = y - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        r = tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(dst, r.to(tl.int8), mask=md)
        tl.store(S + slot * stride_ss + h * stride_sh, s)
    else:
        tl.store(dst, x.to(C.dtype.element_ty), mask=md)


@triton.jit
def _tile(q, K, V, KS, VS, BT_ROW, pos, mn, h, d, md, scale, softcap, stride_kb, stride_kt, stride_kh,
          stride_sb, stride_st, stride_sh, BS: tl.constexpr, INT8: tl.constexpr, SOFTCAP: tl.constexpr,
          UPCAST: tl.constexpr):
    """The keys at positions `pos` (valid where `mn`) of kv head h, found through the block table row BT_ROW:
    the scores q @ K^T x scale (soft-capped: cap x tanh(s / cap)) and the V rows, in q's type (int8 rows
    dequantized with their scales; a bfloat16 cache under float32 queries widened)."""
    blk = tl.load(BT_ROW + pos // BS, mask=mn, other=0).to(tl.int64)
    row = blk * stride_kb + (pos % BS) * stride_kt + h * stride_kh
    kv_mask = mn[:, None] & md[None, :]
    k = tl.load(K + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if INT8:
        srow = blk * stride_sb + (pos % BS) * stride_st + h * stride_sh
        k = (k.to(tl.float32) * tl.load(KS + srow, mask=mn, other=0.0)[:, None]).to(q.dtype)
        v = (v.to(tl.float32) * tl.load(VS + srow, mask=mn, other=0.0)[:, None]).to(q.dtype)
    else:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if UPCAST:                                          # the interpreter's dot misreads bfloat16
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        v = v.to(tl.float32)
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # no TF32 for float32; half types ignore it
    s = s * scale
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s, v


@triton.jit
def _online_softmax(m_i, l_i, acc, s, v, P_DTYPE: tl.constexpr):
    """One tile into the running max, sum and output of each row (masked scores are -inf; a row with
    nothing visible yet keeps m = -inf and adds nothing). P is rounded to q's type before P @ V."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(P_DTYPE).to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


# Triton compiles a kernel anew for each new "specialization" of its integer arguments (== 1, divisible by 16).
# The block tables' width and the split count change from step to step on the eager path (a mixed step's
# widest table, its longest context), and with them the strides below: without this each new value class cost
# a ~0.5 s compile in the middle of serving (an H200's first mixed steps took 600 ms instead of 80).
VARYING = ["stride_bt", "stride_ot", "stride_oh", "stride_lt", "stride_lh"]


@triton.jit(do_not_specialize=VARYING)
def _decode_kernel(Q, K, V, KS, VS, BT, LENS, MID_O, MID_L, scale, window, softcap,
                   stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh,
                   stride_bt, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                   BS: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, INT8: tl.constexpr,
                   SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, P_DTYPE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    mg, md = g < G, d < HD
    n = tl.load(LENS + t).to(tl.int32)
    lo = tl.maximum(n - window, 0)                      # window: 2**30 for full attention
    start = lo + sp * SPLIT
    end = tl.minimum(start + SPLIT, n)
    q = tl.load(Q + t * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=mg[:, None] & md[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mn = pos < end
        sc, v = _tile(q, K, V, KS, VS, BT + t * stride_bt, pos, mn, h, d, md, scale, softcap, stride_kb, stride_kt,
                      stride_kh, stride_sb, stride_st, stride_sh, BS, INT8, SOFTCAP, UPCAST)
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, tl.where(mn[None, :], sc, float("-inf")), v, P_DTYPE)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    heads = h * G + g
    tl.store(MID_O + t * stride_ot + heads[:, None] * stride_oh + sp * stride_os + d[None, :], o,
             mask=mg[:, None] & md[None, :])
    tl.store(MID_L + t * stride_lt + heads * stride_lh + sp, lse, mask=mg)


@triton.jit(do_not_specialize=["num_splits", *VARYING[1:]])
def _merge_kernel(MID_O, MID_L, OUT, num_splits, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                  stride_t, stride_h, HD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ms, md = s < num_splits, d < HD
    lse = tl.load(MID_L + t * stride_lt + h * stride_lh + s, mask=ms, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(ms & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    o = tl.load(MID_O + t * stride_ot + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=ms[:, None] & md[None, :], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(OUT + t * stride_t + h * stride_h + d, o.to(OUT.dtype.element_ty), mask=md)


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(Q, K, V, KS, VS, BT, CU, LENS, OUT, scale, window, softcap,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_sh,
                    stride_bt, stride_ot, stride_oh,
                    BS: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, INT8: tl.constexpr,
                    SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, P_DTYPE: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    qb = tl.program_id(2)
    q0 = tl.load(CU + c).to(tl.int32)
    q_len = tl.load(CU + c + 1).to(tl.int32) - q0
    n = tl.load(LENS + c).to(tl.int32)
    r = tl.arange(0, BLOCK_Q * BLOCK_G)                 # row = query token x head of the group
    tok = qb * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    valid = (tok < q_len) & (g < G)
    md = d < HD
    qpos = n - q_len + tok                              # the query's position in its sequence
    q = tl.load(Q + (q0 + tok)[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=valid[:, None] & md[None, :], other=0.0)
    first = n - q_len + qb * BLOCK_Q                    # this program's first and last query positions
    last = tl.minimum(n - q_len + (qb + 1) * BLOCK_Q, n) - 1
    lo = tl.maximum(first - window + 1, 0)
    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, last + 1, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mn = pos <= last
        sc, v = _tile(q, K, V, KS, VS, BT + c * stride_bt, pos, mn, h, d, md, scale, softcap, stride_kb, stride_kt,
                      stride_kh, stride_sb, stride_st, stride_sh, BS, INT8, SOFTCAP, UPCAST)
        see = valid[:, None] & mn[None, :] & (pos[None, :] <= qpos[:, None]) & (pos[None, :] > qpos[:, None] - window)
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, tl.where(see, sc, float("-inf")), v, P_DTYPE)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(OUT + (q0 + tok)[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh + d[None, :],
             o.to(OUT.dtype.element_ty), mask=valid[:, None] & md[None, :])


INTERPRETED = bool(knobs.runtime.interpret)     # the kernels run in the interpreter (CPU tensors)


def _launch(kernel, like: torch.Tensor, grid, *args, **meta) -> None:
    if (like.device.type == "cpu") != INTERPRETED:
        raise RuntimeError(f"Triton attention on a {like.device.type} tensor needs TRITON_INTERPRET="
                           f"{int(like.device.type == 'cpu')} before triton is first imported")
    kernel[grid](*args, **meta)


def _dot_dtypes(q: torch.Tensor) -> dict:
    """P_DTYPE: the probabilities are rounded to q's type before the P @ V product (as SDPA does in half
    types); UPCAST: the interpreter multiplies half types as float32 (exact products, as a GPU's tensor
    cores with float32 accumulation)."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    p = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(q.dtype, tl.float32)
    return {"UPCAST": INTERPRETED and half, "P_DTYPE": p}


def _scale_strides(kv) -> tuple[int, int, int]:
    return tuple(kv.k_scale.stride()) if kv.k_scale is not None else (0, 0, 0)


# ---------------------------------------------------------------------------------------------- entry points

def write_kv(kv, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values (T, n_kv, hd) into their slots, in the cache's format."""
    T, n_kv, hd = k.shape
    if not T:
        return
    int8 = kv.k.dtype == torch.int8
    for x, cache, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
        x = x if x.stride(-1) == 1 else x.contiguous()
        flat = cache.view(-1, n_kv, hd)
        s = scales.view(-1, n_kv) if int8 else flat          # unused without int8
        _launch(_write_kv_kernel, x, (T, n_kv), x, flat, s, slot_mapping, x.stride(0), x.stride(1), flat.stride(0),
                flat.stride(1), s.stride(0), s.stride(1), HD=hd, BLOCK_D=_next_pow2(hd, 1), INT8=int8)


def decode_attention(q: torch.Tensor, kv, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     window: int = 0, softcap: float | None = None, max_context: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q: (D, n_heads, hd), one row per sequence -> (D, n_heads, hd)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    D, nh, hd = q.shape
    n_kv, bs = kv.k.shape[2], kv.k.shape[1]
    G = nh // n_kv
    out = torch.empty_like(q) if out is None else out
    if not D:
        return out
    if max_context is None:
        max_context = int(context_lens.max())
    span = min(max_context, window) if window else max_context
    splits = max(1, triton.cdiv(span, SPLIT_TOKENS))
    mid_o = torch.empty((D, nh, splits, hd), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((D, nh, splits), dtype=torch.float32, device=q.device)
    ks, vs = (kv.k_scale, kv.v_scale) if kv.k_scale is not None else (kv.k, kv.v)
    bd = _next_pow2(hd)
    _launch(_decode_kernel, q, (D, n_kv, splits), q, kv.k, kv.v, ks, vs, block_tables, context_lens, mid_o, mid_l,
            scale, window or FULL, softcap or 0.0, q.stride(0), q.stride(1), *kv.k.stride()[:3],
            *_scale_strides(kv), block_tables.stride(0), *mid_o.stride()[:3], *mid_l.stride()[:2],
            BS=bs, G=G, HD=hd, BLOCK_G=_next_pow2(G), BLOCK_D=bd, BLOCK_N=64 if bd <= 128 else 32,
            SPLIT=SPLIT_TOKENS, INT8=kv.k.dtype == torch.int8, SOFTCAP=bool(softcap), **_dot_dtypes(q))
    _launch(_merge_kernel, q, (D, nh), mid_o, mid_l, out, splits, *mid_o.stride()[:3], *mid_l.stride()[:2],
            out.stride(0), out.stride(1), HD=hd, BLOCK_S=_next_pow2(splits, MERGE_LANES), BLOCK_D=bd)
    return out


def prefill_attention(q: torch.Tensor, kv, block_tables: torch.Tensor, cu_q: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float | None = None,
                      max_q: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: the prefill chunks' rows (sum q_len, n_heads, hd); chunk p is rows cu_q[p]:cu_q[p + 1], the last
    q_len of its context_lens[p] positions."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    T, nh, hd = q.shape
    n_kv, bs = kv.k.shape[2], kv.k.shape[1]
    G = nh // n_kv
    out = torch.empty_like(q) if out is None else out
    P = context_lens.shape[0]
    if not T or not P:
        return out
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())
    bg = _next_pow2(G, 1)
    block_q = max(1, 64 // bg) if q.device.type != "cpu" else max(1, 16 // bg)
    ks, vs = (kv.k_scale, kv.v_scale) if kv.k_scale is not None else (kv.k, kv.v)
    bd = _next_pow2(hd)
    _launch(_prefill_kernel, q, (P, n_kv, triton.cdiv(max_q, block_q)), q, kv.k, kv.v, ks, vs, block_tables, cu_q,
            context_lens, out, scale, window or FULL, softcap or 0.0, q.stride(0), q.stride(1), *kv.k.stride()[:3],
            *_scale_strides(kv), block_tables.stride(0), out.stride(0), out.stride(1),
            BS=bs, G=G, HD=hd, BLOCK_G=bg, BLOCK_Q=block_q, BLOCK_D=bd, BLOCK_N=64 if bd <= 128 else 32,
            INT8=kv.k.dtype == torch.int8, SOFTCAP=bool(softcap), **_dot_dtypes(q))
    return out
