"""LLaVA-NeXT (LLaVA-1.6), stated as what it differs in from LLaVA-1.5 (model/vision.py): the same CLIP
tower, feature layer and projector, run on more than one square. HF's processor (saved with the model)
fits the image into the best of `image_grid_pinpoints` (anyres), cuts that into tower-sized patches and
adds the whole image resized (the base image); each patch goes through the tower and the projector, and
`pack` lays the patches' vectors back into one grid, crops the rows or columns that were padding
(unpadding to the image's aspect ratio), and ends every row with the learned `image_newline` vector.
An image is the base image's vectors, then the packed grid row by row: a number of image tokens that
depends on its size (`image_tokens`, HF's LlavaNextProcessor's count).

One MMFeature is the whole image (its patches and its size): unpadding mixes the patches' vectors into
one grid, so no patch's tokens stand alone in the prompt; the encoder cache and prefix keys are the
image's content hash, as for LLaVA-1.5."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.model.families import UnsupportedModelError
from pagedserve.model.vision import LlavaVision, VisionConfig, llava_vision_config, vision_state_dict


@dataclass(slots=True, frozen=True)
class AnyresImage:
    """One image's encoder input: its patches (the base image first) and its size before processing."""

    pixels: torch.Tensor                  # (patches, C, image_size, image_size)
    size: tuple[int, int]                 # (height, width), as HF's image_sizes

    def to(self, device) -> AnyresImage:
        return AnyresImage(self.pixels.to(device), self.size)


def best_resolution(size: tuple[int, int], pinpoints) -> tuple[int, int]:
    """The (height, width) of pinpoints an image of `size` (height, width) is fitted into: the most of
    its pixels kept, then the least padding (HF's select_best_resolution)."""
    h, w = size
    best, most, least_waste = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        waste = ph * pw - kept
        if kept > most or (kept == most and waste < least_waste):
            best, most, least_waste = (ph, pw), kept, waste
    return best


def unpadded(size: tuple[int, int], rows: int, cols: int) -> tuple[int, int, int, int]:
    """The part of a rows x cols vector grid that is the image and not padding: (top, height, left,
    width), computed as HF's unpad_image crops the packed features (the same float steps)."""
    h, w = size
    if w / h > cols / rows:                                 # wider than the grid: padding above and below
        pad = (rows - int(round(h * (cols / w), 7))) // 2
        return pad, rows - 2 * pad, 0, cols
    pad = (cols - int(round(w * (rows / h), 7))) // 2
    return 0, rows, pad, cols - 2 * pad


@dataclass(slots=True, frozen=True)
class LlavaNextVisionConfig:
    """LLaVA-1.5's tower and projector (`clip`) and the resolutions an image may be fitted into."""

    clip: VisionConfig
    grid_pinpoints: tuple[tuple[int, int], ...]   # (height, width), multiples of the tower's image_size

    @property
    def image_token_id(self) -> int:
        return self.clip.image_token_id

    @property
    def side(self) -> int:
        """Vectors per side of one patch (the tower's patch grid)."""
        return self.clip.image_size // self.clip.patch_size

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """Patches (rows, cols) an image of `size` (height, width) is cut into."""
        ph, pw = best_resolution(size, self.grid_pinpoints)
        return ph // self.clip.image_size, pw // self.clip.image_size

    def image_tokens(self, height: int, width: int) -> int:
        """Image tokens for an image of this size: the base image's, then the unpadded grid with a newline
        ending each row (what HF's LlavaNextProcessor writes and pack_image_features returns)."""
        rows, cols = self.grid((height, width))
        _, h, _, w = unpadded((height, width), rows * self.side, cols * self.side)
        return self.side ** 2 + h * (w + 1)

    @property
    def image_seq_len(self) -> int:
        """The most image tokens one image can take (the largest grid, nothing cropped)."""
        return max(self.side ** 2 + ph // self.clip.patch_size * (pw // self.clip.patch_size + 1)
                   for ph, pw in self.grid_pinpoints)

    def build(self) -> nn.Module:
        """The encoder (its weights still to assign)."""
        return LlavaNextVision(self)

    def take_weights(self, weights: dict) -> dict:
        sd = vision_state_dict(self.clip, weights)
        for key in ("image_newline", "model.image_newline"):
            if key in weights:
                sd["image_newline"] = weights.pop(key)
        return sd

    def check_processor(self, path: str, processor) -> None:
        """The saved processor must cut the patches and count the tokens this model computes; otherwise
        refused at load, naming the field (HF's processor would write a count the model does not fill)."""
        try:
            with open(os.path.join(path, "processor_config.json")) as f:
                top = json.load(f)
        except FileNotFoundError:
            top = {}
        crop = getattr(processor, "crop_size", None) or {}
        crop = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop.height, crop.width)
        pins = getattr(processor, "image_grid_pinpoints", None)
        for field, value, want in (
                ("image_processor.crop_size", crop, (self.clip.image_size,) * 2),
                ("image_processor.image_grid_pinpoints", pins and tuple(map(tuple, pins)), self.grid_pinpoints),
                ("patch_size", top.get("patch_size"), self.clip.patch_size),
                ("vision_feature_select_strategy", top.get("vision_feature_select_strategy"), "default"),
                ("num_additional_image_tokens", top.get("num_additional_image_tokens", 0), 1)):
            if value != want:
                raise UnsupportedModelError(f"{path}: the processor's {field} {value!r} is not the model's {want!r} "
                                            f"(processor_config.json; {type(processor).__name__})")


