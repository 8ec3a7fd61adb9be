"""Images in the prompt (issue 55), Qwen2.5-VL: a tiny random Qwen2_5_VLForConditionalGeneration (the windowed
ViT with 2D rotary, full attention in one of its three blocks, the 2x2 merger; a Qwen2 text model with M-RoPE)
written by transformers with its image processor. Greedy tokens, and the logprobs behind them, equal HF's in
float32 with one image, two images of different sizes and none, also through chunked prefill in small chunks
(an image split across chunks) and preemption; every prompt position's logprob equals HF's forward; the M-RoPE
positions equal HF's get_rope_index (and decode continues from its rope_deltas); Qwen's own config layout
loads; the tower's vectors equal HF's; the same image in two requests shares its blocks and one encoder run,
and two images with the same token ids but different grids share nothing; a video, or a config or processor
we do not compute, is refused naming the field."""
from __future__ import annotations

import json

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.errors import ParamError
from pagedserve.model.qwen2_5_vl import QwenVLImage
from tests.model.families import qwen_vl_inputs, random_image, save_tiny_qwen2_5_vl
from tests.model.helpers import assert_greedy_match, assert_idle
from tests.model.helpers import edited_copy as _edited
from tests.model.helpers import hf_greedy_inputs

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT1 = f"w5 {IMG} w7 w8 w9"
PROMPT2 = f"w5 {IMG} w7 {IMG} w9 w10"
TEXT = "w5 w6 w7 w8 w9 w10"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4
# (width, height) by seed, and its (rows, cols) of tokens: 48x40 px -> 5 x 6, 40x50 -> 6 x 5, 50x30 -> 4 x 6, 72x56 -> 7 x 9
SIZES = {0: (48, 40), 1: (40, 50), 2: (50, 30), 3: (72, 56)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2_5_vl")
    return (str(d), *save_tiny_qwen2_5_vl(d))


def image(seed: int, size: tuple[int, int] | None = None):
    return random_image(seed, size or SIZES[seed % 4])


_REFS: dict = {}


def hf_ref(model, text: str, seeds: tuple[int, ...], n: int = 8, sizes=None):
    """HF's greedy continuation (EOS ignored), its per-step logprobs and the prompt ids, computed once."""
    key = (text, seeds, n, sizes)
    if key not in _REFS:
        _, hf, proc, tok = model
        inp = qwen_vl_inputs(proc, tok, text, [image(s, sz) for s, sz in zip(seeds, sizes or [None] * len(seeds))])
        _REFS[key] = hf_greedy_inputs(hf, inp, n)
    return _REFS[key]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, **({"dtype": "float32", "num_kv_blocks": 200, "block_size": 4} | kw))


def _match(sample, ref) -> None:
    """Greedy tokens equal HF's, and each step's logprob of HF's token too (within LOGPROB_TOL)."""
    toks, lps, _ = ref
    assert_greedy_match(sample.token_ids, toks, lps)
    assert sample.token_ids == toks
    if sample.logprobs:
        gap = max(abs(step[t].logprob - lp[t].item()) for step, t, lp in zip(sample.logprobs, toks, lps))
        assert gap < LOGPROB_TOL, f"logprobs differ from HF's by {gap:.2e}"


def _prompt(text: str, seeds, sizes=None):
    if not seeds:
        return text
    return {"prompt": text, "multi_modal_data": {"image": [image(s, z) for s, z in zip(seeds, sizes or [None] * 9)]}}


@pytest.mark.parametrize("text,seeds", [(PROMPT1, (1,)), (PROMPT2, (1, 2)), (TEXT, ())],
                         ids=["one-image", "two-images", "text-only"])
