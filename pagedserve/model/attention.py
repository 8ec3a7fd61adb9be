"""Paged attention: K/V live in fixed-size blocks of one preallocated pool; reads go through
per-sequence block tables.

Cache layout per layer: k_cache, v_cache of shape (num_blocks, block_size, n_kv, hd).
Block 0 is the engine's reserved null block: block tables are padded with it, so a gather
of a padded row reads harmless data that the mask hides.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels import paged_decode_attention


@dataclass(slots=True)
class PrefillSeq:
    """One sequence that computes q_len > 1 tokens (a prefill chunk) in this step."""

    start: int                    # first row of this sequence in the flattened batch
    end: int                      # one past its last row
    context_len: int              # tokens in the cache after this step (cached prefix + chunk)
    block_ids: torch.Tensor       # (n_blocks,) long: physical blocks holding positions 0..context_len-1
    mask: torch.Tensor | None     # (q_len, context_len) bool, None when plain causal (no cached prefix)


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one flattened batch; built once per step, used by every layer.

    Rows [0, num_decodes) are single decode tokens, one per sequence; prefill chunks follow.
    """

    slot_mapping: torch.Tensor                      # (T,) long: block_id * block_size + offset of each token's K/V
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # (D, max_blocks) long, padded with the null block
    decode_context_lens: torch.Tensor | None = None  # (D,) int32: keys each decode token attends to
    decode_mask: torch.Tensor | None = None          # (D, 1, 1, max_blocks * block_size) bool: True = attend
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode_scratch: torch.Tensor | None = None       # set: decode attention by the C kernel (no gather copy)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values (T, n_kv, hd) into their slots of the paged cache."""
    n_kv, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, n_heads, hd) -> (T, n_heads, hd), reading keys/values through the block tables."""
    out = torch.empty_like(q)
    d = md.num_decodes
    if d and md.decode_scratch is not None:
        paged_decode_attention(q[:d].contiguous(), k_cache, v_cache, md.decode_block_tables, md.decode_context_lens,
                               scale, out=out[:d], scores=md.decode_scratch)
    elif d:
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, md, scale)
    for p in md.prefills:
        out[p.start:p.end] = _prefill_attention(q[p.start:p.end], k_cache, v_cache, p, scale)
    return out


def _decode_attention(q, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Fallback (no C compiler, or not fp32 on CPU): one batched gather of every decode row's context,
    which copies each context; the kernel does not. (D, max_blocks, bs, n_kv, hd) -> (D, n_kv, S, hd)"""
    k = k_cache[md.decode_block_tables].flatten(1, 2).transpose(1, 2)
    v = v_cache[md.decode_block_tables].flatten(1, 2).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=md.decode_mask,
                                       scale=scale, enable_gqa=True)   # (D, nh, 1, hd)
    return o.squeeze(2)


def _prefill_attention(q, k_cache, v_cache, p: PrefillSeq, scale: float) -> torch.Tensor:
    n = p.context_len
    k = k_cache[p.block_ids].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)   # (1, n_kv, n, hd)
    v = v_cache[p.block_ids].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)                                         # (1, nh, q_len, hd)
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=p.mask, is_causal=p.mask is None,
                                       scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
