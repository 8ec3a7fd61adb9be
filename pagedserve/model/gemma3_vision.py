"""Gemma 3's images, stated as what they differ in from LLaVA-1.5 (model/vision.py) and Idefics3
(model/idefics3.py): a SigLIP tower (no CLS, fixed positions, the post-norm read, as Idefics3's without
the bucketing) and a projector that average-pools the patch grid to `mm_tokens_per_image` vectors,
RMS-normalizes them with Gemma's (1 + w) and maps them into the language model with one matrix.

Three differences reach past the encoder:
- the prompt: HF's Gemma3Processor writes each image as `\\n\\n<start_of_image>` + image_token x
  mm_tokens_per_image + `<end_of_image>\\n\\n` where the text has `<start_of_image>` (`image_prompt`);
- the embeddings: Gemma scales its text embeddings by sqrt(hidden), and the image vectors are written
  over them after that scaling (LlamaForCausalLM.embed_input, the runner's _embeds), unscaled;
- attention: the tokens of one image see each other both ways in prefill (HF's token_type_ids block
  mask; in sliding layers still within the window behind each query). The runner gives each prefill
  query the last key it may see (AttentionMetadata.prefill_key_limits); the scheduler never ends a
  prefill chunk inside an image (EncoderCacheManager.whole), so the image's keys are all written when
  any of its queries runs. `bidirectional` on the config switches both on."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.model.families import UnsupportedModelError
from pagedserve.model.vision import _ACTS, CLIPLayer, _check


@dataclass(slots=True, frozen=True)
class Gemma3VisionConfig:
    """The SigLIP tower, the pooling projector and the image's tokens."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    image_size: int = 896
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    act: str = "gelu_pytorch_tanh"
    mm_tokens_per_image: int = 256        # the pooled grid's vectors (a square)
    text_hidden_size: int = 2560
    image_token_id: int = 262144          # the soft tokens the vectors fill
    boi_token_id: int = 255999            # <start_of_image>: the placeholder in a prompt's text
    eoi_token_id: int = 256000
    bidirectional: bool = True            # an image's tokens attend to each other both ways (prefill)

    @property
    def image_seq_len(self) -> int:
        return self.mm_tokens_per_image

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def build(self) -> nn.Module:
        return Gemma3Vision(self)

    def take_weights(self, weights: dict) -> dict:
        return gemma3_state_dict(weights)


_READS = frozenset({"text_config", "vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index",
                    "image_token_index", "image_token_id", "tie_word_embeddings"})
_INERT = frozenset({"vocab_size"})
_TOWER_READS = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_channels", "image_size", "patch_size", "hidden_act", "layer_norm_eps"})
# (vision_use_head: SigLIP's pooling head, whose output Gemma 3 never reads; its tensors are dropped)
_TOWER_INERT = frozenset({"vision_use_head", "vocab_size"})


