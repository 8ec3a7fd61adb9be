"""Tiny random-weight models of each family, written by transformers itself (its own config and
model classes, save_pretrained), for the reference tests against HF on the same weights."""
from __future__ import annotations

import math

import numpy as np
import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
WINDOW = 24      # shorter than the test prompts, so sliding layers really slide


def _sharpen(hf, sharpen: float) -> None:
    """Sharper than the default init: greedy is meaningful and images change it."""
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if p.dim() >= 2:
                p.mul_(sharpen)
            elif "norm" in n and n.endswith("weight"):
                p.normal_(1.0, 0.2)


def family_specs() -> dict[str, tuple[str, str, dict]]:
    """family -> (config class, model class, fields over SMALL): each family's differences switched on."""
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, tie_word_embeddings=False)),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                          max_window_layers=1)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, use_sliding_window=True,
                                                          sliding_window=WINDOW, max_window_layers=1)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                             attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
        "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
        "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=12.0, logits_scaling=4.0,
                                                                residual_multiplier=0.5, attention_multiplier=0.1,
                                                                tie_word_embeddings=True)),
        "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0], pad_token_id=0)),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
            pad_token_id=0, eos_token_id=1, bos_token_id=1, original_max_position_embeddings=256,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 2, 4, 8, 16, 32]})),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                sliding_window=WINDOW)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16, norm_topk_prob=True,
            mlp_only_layers=[1])),
    }


def tiny_tokenizer(vocab_size: int = 512):
    """A word-level tokenizer of `vocab_size` ids ("w3", "w4", ...), made by tokenizers itself: for tests
    that need a model folder and nothing of the bundled GGUF (bench/gpu_check.py runs them on a GPU
    machine that has no copy of it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")          # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_family(name: str, d, vocab_size: int, tokenizer=None, sharpen: float = 3.0, **fields):
    """Save a seeded random `name` model in folder d (and the tokenizer, when given); returns the HF
    model. `fields` replace the family's test fields."""
    import transformers
    cfg_cls, model_cls, extra = family_specs()[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**(SMALL | {"vocab_size": vocab_size} | (fields or extra)))
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():     # a sharper distribution than the default init, so greedy is meaningful
        for n, p in hf.named_parameters():
            if p.dim() >= 2:
                p.mul_(sharpen)
            elif "norm" in n:
                p.normal_(0.0 if "gemma" in name else 1.0, 0.2)   # non-trivial norms (Gemma's are 1 + w)
            else:
                p.normal_(0, 0.5)                                  # biases
    hf.save_pretrained(d, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)
    return hf


def write_gguf(name: str, hf, path, qtype: str | None = None) -> str:
    """The HF model as a float32 GGUF file, as llama.cpp's converter lays it out: tensor names from
    the gguf package's own HF -> GGUF name map, the family's metadata keys, and for Gemma the
    converter's +1 on every norm weight (llama.cpp runs a plain RMSNorm); Gemma 2's soft-caps; Granite's
    multipliers as llama.cpp's *_scale keys and its q/k rows permuted, as LlamaModel.permute does.
    qtype (e.g. "Q8_0"): the 2-D projection matrices stored in that format (gguf's own quantizer)."""
    import gguf
    arch = {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
            "granite": gguf.MODEL_ARCH.GRANITE, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
            "smollm3": gguf.MODEL_ARCH.SMOLLM3, "phi3": gguf.MODEL_ARCH.PHI3, "mixtral": gguf.MODEL_ARCH.LLAMA,
            "llama": gguf.MODEL_ARCH.LLAMA}[name]
    c = hf.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    gemma = name.startswith("gemma")
    if gemma:
        w.add_sliding_window(c.sliding_window)
    if name == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if name == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
        w.add_attention_scale(c.attention_multiplier)
    if name in ("qwen3_moe", "mixtral"):
        w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if name == "qwen3_moe":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if name == "phi3":             # as llama.cpp's Phi3MiniModel: partial RoPE, longrope's factors as tensors
        rp, orig = c.rope_parameters, c.rope_parameters["original_max_position_embeddings"]
        scale = c.max_position_embeddings / orig
        w.add_rope_dimension_count(int(head_dim * rp["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    sd = hf.state_dict()
    for key in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:    # (E, 2I, H): gate rows, then up
        gate, up = sd.pop(key).chunk(2, dim=1)
        layer = key.split(".")[2]
        w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate.float().contiguous().numpy())
        w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up.float().contiguous().numpy())
        w.add_tensor(f"blk.{layer}.ffn_down_exps.weight",
                     sd.pop(key.replace("gate_up_proj", "down_proj")).float().contiguous().numpy())
    for key, t in sd.items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if gemma and key.endswith("norm.weight"):
            t = t + 1.0
        if name in ("granite", "smollm3", "mixtral", "llama") and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in key else c.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        gname, arr = names.get_name(key, try_suffixes=(".weight", ".bias")), t.numpy()
        if qtype and arr.ndim == 2 and "proj" in key:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(arr, q), raw_dtype=q)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


