"""Megatron-style sharding of a Llama state dict (our fused names) for one tensor-parallel rank.

Column-parallel (each rank computes a slice of the outputs, no communication): the fused qkv
projection (a slice of the query heads and of the KV heads) and the fused gate/up projection.
Row-parallel (each rank holds a slice of the inputs; one all-reduce sums the partial outputs):
o_proj and down_proj. Vocab-parallel: the embedding and the LM head hold a slice of the
vocabulary (padded to equal slices); a lookup is masked and all-reduced, logits are gathered.
Norms are replicated. Each rank's KV cache then holds its own KV heads only.
"""
from __future__ import annotations

import torch

from pagedserve.model.config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, n: int) -> None:
    """A clear error when the model does not split over n ranks."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    if cfg.is_moe and n > 1:
        raise ValueError(f"tensor_parallel_size {n}: the experts of an MoE model ({cfg.arch}) are not sharded; "
                         "use tensor_parallel_size 1")
    parts = {"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads,
             "MLP intermediate size": cfg.intermediate_size}
    bad = [f"{v} {k}" for k, v in parts.items() if v % n]
    if bad:
        ok = [d for d in range(1, cfg.num_kv_heads + 1)
              if all(v % d == 0 for v in parts.values())]
        raise ValueError(f"tensor_parallel_size {n} must divide the model's {cfg.num_heads} attention heads, "
                         f"{cfg.num_kv_heads} KV heads and {cfg.intermediate_size} MLP intermediate size "
                         f"(not: {', '.join(bad)}); sizes that work for this model: {ok}")


def vocab_slice(vocab_size: int, rank: int, n: int) -> tuple[int, int, int]:
    """(first id, end id, rows per rank): rank r holds ids [first, end), padded to `rows per rank`."""
    per = -(-vocab_size // n)
    first = min(rank * per, vocab_size)
    return first, min(first + per, vocab_size), per


def shard_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor], rank: int, n: int) -> dict[str, torch.Tensor]:
    """This rank's slices of every tensor (norms whole)."""
    if n == 1:
        return sd
    check_tensor_parallel(cfg, n)
    hd = cfg.head_dim
    nh, nkv, inter = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.intermediate_size // n
    q0, k0, v0 = 0, cfg.num_heads * hd, (cfg.num_heads + cfg.num_kv_heads) * hd

    def rows(t: torch.Tensor, *spans: tuple[int, int]) -> torch.Tensor:
        return torch.cat([t[a:a + m] for a, m in spans]).contiguous()

    out = {}
    for key, t in sd.items():
        name = key.rsplit(".", 2)[-2] if key.count(".") >= 2 else key
        if name == "qkv_proj":       # weight or bias: rows of q heads, then k heads, then v heads
            out[key] = rows(t, (q0 + rank * nh * hd, nh * hd), (k0 + rank * nkv * hd, nkv * hd),
                            (v0 + rank * nkv * hd, nkv * hd))
        elif name == "gate_up_proj":
            out[key] = rows(t, (rank * inter, inter), (cfg.intermediate_size + rank * inter, inter))
        elif name == "o_proj" and t.dim() == 1:     # a row-parallel bias is added once, by rank 0
            out[key] = t if rank == 0 else torch.zeros_like(t)
        elif name == "o_proj":
            out[key] = t[:, rank * nh * hd:(rank + 1) * nh * hd].contiguous()
        elif name == "down_proj":
            out[key] = t[:, rank * inter:(rank + 1) * inter].contiguous()
        elif key in ("embed_tokens.weight", "lm_head.weight"):
            first, end, per = vocab_slice(cfg.vocab_size, rank, n)
            part = torch.zeros(per, t.shape[1], dtype=t.dtype)
            part[:end - first] = t[first:end]
            out[key] = part
        else:
            out[key] = t
    return out
