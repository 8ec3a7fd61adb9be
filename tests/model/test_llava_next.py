"""Images in the prompt (issue 55), LLaVA-NeXT: a tiny random LlavaNextForConditionalGeneration written by
transformers with its LlavaNextProcessor (anyres over 28 px patches: an image is fitted into 1x2 .. 3x1
patches plus the base image, unpadded, a newline vector after each row). Its image vectors equal HF's
get_image_features, its image-token counts HF's processor's for every shape; greedy tokens equal HF's in
float32 with one and two images of different aspect ratios, also when chunked prefill splits an image and
through preemption; the same image in two requests shares its blocks and runs the encoder once; a config
or processor we do not compute is refused naming the field."""
from __future__ import annotations


import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ParamError
from pagedserve.model.llava_next import AnyresImage
from tests.model.families import random_image, save_tiny_llava_next
from tests.model.helpers import assert_greedy_match
from tests.model.helpers import edited_copy as _edited
from tests.model.helpers import hf_greedy_inputs
from tests.model.helpers import assert_idle as _idle

PROMPT1 = "w5 <image> w7 w8 w9"
PROMPT2 = "w5 <image> w7 <image> w9 w10"
# (width, height): 2x2 patches with columns cut, 2x2 with rows cut, 1x2 uncut, 1x3, and 1's shape again
SIZES = {1: (40, 50), 2: (50, 40), 3: (80, 40), 4: (100, 30), 9: (40, 50)}
TOKENS = {(40, 50): 72, (50, 40): 70, (80, 40): 52, (100, 30): 68}    # 16 base + rows x (cols + 1)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHARPEN = 5.0            # (weaker weights give one repeated token whatever the image)


def image(seed: int):
    return random_image(seed, SIZES[seed])


_MODELS: dict = {}


def tiny(tmp_path_factory, layers=-2):
    """(folder, HF model, processor), written once per module and feature layer(s)."""
    key = str(layers)
    if key not in _MODELS:
        d = tmp_path_factory.mktemp("llava-next")
        _MODELS[key] = (str(d), *save_tiny_llava_next(d, SHARPEN, vision_feature_layer=layers))
    return _MODELS[key]


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
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


def _greedy_match(ours, ref) -> None:
    assert_greedy_match(ours, ref[0], ref[1])


@pytest.mark.parametrize("text,seeds,layers", [
    (PROMPT1, (1,), -2), (PROMPT2, (1, 2), -2), (PROMPT2, (3, 4), -2), (PROMPT2, (1, 2), [-3, -1])],
    ids=["one-image", "two-images", "two-wide-images", "two-feature-layers"])
def test_greedy_equals_hf(tmp_path_factory, text, seeds, layers):
    model = tiny(tmp_path_factory, layers)
    ref = hf_ref(model, text, seeds)
    llm = _llm(model[0])
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [image(s) for s in seeds]}}, GREEDY)[0]
    assert out.prompt_token_ids == ref[2]          # each placeholder expanded as HF's processor writes it
    assert out.prompt_token_ids.count(model[2].image_token_id) == sum(TOKENS[SIZES[s]] for s in seeds)
    _greedy_match(out.outputs[0].token_ids, ref)
    assert llm.engine.core.runner.encoder_runs == len(seeds)          # one encoder input per image
    # the image matters: another image of the same shape gives other tokens (so this test can fail)
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": [random_image(7, SIZES[s]) for s in seeds]}},
                         GREEDY)[0]
    assert other.prompt_token_ids == out.prompt_token_ids and other.outputs[0].token_ids != out.outputs[0].token_ids
    _idle(llm)


def test_image_vectors_equal_hf(next_model):
    """Each image's packed vectors (base image, unpadded grid, newlines) equal HF's get_image_features,
    for shapes cut in rows, in columns, by an odd padding, and not at all."""
    path, hf, proc = next_model
    llm = _llm(path)
    vision = llm.engine.core.runner.model.vision
    for size in [(40, 50), (50, 40), (80, 40), (100, 30), (30, 90), (37, 61), (90, 20), (64, 64), (21, 200)]:
        inp = proc.image_processor(images=[random_image(3, size)], return_tensors="pt")
        with torch.inference_mode():
            want = hf.model.get_image_features(pixel_values=inp["pixel_values"], image_sizes=inp["image_sizes"])
            got = vision([AnyresImage(inp["pixel_values"][0], tuple(inp["image_sizes"][0].tolist()))])
        want = want.pooler_output[0]
        assert got[0].shape == want.shape, size
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5, msg=f"image {size}")