IMAGE_SIZE, PATCH = 28, 7          # a tiny CLIP tower: 16 patches, so 16 image tokens per image
CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                 "{% if add_generation_prompt %}w5{% endif %}")


def save_tiny_llava(d, sharpen: float = 3.0):
    """A seeded random LLaVA-1.5 (transformers' LlavaForConditionalGeneration: CLIP tower, feature layer
    -2, CLS dropped, 2-layer GELU projector, Llama) with its LlavaProcessor (CLIPImageProcessor and the
    word-level tokenizer plus "<image>", a chat template) saved beside it in d. Returns (model, processor)."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    tok = tiny_tokenizer(256)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                      image_seq_length=(IMAGE_SIZE // PATCH) ** 2, vision_feature_layer=-2,
                      vision_feature_select_strategy="default")
    torch.manual_seed(0)
    hf = LlavaForConditionalGeneration(cfg).eval()
    _sharpen(hf, sharpen)
    hf.save_pretrained(d)
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                             crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
                          tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1)
    proc.save_pretrained(d)
    return hf, proc


NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]   # (height, width): 1x2 .. 3x1 patches of 28 px


def save_tiny_llava_next(d, sharpen: float = 3.0, **fields):
    """A seeded random LLaVA-NeXT (transformers' LlavaNextForConditionalGeneration: LLaVA-1.5's tiny tower and
    projector, anyres over NEXT_PINPOINTS, image_newline) with its LlavaNextProcessor (the PIL image processor:
    no torchvision) saved beside it in d; `fields` override the model's config. Returns (model, processor)."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessorPil, LlavaNextProcessor)
    tok = tiny_tokenizer(256)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    image_id = tok.convert_tokens_to_ids("<image>")
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                          image_seq_length=(IMAGE_SIZE // PATCH) ** 2, image_grid_pinpoints=NEXT_PINPOINTS,
                          **({"vision_feature_layer": -2, "vision_feature_select_strategy": "default"} | fields))
    torch.manual_seed(0)
    hf = LlavaNextForConditionalGeneration(cfg).eval()
    _sharpen(hf, sharpen)
    with torch.no_grad():      # (as large as a patch vector, so a misplaced newline changes the tokens)
        hf.model.image_newline.normal_(0.0, 1.0)
    hf.save_pretrained(d)
    size = {"shortest_edge": IMAGE_SIZE}
    images = LlavaNextImageProcessorPil(size=size, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                        image_grid_pinpoints=NEXT_PINPOINTS)
    proc = LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH,
                              vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                              num_additional_image_tokens=1)
    proc.save_pretrained(d)
    return hf, proc


def random_image(seed: int, size: tuple[int, int] = (40, 50)):
    """A seeded random RGB PIL image (width, height)."""
    import numpy as np
    from PIL import Image
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8))


IDEFICS3_IMAGE, IDEFICS3_PATCH = 32, 4     # a tiny SigLIP-style tower: 8x8 patches, pixel shuffle 2 -> 16 tokens a crop
IDEFICS3_ROW_COL = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]


