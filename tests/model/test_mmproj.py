"""Images in the prompt (issue 55), llama.cpp's files: a tiny random LLaVA-1.5 written by transformers, its
language model as a GGUF text file (with its vocabulary, `<image>` in it) and its tower and projector as
an mmproj GGUF, written as llama.cpp's convert_image_encoder_to_gguf.py lays them out (`v.blk.N.*`, `mm.0`,
`mm.2`, `clip.vision.*`; the patch convolution always F16, matrices F32 or F16; legacy or new FFN names).
`LLM(TEXT.gguf, mmproj=MMPROJ.gguf)` gives HF's greedy tokens in float32 (HF's weights rounded as the file
stores them); a file we do not compute is refused naming the key."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.model.families import random_image, save_tiny_llava, write_gguf
from tests.model.helpers import assert_greedy_match
from tests.model.helpers import hf_greedy_inputs
from tests.model.helpers import assert_idle as _idle

PROMPT2 = "w5 <image> w7 <image> w9 w10"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _text_gguf(hf, tok, path) -> str:
    """The LLaVA's language model as a float32 GGUF, its vocabulary (a BPE with no merges: whole tokens) in it."""
    from transformers import LlamaForCausalLM
    lm = LlamaForCausalLM(hf.config.text_config).eval()
    sd = {k.replace("model.language_model.", "model."): v for k, v in hf.state_dict().items() if "language_model" in k}
    lm.load_state_dict(sd | {"lm_head.weight": hf.lm_head.weight}, strict=True)
    vocab = [tok.convert_ids_to_tokens(i) for i in range(len(tok))]
    header = gguf.GGUFWriter.write_header_to_file

    def with_vocab(w, *a, **kw):
        w.add_tokenizer_model("gpt2")
        w.add_token_list(vocab)
        w.add_token_types([3 if t.startswith("<") else 1 for t in vocab])
        w.add_token_scores([0.0] * len(vocab))
        w.add_token_merges([])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        return header(w, *a, **kw)
    gguf.GGUFWriter.write_header_to_file = with_vocab
    try:
        return write_gguf("llama", lm, path)
    finally:
        gguf.GGUFWriter.write_header_to_file = header


def _gguf_name(key: str, legacy: bool) -> str:
    """HF's tower / projector tensor name -> the converter's (get_tensor_name; legacy: fc1 called ffn_down)."""
    if key.startswith("model.multi_modal_projector."):
        return key.replace("model.multi_modal_projector.", "mm.").replace("linear_1", "0").replace("linear_2", "2")
    name = key.replace("model.vision_tower.", "v.").replace("encoder.layers", "blk").replace("embeddings.", "")
    name = name.replace("_proj", "").replace("self_attn.", "attn_").replace("layer_norm", "ln").replace("embedding", "embd")
    name = name.replace("mlp.fc1", "ffn_down" if legacy else "ffn_up").replace("mlp.fc2", "ffn_up" if legacy else "ffn_down")
    return name.replace("pre_layrnorm", "pre_ln").replace("post_layernorm", "post_ln")


