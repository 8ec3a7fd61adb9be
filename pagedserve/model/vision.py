"""Images in the prompt, the model side: LLaVA-1.5's CLIP vision tower and its projector, stated as
what they add to the Llama we already run. An image becomes `image_seq_len` vectors of the language
model's width; the runner writes them over the embeddings of the prompt's image-token positions
(HF's masked_scatter), and the language model runs unchanged from there.

The config is walked field by field as families.py walks a text config: a field we do not compute is
refused at load, naming it. The image's pixels come from the processor saved with the model (HF's own
CLIPImageProcessor), so what the tower sees is what HF's LlavaProcessor feeds it."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.model.families import INERT, UnsupportedModelError


@dataclass(slots=True, frozen=True)
class VisionConfig:
    """A CLIP vision tower and the 2-layer projector into the language model (LLaVA-1.5)."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    image_size: int = 336
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    act: str = "quick_gelu"               # the tower's MLP activation
    feature_layers: tuple[int, ...] = (-2,)  # hidden states read (index into [embeddings, layer 1, ...]), concatenated
    drop_cls: bool = True                 # vision_feature_select_strategy "default": the CLS position dropped
    text_hidden_size: int = 4096          # the projector's output width
    projector_act: str = "gelu"
    projector_bias: bool = True
    image_token_id: int = 32000

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_seq_len(self) -> int:
        """Vectors (prompt tokens) per image."""
        return self.num_patches + (0 if self.drop_cls else 1)

    @property
    def layers_run(self) -> int:
        """Tower layers computed: none past the deepest hidden state read."""
        return max(i if i >= 0 else self.num_layers + 1 + i for i in self.feature_layers)

    def build(self) -> nn.Module:
        """The encoder (its weights still to assign)."""
        return LlavaVision(self)

    def take_weights(self, weights: dict) -> dict:
        return vision_state_dict(self, weights)


_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# the top-level LLaVA fields and the vision tower's: read, inert, or held at the values we compute
_LLAVA_READS = frozenset({"text_config", "vision_config", "image_token_index", "image_token_id", "image_seq_length",
                          "vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act",
                          "multimodal_projector_bias", "tie_word_embeddings"})
_LLAVA_INERT = frozenset({"ignore_index", "pad_token_id", "vocab_size"})
_CLIP_READS = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                         "patch_size", "num_channels", "layer_norm_eps", "hidden_act"})
# (vocab_size: llava-hf's LLaVA-1.5 configs carry one in vision_config; a vision tower has no vocabulary)
_CLIP_INERT = frozenset({"projection_dim", "initializer_factor", "dropout", "attention_dropout", "vocab_size"})


def _check(where: str, d: dict, reads: frozenset, inert: frozenset) -> None:
    for key in d:
        if key not in INERT and key not in reads and key not in inert:
            raise UnsupportedModelError(f"{where}: config field {key!r} changes the model in a way this engine does "
                                        "not implement; refusing to load it")


def llava_vision_config(hf: dict, where: str = "llava") -> VisionConfig:
    """The VisionConfig of a transformers LlavaConfig dict (after its own defaults), or a refusal naming
    the field we do not compute (`where`: the model_type the message names)."""
    _check(where, hf, _LLAVA_READS, _LLAVA_INERT)
    vc = hf["vision_config"]
    if vc.get("model_type") != "clip_vision_model":
        raise UnsupportedModelError(f"{where}: vision_config.model_type {vc.get('model_type')!r} is not implemented "
                                    "(supported: clip_vision_model)")
    _check(f"{where} vision_config", vc, _CLIP_READS, _CLIP_INERT)
    for key, value, ok in (("vision_config.hidden_act", vc["hidden_act"], _ACTS),
                           ("projector_hidden_act", hf["projector_hidden_act"], _ACTS),
                           ("vision_feature_select_strategy", hf["vision_feature_select_strategy"], ("default", "full"))):
        if value not in ok:
            raise UnsupportedModelError(f"{where}: {key}={value!r} is not implemented (supported: {', '.join(ok)})")
    layers = hf["vision_feature_layer"]
    layers = tuple(layers) if isinstance(layers, (list, tuple)) else (layers,)
    n = vc["num_hidden_layers"]
    if any(not -(n + 1) <= i <= n for i in layers):
        raise UnsupportedModelError(f"{where}: vision_feature_layer {layers} is outside the tower's {n} layers")
    cfg = VisionConfig(
        hidden_size=vc["hidden_size"], intermediate_size=vc["intermediate_size"], num_layers=n,
        num_heads=vc["num_attention_heads"], image_size=vc["image_size"], patch_size=vc["patch_size"],
        num_channels=vc["num_channels"], layer_norm_eps=vc["layer_norm_eps"], act=vc["hidden_act"],
        feature_layers=layers, drop_cls=hf["vision_feature_select_strategy"] == "default",
        text_hidden_size=hf["text_config"]["hidden_size"], projector_act=hf["projector_hidden_act"],
        projector_bias=bool(hf.get("multimodal_projector_bias", True)),
        image_token_id=hf.get("image_token_id", hf.get("image_token_index")))
    seq = hf.get("image_seq_length")
    if seq is not None and seq != cfg.image_seq_len:
        raise UnsupportedModelError(f"{where}: image_seq_length {seq} differs from the tower's {cfg.image_seq_len} "
                                    "vectors per image")
    return cfg


class CLIPLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h = cfg.hidden_size
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(h, cfg.layer_norm_eps), nn.LayerNorm(h, cfg.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, cfg.intermediate_size), nn.Linear(cfg.intermediate_size, h)
        self.heads, self.act = cfg.num_heads, _ACTS[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:        # (images, T, h)
        B, T, h = x.shape
        y = self.layer_norm1(x)
        q, k, v = (p(y).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v)               # every patch sees every patch (no mask)
        x = x + self.out_proj(a.transpose(1, 2).reshape(B, T, h))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """Patches -> CLS + patch vectors -> pre-norm -> encoder layers; returns the hidden states the
    config reads (the post-norm is never read by LLaVA, so it is not kept)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(h))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, h, cfg.patch_size, cfg.patch_size, bias=False)
        self.position_embedding = nn.Parameter(torch.empty(cfg.num_patches + 1, h))
        self.pre_layrnorm = nn.LayerNorm(h, cfg.layer_norm_eps)   # (HF's spelling)
        self.layers = nn.ModuleList(CLIPLayer(cfg) for _ in range(cfg.layers_run))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:   # (images, C, H, W) -> (images, T, h * len(layers))
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)          # (images, patches, h)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = self.pre_layrnorm(torch.cat([cls, x], dim=1) + self.position_embedding)
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1]))
        n = self.cfg.num_layers + 1
        return torch.cat([states[i % n] for i in self.cfg.feature_layers], dim=-1)


class LlavaVision(nn.Module):
    """The tower and the projector: pixels -> (images, image_seq_len, text hidden)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = CLIPVisionTower(cfg)
        width = cfg.hidden_size * len(cfg.feature_layers)
        self.linear_1 = nn.Linear(width, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.vision_tower(pixels.to(self.linear_1.weight.dtype))
        if self.cfg.drop_cls:
            x = x[:, 1:]
        return self.linear_2(_ACTS[self.cfg.projector_act](self.linear_1(x)))


def vision_state_dict(cfg: VisionConfig, weights: dict) -> dict:
    """HF's tensors of the tower and the projector (either checkpoint layout: `vision_tower.vision_model.`
    or `vision_tower.`, with or without a leading `model.`) -> LlavaVision's state dict; popped from
    `weights`. Tower layers past the deepest one read are dropped with the post-norm (never computed)."""
    sd = {}
    for key in [k for k in weights if k.removeprefix("model.").startswith(("vision_tower.", "multi_modal_projector."))]:
        name = key.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
        name = name.replace("multi_modal_projector.", "").replace(".embeddings.", ".").replace(".encoder.", ".")
        name = name.replace("position_embedding.weight", "position_embedding").replace("self_attn.", "")
        name = name.replace("mlp.", "")
        w = weights.pop(key)
        if name.startswith("vision_tower.post_layernorm.") or name.endswith("position_ids"):   # (never read; a buffer)
            continue
        if name.startswith("vision_tower.layers.") and int(name.split(".")[2]) >= cfg.layers_run:
            continue
        sd[name] = w
    return sd


def image_hash(image) -> str:
    """An image's content key (encoder cache, prefix cache): its mode, size and pixels."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()
