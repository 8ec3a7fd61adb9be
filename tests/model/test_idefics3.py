"""Images in the prompt (issue 55), Idefics3 / SmolVLM: a tiny random Idefics3ForConditionalGeneration (and
SmolVLMForConditionalGeneration) written by transformers with its processor, which splits an image into
crops plus the global image. Greedy tokens equal HF's in float32 with one and two images (split, and not
split), also when chunked prefill splits crops across steps and through preemption; the prompt's ids are
HF's processor's; the same image in two requests shares its prefix-cache blocks and runs the encoder once
per crop; a config or processor we do not compute is refused naming the field."""
from __future__ import annotations


import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ParamError
from tests.model.families import random_image, save_tiny_idefics3
from tests.model.helpers import assert_idle as _idle
from tests.model.helpers import edited_copy as _edited
from tests.model.helpers import hf_greedy_inputs

PROMPT1 = "w5 <image> w7 w8 w9"
PROMPT2 = "w5 <image> w7 <image> w9 w10"
SIZES = {1: (40, 50), 2: (80, 40), 3: (50, 50), 4: (64, 30), 9: (40, 50)}   # 2x2 crops, 1x2, 2x2, 1x2, 2x2
CROPS = {(40, 50): 5, (80, 40): 3, (50, 50): 5, (64, 30): 3}                 # crops + the global image
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def image(seed: int):
    return random_image(seed, SIZES[seed])


_MODELS: dict = {}


def tiny(tmp_path_factory, model_type: str = "idefics3", split: bool = True):
    """(folder, HF model, processor), written once per module and kind."""
    key = (model_type, split)
    if key not in _MODELS:
        d = tmp_path_factory.mktemp(f"{model_type}-{'split' if split else 'whole'}")
        _MODELS[key] = (str(d), *save_tiny_idefics3(d, model_type, split=split))
    return _MODELS[key]


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return tiny(tmp_path_factory)


_REFS: dict = {}


def hf_ref(model, text: str, seeds: tuple[int, ...], n: int = 8):
    """HF's greedy continuation (EOS ignored), its per-step logprobs and the prompt ids its processor
    built, computed once per module."""
    key = (model[0], text, seeds, n)
    if key not in _REFS:
        _, hf, proc = model
        inp = proc(text=text, images=[image(s) for s in seeds], return_tensors="pt")
        _REFS[key] = hf_greedy_inputs(hf, inp, n)
    return _REFS[key]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, **({"dtype": "float32", "num_kv_blocks": 160, "block_size": 4} | kw))


def _greedy_match(ours, ref_and_lps) -> None:
    from tests.model.helpers import assert_greedy_match
    ref, lps, _ = ref_and_lps
    assert_greedy_match(ours, ref, lps)


@pytest.mark.parametrize("model_type,split,text,seeds", [
    ("idefics3", True, PROMPT1, (1,)), ("idefics3", True, PROMPT2, (1, 2)), ("smolvlm", True, PROMPT2, (1, 2)),
    ("idefics3", False, PROMPT2, (1, 2))], ids=["one-image", "two-images", "smolvlm-two-images", "not-split"])
def test_greedy_equals_hf(tmp_path_factory, model_type, split, text, seeds):
    model = tiny(tmp_path_factory, model_type, split)
    ref = hf_ref(model, text, seeds)
    llm = _llm(model[0])
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [image(s) for s in seeds]}}, GREEDY)[0]
    assert out.prompt_token_ids == ref[2]          # the placeholders expanded as HF's processor writes them
    _greedy_match(out.outputs[0].token_ids, ref)
    crops = sum(CROPS[SIZES[s]] for s in seeds) if split else len(seeds)
    assert llm.engine.core.runner.encoder_runs == crops
    # the image matters: another image of the same shape gives other tokens (so this test can fail)
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": [random_image(7, SIZES[s]) for s in seeds]}},
                         GREEDY)[0]
    assert other.prompt_token_ids == out.prompt_token_ids and other.outputs[0].token_ids != out.outputs[0].token_ids
    _idle(llm)


