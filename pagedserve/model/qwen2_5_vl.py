"""Qwen2.5-VL, stated as what it differs in from the vision families we have and from Qwen2:

- the tower: HF's image processor (saved with the model) resizes an image to multiples of
  patch_size x spatial_merge_size (smart_resize), repeats it to `temporal_patch_size` frames and cuts it
  into patches already laid out merge-block by merge-block (each 2x2 block of patches consecutive). A
  Conv3d embeds the patches; the ViT's blocks (RMSNorm, SwiGLU with biases) rotate q and k by each
  patch's (row, col) (2D rotary); most blocks attend only within windows of `window_size` pixels
  (`fullatt_block_indexes` attend over the whole image), the patches reordered window by window for
  them; the merger RMS-normalizes, concatenates each 2x2 block into one vector and maps it through a
  GELU MLP into the language model: an image of h x w patches is h/2 x w/2 tokens (a count per size);
- the language model: Qwen2 with M-RoPE. A token's position has three rows (temporal, height, width);
  the rotary frequencies are split into `mrope_section` parts, each rotated by its own row (RopeTable).
  A text token's rows are equal; an image's tokens take (p, p + row, p + col) from the position p its
  first token would have, and the text after it goes on from p + max(rows, cols), not from its index
  (HF's get_rope_index). So a position is the token's index plus a shift that grows (negatively) with
  each image before it: `core.request.rope_shift`, from each MMFeature's `grid` (the runner's
  `_mrope_positions` turns them into rows). Decode continues at index + the shift after the last image
  (HF's rope_deltas); a prompt without images is Qwen2 as is.

One MMFeature is one image (its patches and grid: `QwenVLImage`); its token grid rides on the feature
(`MMFeature.grid`) so the scheduler and runner know positions without the pixels. The cache keeps keys
after rotation, so a block may be shared only where positions match: a block's hash chains through
every block before it and carries the content hash of each image it overlaps, and an image's content
fixes its grid, so equal hashes mean equal positions (two images with the same token ids and another
grid differ by their hash)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.model.families import UnsupportedModelError
from pagedserve.model.vision import _check


@dataclass(slots=True, frozen=True)
class QwenVLImage:
    """One image's encoder input: HF's flattened patches and their grid."""

    pixels: torch.Tensor                  # (t * h * w, C * temporal_patch * patch * patch), merge-block order
    grid: tuple[int, int, int]            # (t, h, w) in patches, as HF's image_grid_thw

    def to(self, device) -> QwenVLImage:
        return QwenVLImage(self.pixels.to(device), self.grid)


@dataclass(slots=True, frozen=True)
class QwenVLVisionConfig:
    """The windowed ViT, the 2x2 merger, and the tokens around an image."""

    hidden_size: int = 1280
    intermediate_size: int = 3420
    depth: int = 32
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112                # pixels a window spans (per side)
    fullatt_blocks: tuple[int, ...] = (7, 15, 23, 31)
    act: str = "silu"
    rope_theta: float = 10000.0
    text_hidden_size: int = 3584          # the merger's output (out_hidden_size)
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    max_image_tokens: int = 16384         # the processor's max_pixels / (patch * merge)^2: an image's most tokens

    @property
    def image_seq_len(self) -> int:
        """The most image tokens one image can take (the engine's budgets; the count depends on its size)."""
        return self.max_image_tokens

    @property
    def factor(self) -> int:
        """Pixels per image token, per side."""
        return self.patch_size * self.spatial_merge_size

    def build(self) -> nn.Module:
        return QwenVLVision(self)

    def take_weights(self, weights: dict) -> dict:
        """HF's `visual.` tensors (or `model.visual.`), popped from weights, under QwenVLVision's names."""
        sd = {}
        for key in [k for k in weights if k.removeprefix("model.").startswith("visual.")]:
            sd[key.removeprefix("model.").removeprefix("visual.")] = weights.pop(key)
        return sd

    def check_processor(self, path: str, processor) -> None:
        """The saved image processor must cut the patches this tower embeds; otherwise refused at load."""
        for field, want in (("patch_size", self.patch_size), ("temporal_patch_size", self.temporal_patch_size),
                            ("merge_size", self.spatial_merge_size)):
            value = getattr(processor, field, None)
            if value != want:
                raise UnsupportedModelError(f"{path}: the image processor's {field} {value!r} is not the vision "
                                            f"tower's {want!r} ({type(processor).__name__})")


_READS = frozenset({"text_config", "vision_config", "image_token_id", "vision_start_token_id", "vision_end_token_id",
                    "tie_word_embeddings"})
# (video_token_id: a video is refused where it arrives, engine/llm_engine.py; vision_token_id, and the tower's
# in_chans and spatial_patch_size: in Qwen's own config.json files, read by nothing in HF's model)
_INERT = frozenset({"video_token_id", "vision_token_id"})
_TOWER_READS = frozenset({"depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                          "temporal_patch_size", "spatial_merge_size", "window_size", "fullatt_block_indexes",
                          "hidden_act", "out_hidden_size", "rope_parameters"})
_TOWER_INERT = frozenset({"tokens_per_second", "in_chans", "spatial_patch_size"})   # (tokens_per_second: video only)
_ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def qwen2_5_vl_vision_config(hf: dict, path: str | None = None) -> QwenVLVisionConfig:
    """The config of a transformers Qwen2_5_VLConfig dict (after its own defaults), or a refusal naming the
    field we do not compute. `path`: the folder, whose preprocessor_config.json bounds an image's tokens."""
    _check("qwen2_5_vl", hf, _READS, _INERT)
    vc = hf["vision_config"]
    _check("qwen2_5_vl vision_config", vc, _TOWER_READS, _TOWER_INERT)
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type", "rope_theta"}:
        raise UnsupportedModelError(f"qwen2_5_vl: vision_config.rope_parameters {rope} is not implemented "
                                    "(supported: axial, rope_theta)")
    if vc["hidden_act"] not in _ACTS:
        raise UnsupportedModelError(f"qwen2_5_vl: vision_config.hidden_act={vc['hidden_act']!r} is not implemented "
                                    f"(supported: {', '.join(_ACTS)})")
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(vc[key], int):
            raise UnsupportedModelError(f"qwen2_5_vl: vision_config.{key}={vc[key]!r} is not implemented (an int)")
    merge, patch, window = vc["spatial_merge_size"], vc["patch_size"], vc["window_size"]
    if window // merge // patch < 1:
        raise UnsupportedModelError(f"qwen2_5_vl: vision_config.window_size {window} is smaller than one merged "
                                    f"token ({merge} x {patch} px)")
    sections = hf["text_config"].get("rope_parameters", {}).get("mrope_section")
    if sections is None:
        raise UnsupportedModelError("qwen2_5_vl: text_config.rope_parameters.mrope_section is missing (M-RoPE)")
    cfg = QwenVLVisionConfig(
        hidden_size=vc["hidden_size"], intermediate_size=vc["intermediate_size"], depth=vc["depth"],
        num_heads=vc["num_heads"], in_channels=vc["in_channels"], patch_size=patch,
        temporal_patch_size=vc["temporal_patch_size"], spatial_merge_size=merge, window_size=window,
        fullatt_blocks=tuple(vc["fullatt_block_indexes"]), act=vc["hidden_act"],
        rope_theta=float(rope.get("rope_theta", 10000.0)), text_hidden_size=vc["out_hidden_size"],
        image_token_id=hf["image_token_id"], vision_start_token_id=hf["vision_start_token_id"],
        vision_end_token_id=hf["vision_end_token_id"])
    if hf["image_token_id"] >= hf["text_config"]["vocab_size"]:
        raise UnsupportedModelError(f"qwen2_5_vl: image_token_id {hf['image_token_id']} is outside the text model's "
                                    f"vocabulary ({hf['text_config']['vocab_size']})")
    most = _max_pixels(path)
    if most is not None:
        cfg = replace(cfg, max_image_tokens=max(1, most // cfg.factor ** 2))
    return cfg


def _max_pixels(path: str | None) -> int | None:
    """preprocessor_config.json's bound on an image's pixels (size.longest_edge, or the older max_pixels)."""
    try:
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            pc = json.load(f)
    except (TypeError, FileNotFoundError):
        return None
    return (pc.get("size") or {}).get("longest_edge") or pc.get("max_pixels")


def image_tokens(grid: tuple[int, int, int], merge: int) -> tuple[int, int]:
    """An image's token grid (rows, cols): its patch grid merged (one frame: an image)."""
    t, h, w = grid
    if t != 1:
        raise ValueError(f"an image has one temporal patch, got grid {grid} (video is not supported)")
    return h // merge, w // merge


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.empty(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVLVisionConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i), nn.Linear(h, i), nn.Linear(i, h)
        self.act = _ACTS[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionAttention(nn.Module):
    def __init__(self, cfg: QwenVLVisionConfig):
        super().__init__()
        self.qkv, self.proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size), nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.heads = cfg.num_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        L = x.shape[0]                                          # (L, h): one image's patches, window order
        q, k, v = self.qkv(x).view(L, 3, self.heads, -1).unbind(1)   # (L, heads, hd) each
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in parts)).transpose(0, 1)
               for parts in zip(*(t.split(lengths) for t in (q, k, v)))]   # each window (or the image) alone
        return self.proj(torch.cat(out).reshape(L, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb_vision: in float32, half-split."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), -1) * sin).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVLVisionConfig):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.attn, self.mlp = VisionAttention(cfg), VisionMLP(cfg)

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: QwenVLVisionConfig):
        super().__init__()
        width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.text_hidden_size))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # (L, h) -> (L / merge², text hidden)
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVLVision(nn.Module):
    """Patches -> Conv3d -> blocks (windowed or full, 2D rotary) -> merger: images -> (tokens, text hidden) each."""

    def __init__(self, cfg: QwenVLVisionConfig):
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, k, k, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        hd = cfg.hidden_size // cfg.num_heads // 2                  # each of row and col rotates a quarter
        with torch.device("cpu"):                                    # (host arithmetic, also when built on meta)
            self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)

    def forward(self, images: list[QwenVLImage]) -> list[torch.Tensor]:
        return [self.encode(im) for im in images]

    def encode(self, im: QwenVLImage) -> torch.Tensor:
        cfg, unit = self.cfg, self.cfg.spatial_merge_size ** 2
        w = self.patch_embed.proj.weight
        x = self.patch_embed.proj(im.pixels.to(w.dtype).view(-1, cfg.in_channels, cfg.temporal_patch_size,
                                                              cfg.patch_size, cfg.patch_size)).view(-1, cfg.hidden_size)
        order, windows = window_order(im.grid, cfg)
        order = order.to(x.device)
        L = x.shape[0]
        x = x.view(L // unit, unit, -1)[order].reshape(L, -1)       # window by window (merge blocks kept whole)
        rc = patch_positions(im.grid, cfg.spatial_merge_size).to(x.device)
        angles = rc[..., None].float() * self.inv_freq.to(x.device)
        angles = angles.flatten(1)                                   # (L, hd / 2): the row's, then the col's
        angles = angles.view(L // unit, unit, -1)[order].reshape(L, -1)
        emb = torch.cat((angles, angles), -1)[:, None, :]            # (L, 1, head dim)
        cos, sin = emb.cos(), emb.sin()
        whole = [L]
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, whole if i in cfg.fullatt_blocks else windows)
        x = self.merger(x)
        return x[torch.argsort(order)]                               # back to raster order of the merged grid


def patch_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """Each patch's (row, col), in the processor's merge-block order: (t * h * w, 2)."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    pos = torch.stack([p.reshape(shape).transpose(1, 2).flatten() for p in (rows, cols)], -1)
    return pos.repeat(t, 1)


def window_order(grid: tuple[int, int, int], cfg: QwenVLVisionConfig) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens in window order (HF's get_vision_window_index: square windows of window_size
    pixels over the merged grid, the last row and column of windows partial) and each window's patches."""
    t, h, w = grid
    m = cfg.spatial_merge_size
    side = cfg.window_size // m // cfg.patch_size                   # merged tokens per window side
    gh, gw = h // m, w // m
    index = torch.arange(t * gh * gw).view(t, gh, gw)
    order, lengths = [], []
    for f in range(t):
        for r in range(0, gh, side):
            for c in range(0, gw, side):
                win = index[f, r:r + side, c:c + side].flatten()
                order.append(win)
                lengths.append(win.numel() * m * m)
    return torch.cat(order), lengths
