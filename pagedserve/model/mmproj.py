"""llama.cpp's image encoder file (`mmproj`, GGUF architecture "clip") beside a GGUF text model, for
LLaVA-1.5: the same CLIP tower and 2-layer projector as model/vision.py, read under the names llama.cpp's
converter (convert_image_encoder_to_gguf.py) writes: `v.blk.N.attn_q`, `v.pre_ln`, `mm.0` / `mm.2`,
keys `clip.vision.*`. Its FFN tensors carry the converter's legacy names (fc1 as `ffn_down`) or the new
ones (fc1 as `ffn_up`): which is which is read from their shapes, as llama.cpp's clip.cpp does.

The file holds no saved processor: the pixels are made by HF's CLIPImageProcessor at the file's image
size, mean and std (LLaVA-1.5's: shortest edge resized, centre crop; llama.cpp itself pads to a square,
so its tokens may differ from ours and HF's). The image token is the text vocabulary's `<image>`.
A key or tensor we do not compute (another projector, LLaVA-NeXT's grid, a text tower) is refused naming it."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.model.families import UnsupportedModelError
from pagedserve.model.vision import VisionConfig

IMAGE_TOKEN = "<image>"
# clip.* keys read, or inert (llama.cpp's own bookkeeping; projection_dim: CLIP's text-matching head, unused by LLaVA)
_READS = {"clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
          "clip.vision.feed_forward_length", "clip.vision.attention.head_count", "clip.vision.block_count",
          "clip.vision.attention.layer_norm_epsilon", "clip.vision.feature_layer", "clip.vision.image_mean",
          "clip.vision.image_std", "clip.use_gelu", "clip.projector_type", "clip.has_vision_encoder",
          "clip.has_text_encoder", "clip.has_llava_projector", "clip.vision.projection_dim"}
_HELD = {"clip.has_vision_encoder": True, "clip.has_text_encoder": False, "clip.projector_type": "mlp"}


@dataclass(slots=True, frozen=True)
class MmprojVisionConfig(VisionConfig):
    """LLaVA-1.5's tower and projector as an mmproj file states them, and its pixels' mean and std."""

    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    def image_processor(self):
        """HF's CLIP image processor as LLaVA-1.5's saves it, at this file's size, mean and std."""
        from pagedserve.model.families import from_transformers
        side = {"height": self.image_size, "width": self.image_size}
        return from_transformers("CLIPImageProcessorPil")(
            size={"shortest_edge": self.image_size}, crop_size=side, image_mean=list(self.image_mean),
            image_std=list(self.image_std))

    def image_token(self, tokenizer) -> int:
        """The text vocabulary's `<image>` id (an mmproj file names no image token)."""
        tid = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if tid is None or tid == tokenizer.unk_token_id:
            raise UnsupportedModelError(f"--mmproj: the text model's vocabulary has no {IMAGE_TOKEN!r} token to stand "
                                        "for an image's positions (a LLaVA-1.5 text GGUF converted from llava-hf has one)")
        return tid


def _fields(reader) -> dict:
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("clip."):
            out[key] = f.contents()
    return out


def _config(path: str, kv: dict, text_hidden: int) -> MmprojVisionConfig:
    for key in kv:
        if key not in _READS:
            raise UnsupportedModelError(f"{path}: mmproj key {key!r} is not implemented (LLaVA-1.5's CLIP tower and "
                                        "mlp projector only)")
    for key, want in _HELD.items():
        if key in kv and kv[key] != want:
            raise UnsupportedModelError(f"{path}: mmproj {key}={kv[key]!r} is not implemented (supported: {want!r})")
    n = kv["clip.vision.block_count"]
    layers = tuple(kv.get("clip.vision.feature_layer") or (n - 1,))   # (none: llama.cpp skips the last block)
    if any(not 0 <= i <= n for i in layers):
        raise UnsupportedModelError(f"{path}: mmproj clip.vision.feature_layer {layers} is outside its {n} blocks")
    return MmprojVisionConfig(
        hidden_size=kv["clip.vision.embedding_length"], intermediate_size=kv["clip.vision.feed_forward_length"],
        num_layers=n, num_heads=kv["clip.vision.attention.head_count"], image_size=kv["clip.vision.image_size"],
        patch_size=kv["clip.vision.patch_size"], layer_norm_eps=kv["clip.vision.attention.layer_norm_epsilon"],
        act="gelu" if kv.get("clip.use_gelu") else "quick_gelu", feature_layers=layers, drop_cls=True,
        text_hidden_size=text_hidden, projector_act="gelu", image_token_id=-1,
        image_mean=tuple(kv.get("clip.vision.image_mean", MmprojVisionConfig.image_mean)),
        image_std=tuple(kv.get("clip.vision.image_std", MmprojVisionConfig.image_std)))