def write_mmproj(hf, path, f16: bool, legacy: bool = True, feature_layer: bool = True, **keys) -> str:
    """HF's tower and projector as llama.cpp's converter writes an mmproj; HF's weights rounded in place as
    stored (the convolution always F16; with f16 the matrices too), so HF's reference is the file's model."""
    vc = hf.config.vision_config
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_llava_projector", True)
    w.add_file_type(int(f16))
    w.add_description("image encoder for LLaVA")
    w.add_string("clip.projector_type", keys.pop("projector_type", "mlp"))
    for key, value in (("image_size", vc.image_size), ("patch_size", vc.patch_size), ("embedding_length", vc.hidden_size),
                       ("feed_forward_length", vc.intermediate_size), ("projection_dim", vc.projection_dim),
                       ("attention.head_count", vc.num_attention_heads), ("block_count", vc.num_hidden_layers)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", vc.layer_norm_eps)
    if feature_layer:                   # (-2 of 3 blocks: hidden state 2, as the converter writes it unsigned)
        w.add_array("clip.vision.feature_layer", [vc.num_hidden_layers - 1])
    w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    w.add_bool("clip.use_gelu", vc.hidden_act == "gelu")
    for key, value in keys.items():
        w.add_array(key, value) if isinstance(value, list) else w.add_string(key, value)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if not key.startswith(("model.vision_tower.", "model.multi_modal_projector.")) or "post_layernorm" in key:
                continue
            if p.dim() == 4 or (f16 and p.dim() == 2 and key.endswith("weight")):
                p.copy_(p.half().float())
                arr = p.numpy().astype(np.float16)
            else:
                arr = p.numpy().astype(np.float32)
            w.add_tensor(_gguf_name(key, legacy), arr.squeeze())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _files(tmp_path, f16: bool, legacy: bool = True, feature_layer: bool = True, **keys):
    hf, proc = save_tiny_llava(tmp_path / "hf")
    mm = write_mmproj(hf, tmp_path / "mmproj.gguf", f16, legacy, feature_layer, **keys)
    return _text_gguf(hf, proc.tokenizer, tmp_path / "text.gguf"), mm, hf, proc


@pytest.mark.parametrize("f16,legacy,feature_layer", [(False, True, True), (True, False, False)],
                         ids=["f32-legacy-names", "f16-new-names-no-feature-layer"])
def test_mmproj_beside_a_text_gguf_equals_hf(tmp_path, f16, legacy, feature_layer):
    text, mm, hf, proc = _files(tmp_path, f16, legacy, feature_layer)
    imgs = [random_image(1), random_image(2)]
    ref, lps, ids = hf_greedy_inputs(hf, proc(text=PROMPT2, images=imgs, return_tensors="pt"), 8)
    llm = LLM(text, mmproj=mm, dtype="float32", quantization="none", num_kv_blocks=128, block_size=4)
    # (the test vocabulary's BPE has no merges, so a prompt goes in as HF's ids, one placeholder per image)
    prompt = proc.tokenizer(PROMPT2)["input_ids"]
    got = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": imgs}}, GREEDY)[0]
    assert got.prompt_token_ids == ids
    assert_greedy_match(got.outputs[0].token_ids, ref, lps)
    other = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": [random_image(9)] * 2}}, GREEDY)[0]
    assert other.outputs[0].token_ids != got.outputs[0].token_ids        # (the image matters)
    assert llm.engine.core.runner.encoder_runs == 3
    _idle(llm)


@pytest.mark.parametrize("keys,field", [
    ({"projector_type": "ldp"}, "clip.projector_type"),
    ({"clip.vision.image_grid_pinpoints": [28, 56, 56, 28]}, "clip.vision.image_grid_pinpoints"),
    ({"clip.vision.mm_patch_merge_type": "spatial_unpad"}, "clip.vision.mm_patch_merge_type")],
    ids=["projector-type", "llava-next-grid", "merge-type"])
def test_an_mmproj_we_do_not_compute_is_refused(tmp_path, keys, field):
    from pagedserve.model.loader import ModelLoadError
    text, mm, _, _ = _files(tmp_path, False, **keys)
    with pytest.raises(ModelLoadError, match=field):
        LLM(text, mmproj=mm, dtype="float32", quantization="none", num_kv_blocks=16)


def test_mmproj_beside_an_hf_folder_is_refused(tmp_path):
    from pagedserve.model.loader import ModelLoadError
    hf, _ = save_tiny_llava(tmp_path / "hf")
    mm = write_mmproj(hf, tmp_path / "mmproj.gguf", False)
    with pytest.raises(ModelLoadError, match="--mmproj"):
        LLM(str(tmp_path / "hf"), mmproj=mm, dtype="float32", num_kv_blocks=16)