def test_greedy_equals_hf(qwen, text, seeds):
    ref = hf_ref(qwen, text, seeds)
    llm = _llm(qwen[0])
    out = llm.generate(_prompt(text, seeds), GREEDY)[0]
    assert out.prompt_token_ids == ref[2]
    assert out.prompt_token_ids.count(qwen[1].config.image_token_id) == sum((30, 24)[:len(seeds)])
    _match(out.outputs[0], ref)
    assert llm.engine.core.runner.encoder_runs == len(seeds)
    if seeds:
        other = llm.generate(_prompt(text, tuple(s + 4 for s in seeds)), GREEDY)[0]   # same sizes, other pixels
        assert other.prompt_token_ids == out.prompt_token_ids
        assert other.outputs[0].token_ids != out.outputs[0].token_ids                 # the image matters
    assert_idle(llm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_other_attention_paths_equal_hf(qwen, backend):
    """The torch path (and Triton's, interpreted on the CPU) with the gathered M-RoPE cos/sin: the same tokens."""
    if backend == "triton":
        pytest.importorskip("triton")
    ref = hf_ref(qwen, PROMPT2, (1, 2))
    out = _llm(qwen[0], attention_backend=backend).generate(_prompt(PROMPT2, (1, 2)), GREEDY)[0]
    _match(out.outputs[0], ref)


def test_image_vectors_equal_hf(qwen):
    """The tower and merger against HF's get_image_features: windows partial at the edge (6 x 5 tokens, windows of
    2 x 2), whole (4 x 6), and a larger grid (7 x 9) with several of each."""
    path, hf, proc, _ = qwen
    vision = _llm(path, num_kv_blocks=16).engine.core.runner.model.vision
    for seed in (1, 2, 3):
        out = proc(images=[image(seed)], return_tensors="pt")
        grid = tuple(out["image_grid_thw"][0].tolist())
        with torch.inference_mode():
            want = hf.model.get_image_features(out["pixel_values"], out["image_grid_thw"]).pooler_output[0]
            ours = vision([QwenVLImage(out["pixel_values"], grid)])[0]
        assert ours.shape == want.shape and (ours - want).abs().max() < 1e-5, grid


def _positions(llm: LLM) -> list:
    """The rotary positions the runner gives each step's model from now on."""
    runner, seen = llm.engine.core.runner, []
    prepare = runner.prepare

    def spy(so, *a, **kw):
        out = prepare(so, *a, **kw)
        seen.append(([(s.start, s.num_tokens) for s in so.seqs], out[1].clone()))
        return out
    runner.prepare = spy
    return seen


def test_positions_equal_hf_rope_index(qwen):
    """Two images of different sizes in 5-token chunks: every prompt token's three rows equal HF's get_rope_index
    (image tokens (p, p + row, p + col), text after an image from p + max(rows, cols)), and each decode step's
    position is its index plus HF's rope_deltas (all three rows)."""
    path, hf, proc, tok = qwen
    inp = qwen_vl_inputs(proc, tok, PROMPT2, [image(1), image(2)])
    want, delta = hf.model.get_rope_index(inp["input_ids"], inp["mm_token_type_ids"], inp["image_grid_thw"])
    want, delta = want[:, 0], int(delta)
    llm = _llm(path, max_num_batched_tokens=5, long_prefill_token_threshold=5, enable_prefix_caching=False)
    seen = _positions(llm)
    llm.generate(_prompt(PROMPT2, (1, 2)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    n = want.shape[1]
    got = torch.full((3, n + 3), -1, dtype=torch.long)
    for (((start, k),), pos) in seen:
        got[:, start:start + k] = pos if pos.dim() == 2 else pos.expand(3, -1)
    assert torch.equal(got[:, :n], want)
    assert delta < 0 and torch.equal(got[:, n:], (torch.arange(n, n + 3) + delta).expand(3, -1))
    assert any(pos.dim() == 1 for _, pos in seen[:-3])          # text-only chunks keep 1-D positions


def test_prompt_logprobs_equal_hf(qwen):
    """Every prompt position's logprob equals HF's forward over the whole prompt (two images, 9-token chunks), and
    not HF's with plain 1-D positions (M-RoPE moves them)."""
    path, hf, proc, tok = qwen
    inp = qwen_vl_inputs(proc, tok, PROMPT2, [image(1), image(2)])
    ids = inp["input_ids"][0].tolist()
    flat = inp | {"position_ids": torch.arange(len(ids))[None].expand(3, 1, -1)}
    with torch.inference_mode():
        want, plain = (torch.log_softmax(hf(**x).logits[0], -1) for x in (inp, flat))
    llm = _llm(path, max_num_batched_tokens=9, long_prefill_token_threshold=9)
    out = llm.generate(_prompt(PROMPT2, (1, 2)), SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ours = torch.tensor([step[ids[i + 1]].logprob for i, step in enumerate(out.prompt_logprobs[1:])])
    want, plain = (lp[torch.arange(len(ids) - 1), ids[1:]] for lp in (want, plain))
    assert (ours - want).abs().max() < LOGPROB_TOL
    assert (ours - plain).abs().max() > 100 * LOGPROB_TOL
    assert_idle(llm)


def _chunks(llm: LLM) -> list[tuple[int, int]]:
    runner, seen = llm.engine.core.runner, []
    prepare = runner.prepare

    def spy(so, *a, **kw):
        seen.extend((s.start, s.start + s.num_tokens) for s in so.seqs if not s.is_decode)
        return prepare(so, *a, **kw)
    runner.prepare = spy
    return seen


def test_chunked_prefill_in_small_chunks(qwen):
    """7-token chunks split both images across steps (an image's positions are its own whatever the chunk)."""
    ref = hf_ref(qwen, PROMPT2, (1, 2))
    llm = _llm(qwen[0], max_num_batched_tokens=7, long_prefill_token_threshold=7, enable_prefix_caching=False)
    seen = _chunks(llm)
    out = llm.generate(_prompt(PROMPT2, (1, 2)), GREEDY)[0]
    _match(out.outputs[0], ref)
    feats = llm.engine.core.scheduler.encoder
    assert feats.misses == 2 and len(seen) >= len(ref[2]) // 7
    image_id = qwen[1].config.image_token_id
    starts = [k for k, t in enumerate(ref[2]) if t == image_id and ref[2][k - 1] != image_id]
    assert any(a < e < a + 24 for s, e in seen for a in starts)    # a chunk ended inside an image
    assert_idle(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_stays_exact(qwen, mode):
    """Three image requests (the last with n=2) in a pool too small for all: some are preempted (recomputed, or
    swapped out and back), their outputs past the images recomputed at index + shift."""
    cases = [(PROMPT1, (1,)), (PROMPT2, (2, 3)), (PROMPT1, (0,))]
    refs = [hf_ref(qwen, t, seeds, n=24) for t, seeds in cases]
    llm = _llm(qwen[0], num_kv_blocks=40, preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=32,
               long_prefill_token_threshold=32)
    kv, swaps = llm.engine.core.kv, []
    swap_out = kv.swap_out
    kv.swap_out = lambda req: (swaps.append(req.request_id), swap_out(req))[1]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=n, logprobs=0) for n in (1, 1, 2)]
    outs = llm.generate([_prompt(t, seeds) for t, seeds in cases], params)
    assert llm.engine.core.scheduler.num_preemptions > 0 and bool(swaps) == (mode == "swap")
    for o, ref in zip(outs, refs):
        assert o.prompt_token_ids == ref[2]
        for sample in o.outputs:
            _match(sample, ref)
    assert_idle(llm)


def test_same_image_shares_blocks_and_encoder_output(qwen):
    """Blocks of 4: "w5 <image 30 tokens> w7 w8 w9" is 36 tokens. The second request with the same image hits 8
    blocks (capped below the last token: the image ends at 32) and reads no image vector; an image of the same size
    with other pixels shares nothing (the image starts in block 0); an image of the transposed size (5 x 6 tokens: the same 30 ids, other M-RoPE
    positions) shares nothing either. Every one's tokens equal HF's."""
    llm = _llm(qwen[0])
    eng, enc = llm.engine, llm.engine.core.scheduler.encoder
    cases = {"a": ((1,), None), "b": ((1,), None), "c": ((5,), None), "d": ((1,), ((50, 40),))}
    for rid, (seeds, sizes) in cases.items():
        eng.add_request(rid, _prompt(PROMPT1, seeds, sizes), GREEDY)
        eng.step()
    tables = {rid: eng.core.kv.block_tables(rid)[0] for rid in cases}
    reqs = eng.core.scheduler.requests
    assert reqs["a"].num_prompt_tokens == 36 and reqs["a"].mm_features[0].grid == (6, 5)
    assert reqs["d"].prompt_token_ids == reqs["a"].prompt_token_ids and reqs["d"].mm_features[0].grid == (5, 6)
    assert reqs["b"].num_cached_tokens == 32 and tables["b"][:8] == tables["a"][:8]
    assert reqs["c"].num_cached_tokens == 0 and reqs["d"].num_cached_tokens == 0     # (the image begins block 0)
    assert not set(tables["c"]) & set(tables["a"]) and not set(tables["d"]) & set(tables["a"])
    assert (enc.misses, enc.hits, eng.core.runner.encoder_runs) == (3, 0, 3)    # ("b" reads no image vector)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    for rid, (seeds, sizes) in cases.items():
        _match(outs[rid].outputs[0], hf_ref(qwen, PROMPT1, seeds, sizes=sizes))
    assert_idle(llm)


def test_a_prefix_hit_ending_inside_an_image_stays_exact(qwen):
    """A prompt that is one image (32 tokens, the image at 1..30): the second request's hit is 7 blocks, ending
    inside the image; it computes positions 28..31 (the image's last three tokens at their 2D positions, from the
    encoder cache) and gives HF's tokens."""
    ref = hf_ref(qwen, IMG, (1,))
    llm = _llm(qwen[0])
    outs = [llm.generate(_prompt(IMG, (1,)), GREEDY)[0] for _ in range(2)]
    req_hit = llm.engine.core.scheduler.encoder
    assert outs[1].num_cached_tokens == 28 and (req_hit.misses, req_hit.hits) == (1, 1)
    for o in outs:
        _match(o.outputs[0], ref)
    assert_idle(llm)


def test_encoder_cache_without_prefix_cache(qwen):
    llm = _llm(qwen[0], enable_prefix_caching=False)
    for _ in range(2):
        _match(llm.generate(_prompt(PROMPT1, (1,)), GREEDY)[0].outputs[0], hf_ref(qwen, PROMPT1, (1,)))
    enc = llm.engine.core.scheduler.encoder
    assert (enc.misses, enc.hits, llm.engine.core.runner.encoder_runs) == (1, 1, 1)
    assert enc.size_tokens == 30                          # counted in the image's own tokens
    assert_idle(llm)


def test_encoder_budget_cuts_before_an_image(qwen):
    """A budget of one image a step (raised to the most tokens one image can take: 64 at the processor's 4096
    pixels): the two-image request's first chunk stops before its second image (63 + 30 tokens), while a running
    request's decode goes on in the same steps; its tokens still HF's."""
    llm = _llm(qwen[0], encoder_budget_tokens=30, enable_prefix_caching=False)
    eng = llm.engine
    assert eng.core.scheduler.encoder.budget_tokens == 64
    eng.add_request("text", {"prompt": TEXT}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.add_request("img", _prompt(PROMPT2, (3, 1)), GREEDY)
    eng.step()
    req, text = eng.core.scheduler.requests["img"], eng.core.scheduler.requests["text"]
    assert [f.length for f in req.mm_features] == [63, 30]
    assert req.num_computed_tokens == req.mm_features[1].offset and text.num_output_tokens == 2
    eng.step()
    assert req.num_computed_tokens == req.num_prompt_tokens and text.num_output_tokens == 3
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    _match(outs["img"].outputs[0], hf_ref(qwen, PROMPT2, (3, 1)))
    assert eng.core.runner.encoder_runs == 2
    assert_idle(llm)


def test_chat_with_image_parts_offline(qwen):
    """A chat image part is written as Qwen's template writes it: <|vision_start|><|image_pad|><|vision_end|>,
    no newline, before the message's text."""
    import base64
    import io
    buf = io.BytesIO()
    image(2).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    llm = _llm(qwen[0])
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w6 w7"},
                                                 {"type": "image_url", "image_url": {"url": url}}]}], GREEDY)[0]
    ref = hf_ref(qwen, f"w3 {IMG}w6 w7 w4 w5", (2,))
    assert out.prompt_token_ids == ref[2]
    _match(out.outputs[0], ref)
    assert_idle(llm)