def test_image_token_counts_equal_hf_processor(next_model):
    """Our count for an image (base + unpadded rows x (cols + 1)) is HF's processor's, for many shapes."""
    path, _, proc = next_model
    cfg = _llm(path, num_kv_blocks=16).engine.core.runner.model.vision.next_cfg
    rng = torch.Generator().manual_seed(0)
    sizes = [(1, 1), (28, 28), (29, 300), (300, 29), (57, 55)] + \
        [tuple(torch.randint(1, 240, (2,), generator=rng).tolist()) for _ in range(40)]
    for w, h in sizes:
        ids = proc(text="<image>", images=[random_image(0, (w, h))])["input_ids"][0]
        assert cfg.image_tokens(h, w) == ids.count(proc.image_token_id), (w, h)
    assert cfg.image_seq_len == 16 + 8 * 9      # the most: 2x2 patches uncut


def test_a_prompt_expanded_by_hf_is_taken_as_it_is(next_model):
    ref = hf_ref(next_model, PROMPT2, (1, 2))
    llm = _llm(next_model[0])
    imgs = [image(1), image(2)]
    out = llm.generate({"prompt_token_ids": ref[2], "multi_modal_data": {"image": imgs}}, GREEDY)[0]
    assert out.prompt_token_ids == ref[2]
    _greedy_match(out.outputs[0].token_ids, ref)
    with pytest.raises(ParamError, match="placeholder") as e:     # the images swapped: 70 + 72 tokens, not 72 + 70
        llm.generate({"prompt_token_ids": ref[2], "multi_modal_data": {"image": imgs[::-1]}}, GREEDY)
    assert e.value.param == "multi_modal_data"
    _idle(llm)