_NEXT_INERT = ("image_grid_pinpoints", "image_seq_length", "use_image_newline_parameter")
# (image_seq_length: the base image's count, read by nothing in HF's LLaVA-NeXT; use_image_newline_parameter: in
# llava-hf's configs, HF always uses the parameter)


def llava_next_vision_config(hf: dict) -> LlavaNextVisionConfig:
    """The config of a transformers LlavaNextConfig dict (after its own defaults): LLaVA-1.5's checks,
    then what anyres needs, or a refusal naming the field."""
    clip = llava_vision_config({k: v for k, v in hf.items() if k not in _NEXT_INERT}, "llava_next")
    if not clip.drop_cls:       # (HF's pack_image_features views each patch as side x side vectors: no CLS)
        raise UnsupportedModelError(f"llava_next: vision_feature_select_strategy="
                                    f"{hf['vision_feature_select_strategy']!r} is not implemented (supported: default)")
    pins = hf["image_grid_pinpoints"]
    ok = isinstance(pins, list) and pins and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) and v > 0 and v % clip.image_size == 0
                                                             for v in p) for p in pins)
    if not ok:
        raise UnsupportedModelError(f"llava_next: image_grid_pinpoints {pins!r} is not implemented (a list of "
                                    f"[height, width], each a positive multiple of image_size {clip.image_size})")
    return LlavaNextVisionConfig(clip, tuple(tuple(p) for p in pins))


class LlavaNextVision(LlavaVision):
    """LLaVA-1.5's tower and projector on every patch, then `pack`: images -> (image_tokens, text hidden) each."""

    def __init__(self, cfg: LlavaNextVisionConfig):
        super().__init__(cfg.clip)
        self.next_cfg = cfg
        self.image_newline = nn.Parameter(torch.empty(cfg.clip.text_hidden_size))

    def forward(self, images: list[AnyresImage]) -> list[torch.Tensor]:
        vectors = super().forward(torch.cat([im.pixels for im in images]))   # every patch of every image, one batch
        out, at = [], 0
        for im in images:
            out.append(self.pack(vectors[at:at + len(im.pixels)], im.size))
            at += len(im.pixels)
        return out

    def pack(self, x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """(patches, side², d) of one image -> (image_tokens, d): the base image's vectors, then the grid's
        patches tiled into one map, cropped to the image (unpadded), a newline vector after each row."""
        cfg, s, d = self.next_cfg, self.next_cfg.side, x.shape[-1]
        rows, cols = cfg.grid(size)
        grid = x[1:].view(rows, cols, s, s, d).permute(0, 2, 1, 3, 4).reshape(rows * s, cols * s, d)
        top, h, left, w = unpadded(size, rows * s, cols * s)
        grid = grid[top:top + h, left:left + w]
        grid = torch.cat([grid, self.image_newline.expand(h, 1, d)], dim=1)            # (h, w + 1, d)
        return torch.cat([x[0], grid.reshape(-1, d)])
