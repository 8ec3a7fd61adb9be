"""Images in the prompt (issue 55): one image + a short question, time to first token and decode
tokens/s, pagedserve next to HF transformers on the same random LLaVA-1.5-shaped model (a CLIP tower of
224-pixel images in 16-pixel patches: 196 image tokens; sizes below); then a mixed workload (half the
requests with an image, images drawn from a few, so some repeat) with the encoder and prefix caches
on, and with both off: wall time, encoder runs, prefix-cache hits.

    .venv/bin/python bench/vision.py [--requests 16] [--distinct 3] [--threads N]

float32, greedy. Prints one JSON line per measurement."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def save_model(d: str):
    from tests.model.families import tiny_tokenizer
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    tok = tiny_tokenizer(2048)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6,
                              image_size=224, patch_size=16)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      image_seq_length=196, vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    hf = LlavaForConditionalGeneration(cfg).eval()
    hf.save_pretrained(d)
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 224},
                                                             crop_size={"height": 224, "width": 224}),
                          tokenizer=tok, patch_size=16, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1)
    proc.save_pretrained(d)
    return hf, proc


def image(seed: int):
    from PIL import Image
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (240, 320, 3), dtype=np.uint8))


QUESTION = "w5 <image> w7 w8 w9 w10 w11 w12"


def one_image(hf, proc, path: str, n: int) -> None:
    from pagedserve import LLM, SamplingParams
    img = image(1)
    inp = proc(text=QUESTION, images=[img], return_tensors="pt")
    with torch.inference_mode():
        hf.generate(**inp, max_new_tokens=2, do_sample=False)                       # warm-up
        t0 = time.perf_counter()
        hf.generate(**inp, max_new_tokens=1, do_sample=False)
        hf_ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(**inp, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        hf_total = time.perf_counter() - t0
    llm = LLM(path, dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    sp = lambda k: SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)          # noqa: E731
    prompt = {"prompt": QUESTION, "multi_modal_data": {"image": img}}
    llm.generate(prompt, sp(2), use_tqdm=False)                                         # warm-up
    t0 = time.perf_counter()
    llm.generate(prompt, sp(1), use_tqdm=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = llm.generate(prompt, sp(n), use_tqdm=False)[0].outputs[0].token_ids
    total = time.perf_counter() - t0
    same = ours == out[0, inp["input_ids"].shape[1]:].tolist()
    print(json.dumps({"what": "one image + question", "prompt_tokens": inp["input_ids"].shape[1],
                      "ttft_s": round(ttft, 4), "hf_ttft_s": round(hf_ttft, 4),
                      "decode_tok_s": round((n - 1) / max(total - ttft, 1e-9), 1),
                      "hf_decode_tok_s": round((n - 1) / max(hf_total - hf_ttft, 1e-9), 1),
                      "tokens_equal_hf": same}))


def mixed(path: str, requests: int, distinct: int, caches: bool) -> None:
    from pagedserve import LLM, SamplingParams
    rng = random.Random(0)
    prompts = []
    for i in range(requests):
        if i % 2:
            prompts.append({"prompt": QUESTION, "multi_modal_data": {"image": image(rng.randrange(distinct))}})
        else:
            prompts.append({"prompt": " ".join(f"w{rng.randrange(3, 2000)}" for _ in range(48))})
    kw = {} if caches else {"enable_prefix_caching": False, "encoder_cache_tokens": 196}
    llm = LLM(path, dtype="float32", num_kv_blocks=2048, **kw)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)               # warm-up (text only)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    eng = llm.engine
    enc = eng.core.scheduler.encoder
    print(json.dumps({"what": "mixed workload", "caches": "prefix cache on, encoder cache default" if caches else "prefix cache off, encoder cache of one image", "requests": requests,
                      "image_requests": requests // 2, "distinct_images": distinct, "wall_s": round(wall, 3),
                      "encoder_runs": eng.core.runner.encoder_runs, "encoder_cache_hits": enc.hits,
                      "prefix_hit_tokens": eng.core.counters.prefix_hits}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--distinct", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        hf, proc = save_model(d)
        one_image(hf, proc, d, a.tokens)
        for caches in (True, False):
            mixed(d, a.requests, a.distinct, caches)


if __name__ == "__main__":
    main()