def test_chunked_prefill_splits_an_image_and_stays_exact(next_model):
    """10-token chunks: each image's ~70 tokens span eight steps; the encoder runs once per image."""
    ref = hf_ref(next_model, PROMPT2, (1, 2))
    llm = _llm(next_model[0], max_num_batched_tokens=10, long_prefill_token_threshold=10, enable_prefix_caching=False)
    out = llm.generate({"prompt": PROMPT2, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)[0]
    _greedy_match(out.outputs[0].token_ids, ref)
    assert llm.engine.core.runner.encoder_runs == 2
    _idle(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_stays_exact(next_model, mode):
    """Three image requests (the last with n=2) in a pool too small for all: some are preempted
    (recomputed, or swapped out and back)."""
    cases = [(PROMPT1, (1,)), (PROMPT2, (2, 3)), (PROMPT1, (4,))]
    refs = [hf_ref(next_model, t, seeds, n=24) for t, seeds in cases]
    llm = _llm(next_model[0], num_kv_blocks=80, preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=48,
               long_prefill_token_threshold=48)
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


def test_same_image_shares_blocks_and_encoder_output(next_model):
    llm = _llm(next_model[0], max_num_batched_tokens=256)
    eng, enc = llm.engine, llm.engine.core.scheduler.encoder
    a = _prefill(llm, "a", image(1))
    b = _prefill(llm, "b", image(1))
    c = _prefill(llm, "c", image(9))            # another image of the same shape: the same token ids
    req = eng.core.scheduler.requests["b"]
    # 73 prompt tokens (w5 and the image's 72), blocks of 4: a hit stops short of the last token, so "b"
    # computes position 72 only (the image's last newline), from the encoder cache; its first 18 blocks are "a"'s
    assert req.num_prompt_tokens == 73 and req.mm_features[0].offset == 1 and req.mm_features[0].length == 72
    assert b[:18] == a[:18] and b[18] != a[18] and req.num_cached_tokens == 72
    assert not set(c) & set(a) and eng.core.scheduler.requests["c"].num_cached_tokens == 0
    assert (enc.misses, enc.hits, eng.core.runner.encoder_runs) == (2, 1, 2)
    while eng.has_unfinished_requests():
        eng.step()
    _idle(llm)


def test_encoder_cache_without_prefix_cache(next_model):
    llm = _llm(next_model[0], enable_prefix_caching=False)
    for _ in range(2):
        llm.generate({"prompt": PROMPT1, "multi_modal_data": {"image": [image(1)]}}, GREEDY)
    enc = llm.engine.core.scheduler.encoder
    assert (enc.misses, enc.hits, llm.engine.core.runner.encoder_runs) == (1, 1, 1)
    assert enc.size_tokens == 72                          # counted in the image's own tokens
    _idle(llm)


def test_encoder_budget_cuts_before_an_image(next_model):
    """A budget of one image a step (raised to the most tokens one image can take: 88): the two-image request's
    first chunk stops before its second image, while a running request's decode goes on in the same steps."""
    llm = _llm(next_model[0], encoder_budget_tokens=72, enable_prefix_caching=False)
    eng = llm.engine
    assert eng.core.scheduler.encoder.budget_tokens == 88
    eng.add_request("text", {"prompt": "w5 w6 w7"}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.add_request("img", {"prompt": PROMPT2, "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)
    eng.step()
    req, text = eng.core.scheduler.requests["img"], eng.core.scheduler.requests["text"]
    assert req.num_computed_tokens == req.mm_features[1].offset and text.num_output_tokens == 2
    eng.step()
    assert req.num_computed_tokens == req.num_prompt_tokens and text.num_output_tokens == 3
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core.runner.encoder_runs == 2
    _idle(llm)


def test_chat_with_image_parts_offline(next_model):
    import base64
    import io
    buf = io.BytesIO()
    image(2).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = _llm(next_model[0])
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w6 w7"},
                                                 {"type": "image_url", "image_url": {"url": url}}]}], GREEDY)[0]
    ref = hf_ref(next_model, "w3 <image>\nw6 w7 w4 w5", (2,))
    assert out.prompt_token_ids == ref[2]
    _greedy_match(out.outputs[0].token_ids, ref)
    _idle(llm)


@pytest.mark.parametrize("field,edit", [
    ("vision_feature_select_strategy", {"config.json": lambda c: c.update(vision_feature_select_strategy="full")}),
    ("image_grid_pinpoints", {"config.json": lambda c: c.update(image_grid_pinpoints=[[28, 50]])}),
    ("vision_config.model_type", {"config.json": lambda c: c["vision_config"].update(model_type="siglip_vision_model")}),
    ("projector_hidden_act", {"config.json": lambda c: c.update(projector_hidden_act="relu6")}),
    ("image_newline_shape", {"config.json": lambda c: c.update(image_newline_shape=[2])}),
    ("patch_size", {"processor_config.json": lambda c: c.update(patch_size=14)}),
    ("num_additional_image_tokens", {"processor_config.json": lambda c: c.update(num_additional_image_tokens=0)}),
    ("crop_size", {"processor_config.json": lambda c: c["image_processor"].update(crop_size={"height": 14, "width": 14})}),
    ("image_grid_pinpoints", {"processor_config.json": lambda c: c["image_processor"].update(
        image_grid_pinpoints=[[28, 56]])}),
], ids=["select-strategy", "pinpoints", "tower", "projector-act", "unknown-field", "proc-patch-size",
        "proc-additional-tokens", "proc-crop-size", "proc-pinpoints"])
def test_a_config_we_do_not_compute_is_refused(next_model, tmp_path, field, edit):
    from pagedserve.model.loader import ModelLoadError
    d = _edited(next_model[0], tmp_path, field.replace(".", "-"), edit)
    with pytest.raises((ModelLoadError, ValueError), match=field.rpartition(".")[2]):
        LLM(d, dtype="float32", num_kv_blocks=16)


def test_llava_hf_config_fields_load_the_same(next_model, tmp_path):
    """llava-hf's LLaVA-NeXT configs carry use_image_newline_parameter and another image_seq_length; HF's model
    reads neither: the same tokens."""
    d = _edited(next_model[0], tmp_path, "hub-fields", {"config.json": lambda c: c.update(
        use_image_newline_parameter=True, image_seq_length=576)})
    _greedy_match(_llm(d).generate({"prompt": PROMPT1, "multi_modal_data": {"image": image(1)}}, GREEDY)[0]
                  .outputs[0].token_ids, hf_ref(next_model, PROMPT1, (1,)))