def gemma3_vision_config(hf: dict) -> Gemma3VisionConfig:
    """The config of a transformers Gemma3Config dict (after its own defaults), or a refusal naming the
    field we do not compute."""
    _check("gemma3", hf, _READS, _INERT)
    vc = hf["vision_config"]
    if vc.get("model_type") != "siglip_vision_model":
        raise UnsupportedModelError(f"gemma3: vision_config.model_type {vc.get('model_type')!r} is not implemented "
                                    "(supported: siglip_vision_model)")
    _check("gemma3 vision_config", vc, _TOWER_READS, _TOWER_INERT)
    if vc["hidden_act"] not in _ACTS:
        raise UnsupportedModelError(f"gemma3: vision_config.hidden_act={vc['hidden_act']!r} is not implemented "
                                    f"(supported: {', '.join(_ACTS)})")
    size, patch, mm = vc["image_size"], vc["patch_size"], hf["mm_tokens_per_image"]
    side = math.isqrt(mm) if isinstance(mm, int) and mm > 0 else 0
    if size % patch or not side or side * side != mm or (size // patch) % side:
        raise UnsupportedModelError(f"gemma3: mm_tokens_per_image {mm} is not a square whose side divides the "
                                    f"{size // patch} x {size // patch} patch grid (vision_config.image_size {size}, "
                                    f"patch_size {patch}): HF's pooling would not give that many vectors")
    image_id = hf.get("image_token_index", hf.get("image_token_id"))
    if image_id >= hf["text_config"]["vocab_size"]:
        raise UnsupportedModelError(f"gemma3: image_token_index {image_id} is outside the text model's vocabulary "
                                    f"({hf['text_config']['vocab_size']})")
    return Gemma3VisionConfig(
        hidden_size=vc["hidden_size"], intermediate_size=vc["intermediate_size"], num_layers=vc["num_hidden_layers"],
        num_heads=vc["num_attention_heads"], image_size=size, patch_size=patch, num_channels=vc["num_channels"],
        layer_norm_eps=vc["layer_norm_eps"], act=vc["hidden_act"], mm_tokens_per_image=mm,
        text_hidden_size=hf["text_config"]["hidden_size"], image_token_id=image_id,
        boi_token_id=hf["boi_token_index"], eoi_token_id=hf["eoi_token_index"])


def image_prompt(boi: str, image_token: str, eoi: str, n: int) -> str:
    """One image's text in the prompt, as HF's Gemma3Processor writes it in place of `<start_of_image>`."""
    return f"\n\n{boi}{image_token * n}{eoi}\n\n"


class Gemma3Vision(nn.Module):
    """Pixels -> patch vectors + positions -> encoder layers (CLIP's, unchanged) -> post-norm -> average
    pool to the token grid -> soft-embedding RMSNorm (1 + w) -> one matrix: (images, C, H, W) ->
    (images, mm_tokens_per_image, text hidden)."""

    def __init__(self, cfg: Gemma3VisionConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, h, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Parameter(torch.empty(cfg.patches_per_side ** 2, h))
        self.layers = nn.ModuleList(CLIPLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(h, cfg.layer_norm_eps)
        self.soft_emb_norm = nn.Parameter(torch.empty(h))
        self.projection = nn.Parameter(torch.empty(h, cfg.text_hidden_size))   # (HF's layout: x @ w)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.projection.dtype)).flatten(2).transpose(1, 2)   # (images, patches, h)
        x = x + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        b, n, h = x.shape
        side, tokens = self.cfg.patches_per_side, math.isqrt(self.cfg.mm_tokens_per_image)
        grid = x.transpose(1, 2).reshape(b, h, side, side)
        x = nn.functional.avg_pool2d(grid, side // tokens).flatten(2).transpose(1, 2)      # (images, mm, h)
        xf = x.float()                       # Gemma's RMSNorm: in float32, (1 + w), back to the input's dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.layer_norm_eps)
        x = (xf * (1.0 + self.soft_emb_norm.float())).type_as(x)
        return torch.matmul(x, self.projection)


def gemma3_state_dict(weights: dict) -> dict:
    """HF's tensors of the tower and the projector (`vision_tower.vision_model.` or `vision_tower.`,
    `multi_modal_projector.`, with or without a leading `model.`) -> Gemma3Vision's state dict; popped
    from `weights`. SigLIP's pooling head (vision_use_head) is never read: dropped."""
    sd = {}
    for key in [k for k in weights if k.removeprefix("model.").startswith(("vision_tower.", "multi_modal_projector."))]:
        name = key.removeprefix("model.").removeprefix("vision_tower.").removeprefix("vision_model.")
        w = weights.pop(key)
        if name.startswith("head."):
            continue
        name = name.replace("multi_modal_projector.mm_input_projection_weight", "projection")
        name = name.replace("multi_modal_projector.mm_soft_emb_norm.weight", "soft_emb_norm")
        name = name.replace("embeddings.", "").replace("encoder.", "").replace("self_attn.", "").replace("mlp.", "")
        sd[name.replace("position_embedding.weight", "position_embedding")] = w
    return sd