def test_video_and_bad_image_counts_are_refused(qwen):
    llm = _llm(qwen[0], num_kv_blocks=32)
    with pytest.raises(ParamError, match=r"multi_modal_data\.video: video inputs are not supported") as e:
        llm.generate({"prompt": PROMPT1, "multi_modal_data": {"video": [image(1)]}}, GREEDY)
    assert e.value.param == "multi_modal_data.video"
    with pytest.raises(ParamError, match="2 image placeholder tokens for 1 images"):
        llm.generate(_prompt(PROMPT2, (1,)), GREEDY)
    with pytest.raises(ParamError, match="no image was given"):
        llm.generate(PROMPT1, GREEDY)
    assert_idle(llm)


@pytest.mark.parametrize("field,edit", [
    ("vision_config.hidden_act", {"config.json": lambda c: c["vision_config"].update(hidden_act="relu6")}),
    ("vision_config.rope_parameters", {"config.json": lambda c: c["vision_config"].update(
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0, "factor": 2.0})}),
    ("mrope_section", {"config.json": lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2])}),
    ("window_size", {"config.json": lambda c: c["vision_config"].update(window_size=4)}),
    ("image_token_id", {"config.json": lambda c: c.update(image_token_id=100000)}),
    ("patch_size", {"preprocessor_config.json": lambda c: c.update(patch_size=8)}),
    ("merge_size", {"preprocessor_config.json": lambda c: c.update(merge_size=1)}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_config_we_do_not_compute_is_refused(qwen, tmp_path, field, edit):
    from pagedserve.model.loader import ModelLoadError
    d = _edited(qwen[0], tmp_path, field.replace(".", "-"), edit)
    with pytest.raises((ModelLoadError, ValueError), match=field.rpartition(".")[2]):
        LLM(d, dtype="float32", num_kv_blocks=16)


def _qwen_layout(c: dict) -> None:
    """config.json as Qwen's own files write it (transformers 4.x): the text fields at the top level, rope_scaling
    {"type": "mrope"}, vision_token_id, and the tower's in_chans and spatial_patch_size."""
    text = c.pop("text_config")
    rope = text.pop("rope_parameters")
    for k in ("model_type", "layer_types", "dtype"):
        text.pop(k, None)
    c.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
             vision_token_id=c["image_token_id"] - 1)
    c["vision_config"].update(in_chans=3, spatial_patch_size=c["vision_config"]["patch_size"])


def test_qwen_config_layout_loads_the_same(qwen, tmp_path):
    d = _edited(qwen[0], tmp_path, "qwen-layout", {"config.json": _qwen_layout})
    cfg = json.loads(open(f"{d}/config.json").read())
    assert "text_config" not in cfg and cfg["rope_scaling"]["type"] == "mrope"
    out = _llm(d).generate(_prompt(PROMPT2, (1, 2)), GREEDY)[0]
    _match(out.outputs[0], hf_ref(qwen, PROMPT2, (1, 2)))