def save_tiny_idefics3(d, model_type: str = "idefics3", sharpen: float = 4.0, split: bool = True):
    """A seeded random Idefics3 (or SmolVLM: the same model under its own names) written by transformers
    with its processor: an image is resized to 64 px on its longest edge, split into 32 px crops plus the
    global image (split=False: the global image alone), 16 image tokens a crop. The tokenizer keeps "\\n"
    as a token, as real ones do (the processor writes newlines between crop rows). SmolVLM's own processor
    needs torchvision for its video part, so Idefics3's (the same image prompt) is saved with it.
    Returns (model, processor)."""
    import transformers
    from tokenizers import AddedToken
    from transformers import Idefics3ImageProcessor, Idefics3Processor, LlamaConfig
    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[model_type]
    tok = tiny_tokenizer(256)
    tok.add_tokens([AddedToken("\n", normalized=False)])
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>",
                                                          "<end_of_utterance>", *IDEFICS3_ROW_COL]})
    tok.chat_template = CHAT_TEMPLATE
    vision = getattr(transformers, f"{prefix}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IDEFICS3_IMAGE,
        patch_size=IDEFICS3_PATCH)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    cfg = getattr(transformers, f"{prefix}Config")(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                                   scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    hf = getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).eval()
    _sharpen(hf, sharpen)
    hf.save_pretrained(d)
    image_proc = Idefics3ImageProcessor(size={"longest_edge": 2 * IDEFICS3_IMAGE}, do_image_splitting=split,
                                        max_image_size={"longest_edge": IDEFICS3_IMAGE})
    proc = Idefics3Processor(image_processor=image_proc, tokenizer=tok,
                             image_seq_len=(IDEFICS3_IMAGE // IDEFICS3_PATCH) ** 2 // 4)
    proc.save_pretrained(d)
    return hf, proc


GEMMA3_IMAGE, GEMMA3_PATCH = 32, 4      # a tiny SigLIP tower: 8x8 patches, pooled 2x2 -> 16 tokens an image


def save_tiny_gemma3(d, sharpen: float = 4.0):
    """A seeded random Gemma 3 (transformers' Gemma3ForConditionalGeneration: SigLIP tower, pooling
    projector, a Gemma 3 text model with sliding layers shorter than the prompts) written by transformers
    with its Gemma3Processor: the word-level tokenizer plus "\\n", "\\n\\n" (the processor writes them
    around an image) and the image tags under the names the processor reads (boi_token, ...), and the
    PIL image processor (the fast one needs torchvision). Returns (model, processor)."""
    import transformers
    from tokenizers import AddedToken
    base = tiny_tokenizer(256)
    base.add_tokens([AddedToken("\n", normalized=False), AddedToken("\n\n", normalized=False)])
    base.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]})
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    tok.chat_template = CHAT_TEMPLATE
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=GEMMA3_IMAGE, patch_size=GEMMA3_PATCH, vision_use_head=False)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=512)
    cfg = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=16,
                                    boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                                    image_token_index=tok.image_token_id)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():    # (HF initializes the projection to zeros: every image would be the same)
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    _sharpen(hf, sharpen)
    hf.save_pretrained(d)
    proc = transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil(
        size={"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE}), tokenizer=tok, image_seq_length=16)
    proc.save_pretrained(d)
    return hf, proc


QWEN_VL_PATCH = 4      # a tiny Qwen2.5-VL tower: 4 px patches, 2x2 merged: an image token per 8x8 px
QWEN_VL_WINDOW = 16    # window_size (px): 2x2 merged tokens a window, so a test image has several, some partial


def save_tiny_qwen2_5_vl(d, sharpen: float = 3.0):
    """A seeded random Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration: the windowed ViT with
    2D rotary, full attention in block 1 of 3, the 2x2 patch merger; a Qwen2 text model with M-RoPE,
    mrope_section [2, 3, 3]) written by transformers with its image processor (the PIL one; min_pixels low enough
    that small test images keep their size) and the word-level tokenizer plus Qwen's vision tokens. (HF's
    Qwen2_5_VLProcessor wants its video processor, which needs torchvision: `qwen_vl_inputs` writes what it
    would.) Returns (model, image processor, tokenizer)."""
    import transformers
    tok = tiny_tokenizer(256)
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]})
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=QWEN_VL_PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=QWEN_VL_WINDOW, out_hidden_size=64,
                  fullatt_block_indexes=[1])
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=ids("<|image_pad|>"),
                                        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                                        vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    _sharpen(hf, sharpen)
    hf.save_pretrained(d)
    images = transformers.Qwen2VLImageProcessorPil(patch_size=QWEN_VL_PATCH, merge_size=2, temporal_patch_size=2,
                                                   min_pixels=64, max_pixels=64 * 64)
    images.save_pretrained(d)
    tok.save_pretrained(d)
    return hf, images, tok


def qwen_vl_inputs(images_proc, tok, text: str, images: list) -> dict:
    """What HF's Qwen2_5_VLProcessor gives for `text` and `images` (its replace_image_token): each
    <|image_pad|> written out grid_t * grid_h * grid_w / merge² times, the ids, pixel_values, image_grid_thw
    and mm_token_type_ids (1 at image tokens: HF's get_rope_index reads them)."""
    out = dict(images_proc(images=images, return_tensors="pt")) if images else {}
    parts = text.split("<|image_pad|>")
    assert len(parts) == len(images) + 1, "one <|image_pad|> per image"
    merge = images_proc.merge_size ** 2
    counts = [int(g.prod()) // merge for g in out["image_grid_thw"]] if images else []
    text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
    ids = tok(text, return_tensors="pt")["input_ids"]
    out.update(input_ids=ids, attention_mask=torch.ones_like(ids),
               mm_token_type_ids=(ids == tok.convert_tokens_to_ids("<|image_pad|>")).int())
    return out