def test_a_prompt_expanded_by_hf_is_taken_as_it_is(idefics3):
    """Ids HF's processor built (every crop's tokens written out) with their images: the same prompt and
    tokens; a prompt whose expansion does not match its images is refused naming the field."""
    ref = hf_ref(idefics3, PROMPT2, (1, 2))
    llm = _llm(idefics3[0])
    imgs = [image(1), image(2)]
    out = llm.generate({"prompt_token_ids": ref[2], "multi_modal_data": {"image": imgs}}, GREEDY)[0]
    assert out.prompt_token_ids == ref[2]
    _greedy_match(out.outputs[0].token_ids, ref)
    with pytest.raises(ParamError, match="placeholder") as e:         # the images in the other order: 1x2 then 2x2
        llm.generate({"prompt_token_ids": ref[2], "multi_modal_data": {"image": imgs[::-1]}}, GREEDY)
    assert e.value.param == "multi_modal_data"
    _idle(llm)


def test_chunked_prefill_splits_crops_and_stays_exact(idefics3):
    """6-token chunks: each crop's 16 tokens span three or four steps; the encoder runs once per crop."""
    ref = hf_ref(idefics3, PROMPT2, (1, 2))
    llm = _llm(idefics3[0], max_num_batched_tokens=6, long_prefill_token_threshold=6, enable_prefix_caching=False)
    out = llm.generate({"prompt": PROMPT2, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)[0]
    _greedy_match(out.outputs[0].token_ids, ref)
    assert llm.engine.core.runner.encoder_runs == 8
    _idle(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_stays_exact(idefics3, mode):
    """Three image requests (the last with n=2) in a pool too small for all: some are preempted
    (recomputed, or swapped out and back: a chunk resuming inside a crop reads its encoder output again)."""
    cases = [(PROMPT1, (1,)), (PROMPT2, (2, 3)), (PROMPT1, (4,))]
    refs = [hf_ref(idefics3, t, seeds, n=24) for t, seeds in cases]
    llm = _llm(idefics3[0], num_kv_blocks=72, preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=24,
               long_prefill_token_threshold=24)
    kv, swaps = llm.engine.core.kv, []
    swap_out = kv.swap_out
    kv.swap_out = lambda req: (swaps.append(req.request_id), swap_out(req))[1]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=n) for n in (1, 1, 2)]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": [image(s) for s in seeds]}}
                         for t, seeds in cases], params)
    assert llm.engine.core.scheduler.num_preemptions > 0 and bool(swaps) == (mode == "swap")
    for o, ref in zip(outs, refs):
        assert o.prompt_token_ids == ref[2]
        for sample in o.outputs:
            _greedy_match(sample.token_ids, ref)
    _idle(llm)


