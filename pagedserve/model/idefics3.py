"""Idefics3 / SmolVLM, stated as what they differ in from LLaVA-1.5 (model/vision.py): a SigLIP-style
tower with no CLS and its positions bucketed by the patch grid (NaViT's, as HF computes them), the
post-norm read, and a connector that folds each scale x scale block of patches into one vector (pixel
shuffle) before one linear map into the Llama. The processor (HF's, saved with the model) splits an
image into crops plus the global image; each crop is `image_seq_len` image tokens between the prompt's
`<fake_token_around_image>` / `<row_i_col_j>` / `<global-img>` tokens (`image_prompt`), and each crop is
one encoder input: HF encodes crops independently too, so a crop is what the encoder cache keeps.
SmolVLM is the same model under other names (model_type "smolvlm", vision "smolvlm_vision")."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.model.families import UnsupportedModelError
from pagedserve.model.vision import _ACTS, CLIPLayer, _check

MODEL_TYPES = {"idefics3": "idefics3_vision", "smolvlm": "smolvlm_vision"}   # model_type -> its tower's


@dataclass(slots=True, frozen=True)
class Idefics3VisionConfig:
    """The tower (SigLIP-style), the pixel-shuffle connector and the image token."""

    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 16
    image_size: int = 364                 # a crop's side in pixels (the processor's max_image_size)
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    act: str = "gelu_pytorch_tanh"
    scale_factor: int = 2                 # pixel shuffle: scale x scale patches -> one vector
    text_hidden_size: int = 4096
    image_token_id: int = 128257

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def image_seq_len(self) -> int:
        """Vectors (prompt tokens) per crop."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    def build(self) -> nn.Module:
        """The encoder (its weights still to assign)."""
        return Idefics3Vision(self)

    def take_weights(self, weights: dict) -> dict:
        return idefics3_state_dict(weights)


_READS = frozenset({"text_config", "vision_config", "image_token_id", "scale_factor", "tie_word_embeddings"})
_INERT = frozenset({"_pad_token_id", "vocab_size", "transformers.js_config"})
_TOWER_READS = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_channels", "image_size", "patch_size", "hidden_act", "layer_norm_eps"})
# (max_image_size, size: the processor's settings copied in, the saved processor decides and is checked at load;
# use_base_siglip, tie_word_embeddings: in SmolVLM checkpoints, read by nothing in transformers' model)
_TOWER_INERT = frozenset({"attention_dropout", "initializer_range", "max_image_size", "size", "use_base_siglip",
                          "tie_word_embeddings"})


def idefics3_vision_config(hf: dict) -> Idefics3VisionConfig:
    """The config of a transformers Idefics3Config / SmolVLMConfig dict (after its own defaults), or a
    refusal naming the field we do not compute."""
    mt = hf["model_type"]
    _check(mt, hf, _READS, _INERT)
    vc = hf["vision_config"]
    if vc.get("model_type") != MODEL_TYPES[mt]:
        raise UnsupportedModelError(f"{mt}: vision_config.model_type {vc.get('model_type')!r} is not implemented "
                                    f"(supported: {MODEL_TYPES[mt]})")
    _check(f"{mt} vision_config", vc, _TOWER_READS, _TOWER_INERT)
    if vc["hidden_act"] not in _ACTS:
        raise UnsupportedModelError(f"{mt}: vision_config.hidden_act={vc['hidden_act']!r} is not implemented "
                                    f"(supported: {', '.join(_ACTS)})")
    size, patch, scale = vc["image_size"], vc["patch_size"], hf["scale_factor"]
    for key, value in (("vision_config.image_size", size), ("vision_config.patch_size", patch),
                       ("scale_factor", scale)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UnsupportedModelError(f"{mt}: {key}={value!r} is not implemented (a positive integer)")
    if size % patch or (size // patch) % scale:
        raise UnsupportedModelError(f"{mt}: vision_config.image_size {size} is not a whole number of patch_size "
                                    f"{patch} patches divisible by scale_factor {scale}")
    return Idefics3VisionConfig(
        hidden_size=vc["hidden_size"], intermediate_size=vc["intermediate_size"], num_layers=vc["num_hidden_layers"],
        num_heads=vc["num_attention_heads"], image_size=size, patch_size=patch, num_channels=vc["num_channels"],
        layer_norm_eps=vc["layer_norm_eps"], act=vc["hidden_act"], scale_factor=scale,
        text_hidden_size=hf["text_config"]["hidden_size"], image_token_id=hf["image_token_id"])


def image_prompt(rows: int, cols: int, seq_len: int) -> str:
    """One image's text in the prompt, as HF's Idefics3Processor writes it: each crop row by row, then
    the global image (rows == cols == 0: the image was not split, the global image alone)."""
    crop = "<image>" * seq_len
    glob = f"<fake_token_around_image><global-img>{crop}<fake_token_around_image>"
    if rows == 0 and cols == 0:
        return glob
    grid = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{crop}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{glob}"


def _position_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """Each patch's position-embedding row: its fractional grid coordinate bucketed into the side x side
    table, computed as HF's Idefics3VisionEmbeddings does (same float32 steps, so the same buckets)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    coords = []
    for n in (rows, cols):
        frac = torch.arange(n, dtype=torch.float32)[None, :] * (1.0 / torch.tensor([n]))[:, None]
        coords.append(torch.bucketize(torch.clamp(frac, max=1.0 - 1e-6), boundaries, right=True)[0])
    return (coords[0][:, None] * side + coords[1][None, :]).reshape(-1)


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """(crops, n*n, d) -> (crops, n*n / s², d * s²): each s x s block of patches one vector, in HF's order."""
    b, seq, d = x.shape
    n = math.isqrt(seq)
    x = x.reshape(b, n, n // s, d * s).permute(0, 2, 1, 3).reshape(b, n // s, n // s, d * s * s)
    return x.permute(0, 2, 1, 3).reshape(b, seq // (s * s), d * s * s)


class Idefics3Vision(nn.Module):
    """Crops -> patch vectors + bucketed positions -> encoder layers (CLIP's, unchanged) -> post-norm ->
    pixel shuffle -> projection: (crops, C, H, W) -> (crops, image_seq_len, text hidden)."""

    def __init__(self, cfg: Idefics3VisionConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, h, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Parameter(torch.empty(cfg.patches_per_side ** 2, h))
        self.layers = nn.ModuleList(CLIPLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(h, cfg.layer_norm_eps)
        self.proj = nn.Linear(h * cfg.scale_factor ** 2, cfg.text_hidden_size, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.proj.weight.dtype))      # (crops, h, rows, cols)
        rows, cols = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)                                  # (crops, rows * cols, h)
        x = x + self.position_embedding[_position_ids(rows, cols, self.cfg.patches_per_side).to(x.device)]
        for layer in self.layers:
            x = layer(x)
        return self.proj(pixel_shuffle(self.post_layernorm(x), self.cfg.scale_factor))


def idefics3_state_dict(weights: dict) -> dict:
    """HF's tensors of the tower and the connector (`model.vision_model.`, `model.connector.`) ->
    Idefics3Vision's state dict; popped from `weights`."""
    sd = {}
    for key in [k for k in weights if k.startswith(("model.vision_model.", "model.connector."))]:
        name = key.removeprefix("model.vision_model.").replace("model.connector.modality_projection.", "")
        name = name.replace("embeddings.", "").replace("encoder.", "").replace("self_attn.", "").replace("mlp.", "")
        sd[name.replace("position_embedding.weight", "position_embedding")] = weights.pop(key)
    return sd
