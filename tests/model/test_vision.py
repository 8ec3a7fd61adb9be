"""Images in the prompt (issue 55), LLaVA-1.5: a tiny random LlavaForConditionalGeneration written by
transformers with its processor. Greedy tokens equal HF's in float32 with one and two images, also
when chunked prefill splits an image across steps and through preemption (recompute and swap); the same image
in two requests shares its prefix-cache blocks and runs the encoder once; a different image never
shares them; the encoder budget cuts a chunk before an image; bad input is refused naming the field,
with nothing left held."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.errors import ParamError
from tests.model.families import random_image, save_tiny_llava, tiny_tokenizer
from tests.model.helpers import assert_greedy_match, save_random_llama
from tests.model.helpers import hf_greedy_inputs
from tests.model.helpers import assert_idle as _idle

PROMPT1 = "w5 <image> w7 w8 w9"
PROMPT2 = "w5 <image> w7 <image> w9 w10"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    d = tmp_path_factory.mktemp("llava")
    hf, proc = save_tiny_llava(d)
    return str(d), hf, proc


def hf_greedy(hf, proc, text: str, images, n: int = 8):
    """HF's greedy continuation (EOS ignored), its per-step logprobs, and the prompt ids its processor built."""
    return hf_greedy_inputs(hf, proc(text=text, images=images, return_tensors="pt"), n)


_REFS: dict = {}


def hf_ref(llava, text: str, seeds: tuple[int, ...], n: int = 8):
    """hf_greedy on the images of these seeds, computed once per module (HF's generate is the slow part)."""
    key = (llava[0], text, seeds, n)
    if key not in _REFS:
        _REFS[key] = hf_greedy(llava[1], llava[2], text, [random_image(s) for s in seeds], n)
    return _REFS[key]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, **({"dtype": "float32", "num_kv_blocks": 128, "block_size": 4} | kw))


@pytest.mark.parametrize("text,images", [(PROMPT1, [1]), (PROMPT2, [1, 2])], ids=["one-image", "two-images"])
def test_greedy_equals_hf(llava, text, images):
    path, hf, proc = llava
    imgs = [random_image(s) for s in images]
    ref, lps, ref_ids = hf_ref(llava, text, tuple(images))
    llm = _llm(path)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, GREEDY)[0]
    assert out.prompt_token_ids == ref_ids          # the placeholder expanded as HF's processor does
    assert_greedy_match(out.outputs[0].token_ids, ref, lps)
    # the image matters: another image gives other tokens (so this test can fail)
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": [random_image(9)] * len(imgs)}}, GREEDY)[0]
    assert other.outputs[0].token_ids != out.outputs[0].token_ids
    _idle(llm)


def test_chunked_prefill_splits_an_image_and_stays_exact(llava):
    """6-token chunks: each image's 16 tokens span three or four steps; the encoder runs once per image."""
    path, hf, proc = llava
    imgs = [random_image(1), random_image(2)]
    ref, lps, _ = hf_ref(llava, PROMPT2, (1, 2))
    llm = _llm(path, max_num_batched_tokens=6, long_prefill_token_threshold=6, enable_prefix_caching=False)
    out = llm.generate({"prompt": PROMPT2, "multi_modal_data": {"image": imgs}}, GREEDY)[0]
    assert_greedy_match(out.outputs[0].token_ids, ref, lps)
    assert llm.engine.core.runner.encoder_runs == 2
    _idle(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_stays_exact(llava, mode):
    """Three image requests (the last with n=2) in a pool too small for all: some are preempted
    (recomputed, or swapped out and back: a chunk resuming inside an image reads its encoder output again)."""
    path, hf, proc = llava
    cases = [(PROMPT1, [1]), (PROMPT2, [2, 3]), (PROMPT1, [4])]
    refs = [hf_ref(llava, t, tuple(ims), n=24) for t, ims in cases]
    llm = _llm(path, num_kv_blocks=30, preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=12,
               long_prefill_token_threshold=12)
    kv, swaps = llm.engine.core.kv, []
    swap_out = kv.swap_out
    kv.swap_out = lambda req: (swaps.append(req.request_id), swap_out(req))[1]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=n) for n in (1, 1, 2)]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": [random_image(s) for s in ims]}}
                         for t, ims in cases], params)
    assert llm.engine.core.scheduler.num_preemptions > 0 and bool(swaps) == (mode == "swap")
    for o, (ref, lps, _) in zip(outs, refs):
        for sample in o.outputs:        # (the last request's two samples: a fork carries its parent's images)
            assert_greedy_match(sample.token_ids, ref, lps)
    _idle(llm)