_NAMES = [(r"v\.class_embd", "class_embedding"), (r"v\.patch_embd\.weight", "patch_embedding.weight"),
          (r"v\.position_embd\.weight", "position_embedding"), (r"v\.pre_ln\.", "pre_layrnorm."),
          (r"v\.blk\.(\d+)\.attn_q\.", r"layers.\1.q_proj."), (r"v\.blk\.(\d+)\.attn_k\.", r"layers.\1.k_proj."),
          (r"v\.blk\.(\d+)\.attn_v\.", r"layers.\1.v_proj."), (r"v\.blk\.(\d+)\.attn_out\.", r"layers.\1.out_proj."),
          (r"v\.blk\.(\d+)\.ln1\.", r"layers.\1.layer_norm1."), (r"v\.blk\.(\d+)\.ln2\.", r"layers.\1.layer_norm2."),
          (r"v\.blk\.(\d+)\.ffn_(up|down)\.", r"layers.\1.ffn_\2.")]


def _state_dict(path: str, tensors: dict[str, torch.Tensor], cfg: MmprojVisionConfig) -> dict:
    """The file's tensors -> LlavaVision's state dict (blocks past the deepest read and the post-norm dropped)."""
    sd = {}
    for name, t in tensors.items():
        if name.startswith("v.post_ln."):
            continue
        if name.startswith("mm."):
            proj = {"mm.0.": "linear_1.", "mm.2.": "linear_2."}.get(name[:5])
            if proj is None:
                raise UnsupportedModelError(f"{path}: mmproj tensor {name!r} is not LLaVA-1.5's mlp projector")
            sd[proj + name[5:]] = t
            continue
        for pattern, repl in _NAMES:
            if re.match(pattern, name):
                key = re.sub(pattern, repl, name, count=1)
                break
        else:
            raise UnsupportedModelError(f"{path}: mmproj tensor {name!r} is not implemented")
        if key.startswith("layers.") and int(key.split(".")[1]) >= cfg.layers_run:
            continue
        sd["vision_tower." + key] = t
    for key in [k for k in sd if ".ffn_" in k and k.endswith("weight")]:
        # fc1 takes the tower's width: legacy files call it ffn_down, newer ones ffn_up (clip.cpp swaps by shape)
        fc = "fc1" if sd[key].shape[-1] == cfg.hidden_size else "fc2"
        for suffix in ("weight", "bias"):
            src = key.removesuffix("weight") + suffix
            sd[re.sub(r"ffn_(up|down)\.", f"{fc}.", src)] = sd.pop(src)
    return sd


def read_mmproj(path: str, text_hidden: int, dtype: torch.dtype) -> tuple[MmprojVisionConfig, dict]:
    """An mmproj file -> (its config, the encoder's state dict in `dtype`), or a refusal naming the key."""
    import gguf
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:      # bad magic, truncated file
        raise UnsupportedModelError(f"{path}: --mmproj is not a readable GGUF file: {e}") from e
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != "clip":
        raise UnsupportedModelError(f"{path}: --mmproj must be llama.cpp's image encoder (general.architecture "
                                    f"'clip'), got {arch and arch.contents()!r}")
    cfg = _config(path, _fields(reader), text_hidden)
    tensors = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32)).to(dtype)
    return cfg, _state_dict(path, tensors, cfg)
