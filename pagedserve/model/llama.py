"""A Llama-family decoder over one flattened token batch and a paged KV cache.

RMSNorm, RoPE (optionally llama3-scaled), SwiGLU MLP, grouped-query attention, tied or untied
LM head. q/k/v and gate/up projections are fused into one matmul each: fewer, larger GEMMs.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.group import TPGroup
from pagedserve.distributed.sharding import vocab_slice
from pagedserve.model.attention import AttentionMetadata, LayerKV, paged_attention, write_kv
from pagedserve.model.config import ModelConfig
from pagedserve.model.quant import PackedWeight, measure_crossover


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, transposed: bool = False) -> torch.Tensor:
    """x @ w.T. With `transposed`, batches of 2..128 rows are computed as (w @ x.T).T: MKL runs that
    up to 3x faster than F.linear on some CPUs (AMD EPYC: 3 rows x the 49152-row LM head, 10 ms vs
    31 ms) and 2-3x slower on others (Intel Xeon with AVX-512), so LlamaForCausalLM.choose_gemm_form()
    measures both on the model's own weights when it is loaded. A PackedWeight (--quantization)
    multiplies itself."""
    if isinstance(w, PackedWeight):
        return w.matmul(x, b)
    if not transposed or not 2 <= x.shape[0] <= 128 or x.device.type != "cpu":
        return F.linear(x, w, b)
    y = (w @ x.t()).t().contiguous()
    return y if b is None else y + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, linear)")
    return inv


class DecoderLayer(nn.Module):
    """Under tensor parallelism (tp.size = N) the layer holds 1/N of the heads and of the MLP
    (pagedserve.distributed.sharding) and all-reduces the outputs of o_proj and down_proj."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        h, hd, n = cfg.hidden_size, cfg.head_dim, tp.size
        self.tp = tp
        self.n_heads, self.n_kv, self.hd, self.eps = cfg.num_heads // n, cfg.num_kv_heads // n, hd, cfg.rms_norm_eps
        inter = cfg.intermediate_size // n
        self.attn_norm = nn.Parameter(torch.empty(h))
        self.qkv_proj = nn.Linear(h, (self.n_heads + 2 * self.n_kv) * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.empty(h))
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.transposed = False        # small-batch GEMM form, see linear()

    def forward(self, x, cos, sin, kv: LayerKV, md: AttentionMetadata) -> torch.Tensor:
        T, tr = x.shape[0], self.transposed
        qkv = linear(rms_norm(x, self.attn_norm, self.eps), self.qkv_proj.weight, self.qkv_proj.bias, tr)
        n_qk = self.n_heads + self.n_kv
        qk = qkv[:, : n_qk * self.hd].view(T, n_qk, self.hd)
        qk = qk * cos + _rotate_half(qk) * sin                  # RoPE on q and k at once
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads:]
        v = qkv[:, n_qk * self.hd:].view(T, self.n_kv, self.hd)
        write_kv(kv, k, v, md.slot_mapping)
        o = paged_attention(q, kv, md, 1.0 / math.sqrt(self.hd))
        x = x + self.tp.all_reduce(linear(o.reshape(T, -1), self.o_proj.weight, None, tr))
        gate, up = linear(rms_norm(x, self.mlp_norm, self.eps), self.gate_up_proj.weight, None, tr).chunk(2, dim=-1)
        return x + self.tp.all_reduce(linear(F.silu(gate) * up, self.down_proj.weight, None, tr))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaForCausalLM(nn.Module):
    """forward() returns hidden states of every row; compute_logits() runs the LM head on the few
    rows that will sample. `cfg` is the whole model's shape; under tensor parallelism this rank
    holds its slice of the vocabulary and of every layer, and logits come back on rank 0 only."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TPGroup.single()
        self.vocab_first, self.vocab_end, vocab_rows = vocab_slice(cfg.vocab_size, tp.rank, tp.size)
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.transposed = False        # small-batch GEMM form of the LM head, see linear()
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None   # cos, sin: (positions, 1, hd)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each position, (T, 1, hd), looked up in a table grown on demand (vLLM's
        cos_sin_cache). The angles are float32 products as in HF; their cos/sin are taken in float64
        by numpy and rounded once: torch's threaded float32 cos measured up to 1.5e-4 off on half the
        rows of the first call in some processes, which moved logits by 7e-3."""
        n = int(positions.max()) + 1 if positions.numel() else 0
        cache = self._rope_cache
        if cache is None or n > cache[0].shape[0] or cache[0].dtype != self.norm.dtype \
                or cache[0].device != self.norm.device:
            size = cache[0].shape[0] if cache is not None else 0
            cache = self._rope_cache = self._rope_table(max(n, 1024, 2 * size if n > size else size))
        cos, sin = cache
        return cos[positions], sin[positions]

    def _rope_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq.detach().cpu().float().numpy()
        freqs = np.arange(n, dtype=np.float32)[:, None] * inv[None, :]          # (n, hd/2), float32 as HF
        emb = np.concatenate((freqs, freqs), axis=-1).astype(np.float64)[:, None, :]
        dt, dev = self.norm.dtype, self.norm.device     # the compute dtype (the embedding may be packed)
        return (torch.from_numpy(np.cos(emb).astype(np.float32)).to(dev, dt),
                torch.from_numpy(np.sin(emb).astype(np.float32)).to(dev, dt))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                md: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)                                          # (T, hidden)
        cos, sin = self.rope(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, md)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # vocab-parallel: each rank looks up the ids in its slice, zeros elsewhere; the sum is exact
        mine = (input_ids >= self.vocab_first) & (input_ids < self.vocab_end)
        x = self.embed_tokens(torch.where(mine, input_ids - self.vocab_first, 0))
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits (rows, vocab); under tensor parallelism on rank 0 only (None elsewhere)."""
        h = rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.tp.gather_columns(linear(h, w, None, self.transposed).float())
        return None if logits is None else logits[:, :self.cfg.vocab_size]

    @torch.inference_mode()
    def choose_gemm_form(self) -> str:
        """Time F.linear against (w @ x.T).T on this model's MLP and LM-head weights at 8 and 64 rows;
        the transposed form is kept for batches of 2..128 rows only when it is clearly faster (1.5x:
        where the two are close, run-to-run noise must not flip the numerics between runs).
        PAGEDSERVE_SMALL_M_GEMM=linear|transposed decides instead. Returns the line logged at load."""
        forced = os.environ.get("PAGEDSERVE_SMALL_M_GEMM")
        if forced not in (None, "linear", "transposed"):
            raise ValueError(f"PAGEDSERVE_SMALL_M_GEMM must be linear or transposed, got {forced!r}")
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if isinstance(self.layers[0].gate_up_proj.weight, PackedWeight):
            return self._choose_packed_crossover(head)
        if head.device.type != "cpu":
            return "small-batch GEMMs: F.linear (not on CPU)"
        if forced:
            use, why = forced == "transposed", "PAGEDSERVE_SMALL_M_GEMM"
        else:
            t = {False: 0.0, True: 0.0}
            for w in (self.layers[0].gate_up_proj.weight, head):
                for m in (8, 64):
                    x = torch.randn(m, w.shape[1], dtype=w.dtype)
                    for form in (False, True):
                        linear(x, w, None, form)
                        t0 = time.perf_counter()
                        for _ in range(3):
                            linear(x, w, None, form)
                        t[form] += time.perf_counter() - t0
            use = 1.5 * t[True] < t[False]
            why = f"measured {1e3 * t[False]:.1f} ms F.linear vs {1e3 * t[True]:.1f} ms (w @ x.T).T"
        self.transposed = use
        for layer in self.layers:
            layer.transposed = use
        return f"small-batch GEMMs: {'(w @ x.T).T' if use else 'F.linear'} ({why})"

    def _choose_packed_crossover(self, head) -> str:
        """Packed weights: up to how many rows qmatmul beats dequantize + GEMM, measured per shape."""
        lines = []
        for name, w in (("layers", self.layers[0].gate_up_proj.weight), ("LM head", head)):
            if not isinstance(w, PackedWeight):
                continue
            m, line = measure_crossover(w, self.norm.dtype)
            lines.append(f"{name}: {line}")
            targets = [w] if name == "LM head" else [getattr(layer, p).weight for layer in self.layers
                                                   for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
            for t in targets:
                if isinstance(t, PackedWeight):
                    t.small_m = m
        return "packed GEMMs: " + "; ".join(lines)