def _prefill(llm: LLM, rid: str, img) -> tuple[int, ...]:
    """Add a request with `img` ending its prompt, run the prompt; its block table (it stays running)."""
    eng = llm.engine
    eng.add_request(rid, {"prompt": "w5 <image>", "multi_modal_data": {"image": [img]}},
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    eng.step()
    return eng.core.kv.block_tables(rid)[0]


def test_same_image_shares_blocks_and_encoder_output(idefics3):
    llm = _llm(idefics3[0], max_num_batched_tokens=256)
    eng, enc = llm.engine, llm.engine.core.scheduler.encoder
    a = _prefill(llm, "a", image(1))
    b = _prefill(llm, "b", image(1))
    c = _prefill(llm, "c", image(9))            # another image of the same shape: the same token ids
    req = eng.core.scheduler.requests["b"]
    # 95 prompt tokens (w5, 4 crops and the global image, 16 tokens each, and their tags), blocks of 4: a hit
    # stops short of the last token, so "b" computes positions 92..94: the global image's last two tokens and
    # the closing tag; its first 23 blocks are "a"'s
    assert req.num_prompt_tokens == 95 and req.mm_features[-1].offset == 78
    assert b[:23] == a[:23] and b[23] != a[23] and req.num_cached_tokens == 92
    # another image: no block is shared (block 0 already holds the first crop's first image token)
    assert not set(c) & set(a) and eng.core.scheduler.requests["c"].num_cached_tokens == 0
    # "b" read the global image from the encoder cache: one encoder run per distinct crop
    assert (enc.misses, enc.hits, eng.core.runner.encoder_runs) == (10, 1, 10)
    while eng.has_unfinished_requests():
        eng.step()
    _idle(llm)


def test_encoder_cache_without_prefix_cache(idefics3):
    """No prefix cache: the second request computes every position, its crops from the encoder cache."""
    llm = _llm(idefics3[0], enable_prefix_caching=False)
    for _ in range(2):
        llm.generate({"prompt": PROMPT1, "multi_modal_data": {"image": [image(1)]}}, GREEDY)
    enc = llm.engine.core.scheduler.encoder
    assert (enc.misses, enc.hits, llm.engine.core.runner.encoder_runs) == (5, 5, 5)
    assert enc.size_tokens == 80
    _idle(llm)


def test_encoder_budget_cuts_before_a_crop(idefics3):
    """A budget of one crop a step: the image request's first chunk stops before its second crop, while a
    running request's decode goes on in the same steps."""
    llm = _llm(idefics3[0], encoder_budget_tokens=16, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("text", {"prompt": "w5 w6 w7"}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.add_request("img", {"prompt": PROMPT1, "multi_modal_data": {"image": [image(1)]}}, GREEDY)
    eng.step()
    req = eng.core.scheduler.requests["img"]
    assert req.num_computed_tokens == req.mm_features[1].offset and eng.core.scheduler.requests["text"].num_output_tokens == 2
    eng.step()
    assert req.num_computed_tokens == req.mm_features[2].offset and eng.core.scheduler.requests["text"].num_output_tokens == 3
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core.runner.encoder_runs == 5
    _idle(llm)


def test_chat_with_image_parts_offline(idefics3):
    """LLM.chat takes image_url parts: the template over the placeholder, then HF's expansion and tokens."""
    import base64
    import io
    buf = io.BytesIO()
    image(1).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = _llm(idefics3[0])
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w6 w7"},
                                                 {"type": "image_url", "image_url": {"url": url}}]}], GREEDY)[0]
    ref = hf_ref(idefics3, "w3 <image>\nw6 w7 w4 w5", (1,))
    assert out.prompt_token_ids == ref[2]
    _greedy_match(out.outputs[0].token_ids, ref)
    _idle(llm)


@pytest.mark.parametrize("field,edit", [
    ("vision_config.hidden_act", {"config.json": lambda c: c["vision_config"].update(hidden_act="relu")}),
    ("vision_config.model_type", {"config.json": lambda c: c["vision_config"].update(model_type="siglip_vision_model")}),
    ("perceiver_config", {"config.json": lambda c: c.update(perceiver_config={"resampler_n_latents": 64})}),
    ("scale_factor", {"config.json": lambda c: c.update(scale_factor=3)}),
    ("max_image_size", {"processor_config.json": lambda c: c["image_processor"].update(max_image_size={"longest_edge": 64})}),
    ("image_seq_len", {"processor_config.json": lambda c: c.update(image_seq_len=64)}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_config_we_do_not_compute_is_refused(idefics3, tmp_path, field, edit):
    from pagedserve.model.loader import ModelLoadError
    d = _edited(idefics3[0], tmp_path, field.replace(".", "-"), edit)
    with pytest.raises((ModelLoadError, ValueError), match=field.rpartition(".")[2]):
        LLM(d, dtype="float32", num_kv_blocks=16)


def test_the_fields_smolvlm_checkpoints_carry_load_the_same(idefics3, tmp_path):
    """HuggingFaceTB's folders name the tower after the model and copy processor settings into
    vision_config; HF's model reads none of them: the same tokens."""
    d = _edited(idefics3[0], tmp_path, "hub-fields", {"config.json": lambda c: c["vision_config"].update(
        model_type="idefics3", max_image_size={"longest_edge": 32}, size={"longest_edge": 64}, use_base_siglip=False)})
    prompt = {"prompt": PROMPT1, "multi_modal_data": {"image": image(1)}}
    want = hf_ref(idefics3, PROMPT1, (1,))
    _greedy_match(_llm(d).generate(prompt, GREEDY)[0].outputs[0].token_ids, want)