def test_a_fork_carries_its_images(llava):
    """n=2: the second sample is a sequence of its own; recomputed after a preemption, it reads the same
    images (and its blocks hash with them)."""
    path, *_ = llava
    llm = _llm(path)
    eng = llm.engine
    eng.add_request("r", {"prompt": PROMPT1, "multi_modal_data": {"image": [random_image(1)]}},
                    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2))
    eng.step()
    parent, child = eng.core.scheduler.requests["r"], eng.core.scheduler.requests["r#1"]
    assert child.mm_features == parent.mm_features and len(child.mm_features) == 1
    while eng.has_unfinished_requests():
        eng.step()
    _idle(llm)


def _prefill(llm: LLM, rid: str, img) -> tuple[int, ...]:
    """Add a request with `img`, run its prompt; its block table (it stays running)."""
    eng = llm.engine
    eng.add_request(rid, {"prompt": PROMPT1, "multi_modal_data": {"image": [img]}},
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng.step()
    return eng.core.kv.block_tables(rid)[0]


def test_same_image_shares_blocks_and_encoder_output(llava):
    path, *_ = llava
    llm = _llm(path)
    eng, enc = llm.engine, llm.engine.core.scheduler.encoder
    a = _prefill(llm, "a", random_image(1))
    b = _prefill(llm, "b", random_image(1))
    c = _prefill(llm, "c", random_image(2))
    # 20 prompt tokens, blocks of 4: "a"'s first 4 blocks are "b"'s (a hit stops short of the last token,
    # which is always computed: block 4 is b's own, and its first position is the image's last token)
    assert b[:4] == a[:4] and b[4] != a[4] and eng.core.scheduler.requests["b"].num_cached_tokens == 16
    # another image: the same token ids, but no block of the image is shared (block 0 holds image tokens)
    assert not set(c) & set(a) and eng.core.scheduler.requests["c"].num_cached_tokens == 0
    # "b" read the image's last token from the cache: one encoder run per distinct image
    assert (enc.misses, enc.hits, eng.core.runner.encoder_runs) == (2, 1, 2)
    while eng.has_unfinished_requests():
        eng.step()
    _idle(llm)


def test_encoder_cache_without_prefix_cache(llava):
    """No prefix cache: the second request computes every position, its image from the encoder cache."""
    path, *_ = llava
    llm = _llm(path, enable_prefix_caching=False)
    for _ in range(2):
        llm.generate({"prompt": PROMPT1, "multi_modal_data": {"image": [random_image(1)]}}, GREEDY)
    enc = llm.engine.core.scheduler.encoder
    assert (enc.misses, enc.hits, llm.engine.core.runner.encoder_runs) == (1, 1, 1)
    assert enc.size_tokens == 16
    _idle(llm)


def test_encoder_budget_cuts_before_an_image_and_the_cache_is_bounded(llava):
    """A budget of one image a step: the two-image prompt's first chunk stops before its second image,
    while a running request's decode goes on in the same steps; a cache of one image evicts (and the
    runner drops) the first once nobody reads it."""
    path, *_ = llava
    llm = _llm(path, encoder_budget_tokens=16, encoder_cache_tokens=16, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("text", {"prompt": "w5 w6 w7"}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.add_request("img", {"prompt": PROMPT2, "multi_modal_data": {"image": [random_image(1), random_image(2)]}},
                    GREEDY)
    eng.step()
    req = eng.core.scheduler.requests["img"]
    second = req.mm_features[1].offset
    assert req.num_computed_tokens == second and eng.core.scheduler.requests["text"].num_output_tokens == 2
    eng.step()
    assert req.num_computed_tokens == req.num_prompt_tokens and eng.core.scheduler.requests["text"].num_output_tokens == 3
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core.runner.encoder_runs == 2 and list(eng.core.runner.encoder_cache) == [req.mm_features[1].hash]
    _idle(llm)


def test_bad_input_is_refused_naming_the_field(llava, tmp_path):
    path, *_ = llava
    llm = _llm(path, limit_mm_per_prompt='{"image": 2}')
    eng = llm.engine
    bad = [
        ({"prompt": PROMPT1 + " <image> <image>", "multi_modal_data": {"image": [random_image(1)] * 3}},
         "multi_modal_data", "more than the 2"),
        ({"prompt": PROMPT1, "multi_modal_data": {"image": [random_image(1)] * 2}}, "multi_modal_data", "placeholder"),
        ({"prompt": "w5 w6", "multi_modal_data": {"image": random_image(1)}}, "multi_modal_data", "placeholder"),
        ({"prompt": PROMPT1, "multi_modal_data": {"image": b"not an image"}}, "multi_modal_data.image", "PIL"),
        ({"prompt": PROMPT1, "multi_modal_data": {"video": [1]}}, "multi_modal_data.video", "video inputs are not"),
        ({"prompt": PROMPT1}, "prompt", "no image"),
        ({"prompt": PROMPT1, "multi_modal_data": {"image": random_image(1, (5000, 4000))}}, "multi_modal_data.image",
         "pixels"),
    ]
    for prompt, param, words in bad:
        with pytest.raises(ParamError, match=words) as e:
            eng.add_request(None, prompt, GREEDY)
        assert e.value.param == param
    _idle(llm)
    # and the engine still serves
    assert len(llm.generate({"prompt": PROMPT1, "multi_modal_data": {"image": random_image(1)}}, GREEDY)[0]
               .outputs[0].token_ids) == 8
    # an image sent to a text-only model
    text_only = LLM(save_random_llama(tmp_path / "llama", tiny_tokenizer(256)), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ParamError, match="takes no images") as e:
        text_only.generate({"prompt": "w5 w6", "multi_modal_data": {"image": random_image(1)}}, GREEDY)
    assert e.value.param == "multi_modal_data"


def test_a_config_we_do_not_compute_is_refused(llava, tmp_path):
    import json
    import shutil
    from pagedserve.model.loader import ModelLoadError
    path, *_ = llava
    d = tmp_path / "odd"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["projector_hidden_act"] = "relu"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ModelLoadError, ValueError), match="projector_hidden_act"):
        LLM(str(d), dtype="float32", num_kv_blocks=16)


def test_chat_with_image_parts_offline(llava):
    """LLM.chat takes image_url parts as the server does: the template over the placeholder, HF's tokens."""
    import base64
    import io
    path, hf, proc = llava
    buf = io.BytesIO()
    random_image(1).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = _llm(path)
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w6 w7"},
                                                 {"type": "image_url", "image_url": {"url": url}}]}], GREEDY)[0]
    ref, lps, ids = hf_greedy(hf, proc, "w3 <image>\nw6 w7 w4 w5", [random_image(1)])
    assert out.prompt_token_ids == ids
    assert_greedy_match(out.outputs[0].token_ids, ref, lps)
    with pytest.raises(ParamError) as e:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}]}])
    assert e.value.param == "messages[0].content[0].image_url.url"
    with pytest.raises(ParamError) as e:       # beam search would lose the images: refused
        llm.beam_search([{"prompt": PROMPT1, "multi_modal_data": {"image": random_image(1)}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    assert e.value.param == "multi_modal_data"
    _idle(llm)


def test_the_hub_checkpoint_layout_loads_the_same(llava, tmp_path):
    """llava-hf's LLaVA-1.5 folders: `vision_tower.vision_model.` names, a position_ids buffer, a
    vocab_size in vision_config. The same weights so named give the same tokens."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    path, *_ = llava
    d = tmp_path / "hub-layout"
    shutil.copytree(path, d)
    sd = load_file(str(d / "model.safetensors"))
    sd = {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in sd.items()}
    sd["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(17)[None]
    save_file(sd, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["vision_config"]["vocab_size"] = 32000
    (d / "config.json").write_text(json.dumps(cfg))
    prompt = {"prompt": PROMPT1, "multi_modal_data": {"image": random_image(1)}}
    want = _llm(path).generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert _llm(str(d)).generate(prompt, GREEDY)[0].outputs[0].token_ids == want


def test_engine_process_keeps_a_vision_models_core_in_process(llava):
    """serve runs its core in a process of its own by default; a vision-language model's images do not cross
    the core's protocol, so its core stays in process (engine/core_spawn.py), with the same tokens as HF."""
    from pagedserve.config import EngineArgs
    from pagedserve.engine.core_client import InProcClient
    from pagedserve.engine.core_spawn import images_stay_in_process
    assert images_stay_in_process(EngineArgs(model=llava[0]))
    llm = _llm(llava[0], engine_process=True)
    assert isinstance(llm.engine.client, InProcClient)
    ref, lps, _ = hf_ref(llava, PROMPT1, (1,))
    out = llm.generate({"prompt": PROMPT1, "multi_modal_data": {"image": [random_image(1)]}}, GREEDY)[0]
    assert_greedy_match(out.outputs[0].token_ids, ref, lps)
