"""Paged attention: K/V live in fixed-size blocks of one preallocated pool; reads go through
per-sequence block tables.

Cache layout per layer: k, v of shape (num_blocks, block_size, n_kv, hd) in the KV cache dtype:
float32, bfloat16, or int8 with one float32 scale per token and kv head (k_scale, v_scale of
shape (num_blocks, block_size, n_kv)). Block 0 is the engine's reserved null block: block tables
are padded with it.

Three paths read the cache (the runner picks one per engine: attention_backend):
  native  on the CPU the C kernels (pagedserve.kernels) read the cache in place, every format natively:
          decode rows in one call per layer, every prefill chunk of the step in one more (on AVX-512
          hosts; on AVX2 ones SDPA over the gathered context is faster: kernels.native_prefill_pays)
  triton  on CUDA the Triton kernels (kernels/triton_attention.py) write and read it in place; on the
          CPU the same kernels run in Triton's interpreter (tests)
  torch   the reference: each context gathered (a copy), then SDPA
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve import kernels

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "int8": torch.int8}


def kv_scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scale stored per token and kv head next to the K (and the V) row."""
    return 4 if dtype == torch.int8 else 0


@dataclass(slots=True, frozen=True)
class LayerKV:
    """One layer's K/V blocks (views into the runner's pool)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None    # int8 only
    v_scale: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one flattened batch; built once per step, used by every layer.

    Rows [0, num_decodes) are single decode tokens, one per sequence; prefill chunks follow, chunk p
    in rows num_decodes + prefill_cu_q[p] .. num_decodes + prefill_cu_q[p + 1] - 1, the last rows of
    its prefill_context_lens[p] positions (a cached prefix, then the chunk).
    """

    slot_mapping: torch.Tensor                          # (T,) long: block_id * block_size + offset of each token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None     # (D, max_blocks) long, padded with the null block
    decode_context_lens: torch.Tensor | None = None     # (D,) long: keys each decode token attends to
    prefill_block_tables: torch.Tensor | None = None    # (P, max_blocks) long
    prefill_cu_q: torch.Tensor | None = None            # (P + 1,) long
    prefill_context_lens: torch.Tensor | None = None    # (P,) long
    native: bool = False                                 # the C kernels read the cache (decode rows)
    native_prefill: bool = False                         # ... and prefill chunks (kernels.native_prefill_pays)
    bf16_dots: bool = False                              # ... multiplying in bf16 (kernels.bf16_dots: a bf16 model)
    triton: bool = False                                 # the Triton kernels write and read the cache
    max_decode_context: int | None = None                # host-side maxima: Triton's grids without a sync
    max_prefill_q: int | None = None
    # (prefill rows,) long: the last key position each prefill query sees, past its own where its image's
    # tokens attend both ways (Gemma 3, model/gemma3_vision.py); None: causal. Read by the torch path alone
    prefill_key_limits: torch.Tensor | None = None

    @property
    def num_prefills(self) -> int:
        return 0 if self.prefill_context_lens is None else self.prefill_context_lens.shape[0]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(q_len, context_len) of each prefill chunk."""
        if not self.num_prefills:
            return []
        q = (self.prefill_cu_q[1:] - self.prefill_cu_q[:-1]).tolist()
        return list(zip(q, self.prefill_context_lens.tolist()))


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, triton: bool = False) -> None:
    """Scatter this step's keys/values (T, n_kv, hd) into their slots, in the cache's format."""
    if triton:
        return _triton().write_kv(kv, k, v, slot_mapping)
    n_kv, hd = k.shape[1], k.shape[2]
    if kv.k.dtype == torch.int8:
        for x, cache, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            x = x.float()
            s = x.abs().amax(-1).clamp_min(1e-8) / 127.0                    # (T, n_kv): per token and head
            qx = torch.round(x / s.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
            cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, qx)
            scales.view(-1, n_kv).index_copy_(0, slot_mapping, s)
        return
    kv.k.view(-1, n_kv, hd).index_copy_(0, slot_mapping, k.to(kv.k.dtype))
    kv.v.view(-1, n_kv, hd).index_copy_(0, slot_mapping, v.to(kv.v.dtype))


def paged_attention(q: torch.Tensor, kv: LayerKV, md: AttentionMetadata, scale: float, window: int = 0,
                    softcap: float | None = None) -> torch.Tensor:
    """q: (T, n_heads, hd) -> (T, n_heads, hd), reading keys/values through the block tables.
    window > 0: each query sees only the last `window` positions (itself included), as HF's
    sliding-window mask (key > query - window). softcap (Gemma 2): scores -> cap * tanh(scores / cap),
    on the torch path (the C kernels do not soft-cap)."""
    d = md.num_decodes
    if md.triton:
        ta, out = _triton(), torch.empty_like(q)
        if d:
            ta.decode_attention(q[:d], kv, md.decode_block_tables, md.decode_context_lens, scale, window, softcap,
                                md.max_decode_context, out[:d])
        if md.num_prefills and md.prefill_key_limits is not None:
            prefill_attention(q[d:], kv, md, scale, out[d:], window, softcap, native=False)
        elif md.num_prefills:
            ta.prefill_attention(q[d:], kv, md.prefill_block_tables, md.prefill_cu_q, md.prefill_context_lens,
                                 scale, window, softcap, md.max_prefill_q, out[d:])
        return out
    if md.native and softcap is None:
        q32 = q.float().contiguous()
        out = torch.empty_like(q32)
        if d:
            decode_attention(q32[:d], kv, md, scale, out[:d], window)
        if md.num_prefills:
            prefill_attention(q32[d:], kv, md, scale, out[d:], window)
        return out.to(q.dtype)
    out = torch.empty_like(q)
    if d:
        out[:d] = decode_attention(q[:d], kv, md, scale, None, window, softcap, native=False)
    if md.num_prefills:
        out[d:] = prefill_attention(q[d:], kv, md, scale, None, window, softcap, native=False)
    return out


def decode_attention(q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None, window: int = 0,
                     softcap: float | None = None, native: bool | None = None) -> torch.Tensor:
    if md.native if native is None else native:
        return kernels.paged_decode_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, md.decode_block_tables,
                                              md.decode_context_lens, scale, out, window=window)
    # torch path: one batched gather of every decode row's context (a copy; the kernel reads in place)
    bt = md.decode_block_tables
    k = _dequant(_blocks(kv.k, bt), _blocks(kv.k_scale, bt), q.dtype).flatten(1, 2).transpose(1, 2)
    v = _dequant(_blocks(kv.v, bt), _blocks(kv.v_scale, bt), q.dtype).flatten(1, 2).transpose(1, 2)
    key = torch.arange(k.shape[2], device=q.device)[None]
    lens = md.decode_context_lens[:, None]
    mask = key < lens
    if window:
        mask &= key >= lens - window
    return _attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap).squeeze(2)


def _attend(q, k, v, mask, scale: float, softcap: float | None, causal: bool = False) -> torch.Tensor:
    """(B, nh, q, hd) x (B, n_kv, keys, hd): SDPA, or with a soft-cap the same in plain torch."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None:
        n = k.shape[2]
        mask = torch.ones(q.shape[2], n, dtype=torch.bool, device=q.device).tril(n - q.shape[2])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(v.dtype) @ v


