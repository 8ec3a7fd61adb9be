"""Rotary position embeddings: inverse frequencies per RoPE type (default, linear, llama3, longrope),
and the cos/sin table per position that every layer of one kind shares (vLLM's cos_sin_cache).

A model may hold several tables: Gemma 3's sliding layers use their own base, SmolLM3's NoPE layers
none, Phi-3's longrope a short and a long set of factors."""
from __future__ import annotations

import math

import numpy as np
import torch

from pagedserve.model.config import ModelConfig


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None,
                  factors: list[float] | None = None) -> torch.Tensor:
    """Inverse frequencies of the rotated dims; `theta`/`scaling` default to the model's global RoPE.
    `factors`: longrope's per-frequency divisors (short or long)."""
    dim = rotary_dim(cfg)
    theta = cfg.rope_theta if theta is None else theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if factors is not None:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    inv = 1.0 / (theta ** exponents)
    rs = (cfg.rope_scaling or {}) if scaling is None else scaling
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
    elif kind not in (None, "default", "longrope"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, linear, longrope)")
    return inv


class RopeTable:
    """cos and sin at each position, (T, 1, rotary dim), looked up in a table grown on demand. The
    angles are float32 products as in HF; their cos/sin are taken in float64 by numpy and rounded
    once: torch's threaded float32 cos measured up to 1.5e-4 off on half the rows of the first call
    in some processes, which moved logits by 7e-3.

    M-RoPE (Qwen2.5-VL, cfg.mrope_section): positions may come as 3 rows (temporal, height, width),
    (3, T); frequency i of each half rotates by row r(i), the rows taking mrope_section frequencies in turn
    (HF's recomposition_frequencies). A 1-D `positions` is all three rows equal: plain RoPE.

    longrope (Phi-3): positions below original_max_position_embeddings use the short factors, the
    others the long ones (HF switches the whole forward to the long factors once a sequence is
    longer, re-rotating nothing already cached: the two agree below that length), and cos/sin are
    scaled by the attention factor."""

    def __init__(self, cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None):
        with torch.device("cpu"):            # host arithmetic, also when the model is built on meta
            self._init(cfg, theta, scaling)

    def _init(self, cfg: ModelConfig, theta: float | None, scaling: dict | None) -> None:
        rs = (cfg.rope_scaling or {}) if scaling is None else scaling
        self.long_from: int | None = None
        self.mscale = 1.0
        if rs.get("rope_type", rs.get("type")) == "longrope":
            orig = rs.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
            factor = rs.get("factor") or cfg.max_position_embeddings / orig
            self.mscale = rs.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig)))
            self.inv = rope_inv_freq(cfg, theta, rs, rs["short_factor"])
            self.long_inv = rope_inv_freq(cfg, theta, rs, rs["long_factor"])
            self.long_from = int(orig)
        else:
            self.inv = rope_inv_freq(cfg, theta, scaling)
        self.mrope_rows: torch.Tensor | None = None     # M-RoPE: the position row each rotated dim reads
        if cfg.mrope_section:
            half = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(cfg.mrope_section)])
            self.mrope_rows = torch.cat((half, half))
        # (dtype, device) -> (cos, sin): a half-precision model's fused decode steps read float32 ones
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype, device,
                 max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """max_position: a bound on `positions` known to the caller (a CUDA graph's capture may not read
        the device's tensors back)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else -1
        n = max_position + 1
        key = (dtype, str(device))
        t = self._tables.get(key)
        if t is None or n > t[0].shape[0]:
            size = t[0].shape[0] if t is not None else 0
            t = self._tables[key] = self._build(max(n, 1024, 2 * size if n > size else size), dtype, device)
        if positions.dim() == 1:
            return t[0][positions], t[1][positions]
        cos, sin = t[0][positions], t[1][positions]                # (3, T, 1, rot): each row's angles
        rows = self.mrope_rows.to(cos.device).view(1, 1, 1, -1).expand(1, *cos.shape[1:])
        return cos.gather(0, rows)[0], sin.gather(0, rows)[0]

    def _build(self, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = np.arange(n, dtype=np.float32)[:, None]
        freqs = pos * self.inv.numpy()[None, :]                                  # (n, rot/2), float32 as HF
        if self.long_from is not None and n > self.long_from:
            freqs[self.long_from:] = pos[self.long_from:] * self.long_inv.numpy()[None, :]
        emb = np.concatenate((freqs, freqs), axis=-1).astype(np.float64)[:, None, :]
        cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
        if self.mscale != 1.0:           # HF: emb.cos() * attention_scaling, in float32
            cos, sin = cos * np.float32(self.mscale), sin * np.float32(self.mscale)
        return torch.from_numpy(cos).to(device, dtype), torch.from_numpy(sin).to(device, dtype)


def rope_tables(cfg: ModelConfig) -> tuple[dict[str, RopeTable], list[str | None]]:
    """The tables a model needs and each layer's key into them (None: a NoPE layer)."""
    tables = {"global": RopeTable(cfg)}
    keys: list[str | None] = ["global"] * cfg.num_layers
    if cfg.local_rope_theta is not None:      # Gemma 3: sliding layers rotate with their own base, unscaled
        tables["local"] = RopeTable(cfg, cfg.local_rope_theta, {"rope_type": "default"})
        keys = ["local" if cfg.window(i) else "global" for i in range(cfg.num_layers)]
    for i in cfg.nope_layers:
        keys[i] = None
    return tables, keys