def prefill_attention(q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None, window: int = 0,
                      softcap: float | None = None, native: bool | None = None) -> torch.Tensor:
    """All prefill chunks of the step; q holds their rows only (written into `out` when given). native
    None: the C kernel where md.native_prefill says it pays, else SDPA over each gathered context. A step
    whose queries see past themselves (md.prefill_key_limits: an image's two-way span) takes SDPA with
    the explicit mask (a copy of each context: the cost of a step that prefills a Gemma 3 image)."""
    limits = md.prefill_key_limits
    if (md.native_prefill if native is None else native) and limits is None:
        return kernels.paged_prefill_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, md.prefill_block_tables,
                                               md.prefill_cu_q, md.prefill_context_lens, scale, out, window=window,
                                               bf16_dots=md.bf16_dots)
    out = torch.empty_like(q) if out is None else out
    bs = kv.k.shape[1]
    cu = md.prefill_cu_q.tolist()
    for p, (q_len, n) in enumerate(md.prefill_shapes()):
        bt = md.prefill_block_tables[p, : -(-n // bs)]
        k = _dequant(_blocks(kv.k, bt), _blocks(kv.k_scale, bt), q.dtype).flatten(0, 1)[:n]
        v = _dequant(_blocks(kv.v, bt), _blocks(kv.v_scale, bt), q.dtype).flatten(0, 1)[:n]
        qh = q[cu[p]:cu[p + 1]].transpose(0, 1).unsqueeze(0)                  # (1, nh, q_len, hd)
        mask = None
        if n > q_len or window or limits is not None:   # a cached prefix: query i sits at position n - q_len + i
            pos = torch.arange(n - q_len, n, device=q.device).unsqueeze(1)
            key = torch.arange(n, device=q.device).unsqueeze(0)
            last = pos if limits is None else limits[cu[p]:cu[p + 1]].unsqueeze(1)
            mask = (key <= last) & (key > pos - window) if window else key <= last
        o = _attend(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), mask, scale, softcap,
                    causal=True)
        out[cu[p]:cu[p + 1]] = o.squeeze(0).transpose(0, 1)
    return out


def _triton():
    from pagedserve.kernels import triton_attention     # imports triton: only when the path is chosen
    return triton_attention


def _blocks(x: torch.Tensor | None, bt: torch.Tensor) -> torch.Tensor | None:
    """x[bt]: the blocks of a table (any shape of block ids), gathered whole. index_select over the pool seen as
    (blocks, block bytes) copies each block as one row; x[bt] (aten::index) copies element by element: 4.8x
    slower on a 2-core AVX2 host, ~22 ms of a step whose 16-token chunk reads 1,400 tokens of context in 30
    layers (issue 54: the floor step of a traffic class)."""
    if x is None or not x.is_contiguous():
        return None if x is None else x[bt]
    flat = bt.reshape(-1)
    return torch.index_select(x.view(x.shape[0], -1), 0, flat).view(*bt.shape, *x.shape[1:])


def _dequant(x: torch.Tensor, s: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if s is None else (x.float() * s.unsqueeze(-1)).to(dtype)
