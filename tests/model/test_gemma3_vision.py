"""Images in the prompt (issue 55), Gemma 3: a tiny random Gemma3ForConditionalGeneration (SigLIP, the pooling
projector, a Gemma 3 text model whose sliding layers are shorter than the prompts) written by transformers with
its Gemma3Processor. Greedy tokens, and the logprobs behind them, equal HF's in float32 with one and two images
(HF given its token_type_ids: an image's tokens attend to each other both ways), also through chunked prefill
(no chunk ends inside an image) and preemption; the prompt's ids are HF's processor's, newlines at the seams
included; the same image in two requests shares its blocks (a hit ending inside the image stays exact) and runs
the encoder once; a config or processor we do not compute is refused naming the field."""
from __future__ import annotations


import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.model.families import random_image, save_tiny_gemma3
from tests.model.helpers import assert_greedy_match, assert_idle
from tests.model.helpers import edited_copy as _edited
from tests.model.helpers import hf_greedy_inputs

PROMPT1 = "w5 <start_of_image> w7 w8 w9"
PROMPT2 = "w5 <start_of_image> w7 <start_of_image> w9 w10"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
IMAGE_TOKENS = 16
LOGPROB_TOL = 1e-4     # float32 against HF; a causal mask over the image moves them by ~1e-2 to 1


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    return (str(d), *save_tiny_gemma3(d))


def image(seed: int):
    return random_image(seed, (40, 50) if seed % 2 else (50, 30))


_REFS: dict = {}


def hf_ref(model, text: str, seeds: tuple[int, ...], n: int = 8):
    """HF's greedy continuation (EOS ignored), its per-step logprobs and the prompt ids its processor built
    (with its token_type_ids: the two-way mask over each image), computed once per module."""
    key = (text, seeds, n)
    if key not in _REFS:
        _, hf, proc = model
        inp = proc(text=text, images=[image(s) for s in seeds], return_tensors="pt")
        _REFS[key] = hf_greedy_inputs(hf, inp, n)
    return _REFS[key]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, **({"dtype": "float32", "num_kv_blocks": 160, "block_size": 4} | kw))


def _match(sample, ref) -> None:
    """Greedy tokens equal HF's, and each step's logprob of HF's token too (within LOGPROB_TOL)."""
    toks, lps, _ = ref
    assert_greedy_match(sample.token_ids, toks, lps)
    if sample.token_ids == toks and sample.logprobs:
        gap = max(abs(step[t].logprob - lp[t].item()) for step, t, lp in zip(sample.logprobs, toks, lps))
        assert gap < LOGPROB_TOL, f"logprobs differ from HF's by {gap:.2e}"


def _prompt(text: str, seeds) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": [image(s) for s in seeds]}}


@pytest.mark.parametrize("text,seeds", [(PROMPT1, (1,)), (PROMPT2, (1, 2))], ids=["one-image", "two-images"])
def test_greedy_equals_hf(gemma3, text, seeds):
    ref = hf_ref(gemma3, text, seeds)
    llm = _llm(gemma3[0])
    out = llm.generate(_prompt(text, seeds), GREEDY)[0]
    assert out.prompt_token_ids == ref[2]     # "\n\n<start_of_image>" + 16 image tokens + "<end_of_image>\n\n"
    assert out.prompt_token_ids.count(gemma3[2].tokenizer.image_token_id) == IMAGE_TOKENS * len(seeds)
    _match(out.outputs[0], ref)
    assert llm.engine.core.runner.encoder_runs == len(seeds)
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": [random_image(7) for _ in seeds]}}, GREEDY)[0]
    assert other.outputs[0].token_ids != out.outputs[0].token_ids       # the image matters
    assert_idle(llm)


def test_prompt_logprobs_see_the_image_both_ways(gemma3):
    """Every prompt position's logprob equals HF's with token_type_ids, and not HF's causal one: inside an
    image (each token sees the whole image) and after it. Two images, sliding layers shorter than the prompt."""
    _, hf, proc = gemma3
    inp = proc(text=PROMPT2, images=[image(1), image(2)], return_tensors="pt")
    ids = inp["input_ids"][0].tolist()
    causal = {k: v for k, v in inp.items() if k != "token_type_ids"}
    with torch.inference_mode():
        two_way, one_way = (torch.log_softmax(hf(**x).logits[0], -1) for x in (inp, causal))
    out = _llm(gemma3[0]).generate(_prompt(PROMPT2, (1, 2)), SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ours = torch.tensor([step[ids[i + 1]].logprob for i, step in enumerate(out.prompt_logprobs[1:])])
    want, causal_lp = (lp[torch.arange(len(ids) - 1), ids[1:]] for lp in (two_way, one_way))
    assert (ours - want).abs().max() < LOGPROB_TOL
    assert (ours - causal_lp).abs().max() > 100 * LOGPROB_TOL


def test_a_newline_beside_the_placeholder_is_tokenized_as_hf(gemma3):
    """HF's processor writes "\\n\\n" around the image into the text, so "w5\\n<start_of_image>" is one "\\n\\n\\n"
    run in its tokens: the same ids, and the same tokens."""
    text = "w5\n<start_of_image>\nw7 w8"
    ref = hf_ref(gemma3, text, (1,))
    out = _llm(gemma3[0]).generate(_prompt(text, (1,)), GREEDY)[0]
    assert out.prompt_token_ids == ref[2]
    _match(out.outputs[0], ref)


def test_a_prompt_expanded_by_hf_is_taken_as_it_is(gemma3):
    ref = hf_ref(gemma3, PROMPT2, (1, 2))
    llm = _llm(gemma3[0])
    out = llm.generate({"prompt_token_ids": ref[2], "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY)[0]
    assert out.prompt_token_ids == ref[2]
    _match(out.outputs[0], ref)
    from pagedserve.errors import ParamError
    with pytest.raises(ParamError, match="runs of 16"):
        llm.generate({"prompt_token_ids": ref[2], "multi_modal_data": {"image": [image(1)]}}, GREEDY)
    with pytest.raises(ParamError, match="2 image placeholder tokens for 1 images"):
        llm.generate(_prompt(PROMPT2, (1,)), GREEDY)
    assert_idle(llm)


def _chunks(llm: LLM) -> list[tuple[int, int]]:
    """Every prefill chunk the runner is given from now on: (start, end) positions."""
    runner, seen = llm.engine.core.runner, []
    prepare = runner.prepare

    def spy(so, *a, **kw):
        seen.extend((s.start, s.start + s.num_tokens) for s in so.seqs if not s.is_decode)
        return prepare(so, *a, **kw)
    runner.prepare = spy
    return seen


def test_chunked_prefill_never_splits_an_image(gemma3):
    """6-token chunks: a chunk that would end inside an image stops before it, and the next runs the whole
    image (16 tokens, past the threshold) with what fits after it; tokens still HF's."""
    ref = hf_ref(gemma3, PROMPT2, (1, 2))
    llm = _llm(gemma3[0], max_num_batched_tokens=20, long_prefill_token_threshold=6, enable_prefix_caching=False)
    seen = _chunks(llm)
    out = llm.generate(_prompt(PROMPT2, (1, 2)), GREEDY)[0]
    _match(out.outputs[0], ref)
    ids, soft = ref[2], gemma3[2].tokenizer.image_token_id
    images = [(k, k + IMAGE_TOKENS) for k in range(len(ids)) if ids[k] == soft and ids[k - 1] != soft]
    assert len(images) == 2 and len(seen) > 4
    assert not [(s, e) for s, e in seen for a, b in images if a < e < b], seen
    assert any(e - s > 6 for s, e in seen)              # an image ran whole, past the 6-token threshold
    assert_idle(llm)


def test_whole_images_rule():
    """EncoderCacheManager.whole, exact: an image at 10..25. A chunk ending inside it stops before it; one starting
    at it (or inside it, after a prefix hit) runs to its end when the step's budget holds that, else waits (0);
    chunks ending at or outside it are untouched; without whole_images nothing changes."""
    from pagedserve.core.encoder_cache import EncoderCacheManager
    from pagedserve.core.request import MMFeature, Request
    req = Request("r", [1] * 40, SamplingParams(), max_tokens=1, mm_features=(MMFeature("h", 10, 16),))
    enc = EncoderCacheManager(64, 64, whole_images=True)
    assert [enc.whole(req, 4, 12, 36), enc.whole(req, 10, 6, 36), enc.whole(req, 10, 6, 15),
            enc.whole(req, 16, 4, 24), enc.whole(req, 16, 4, 9), enc.whole(req, 26, 6, 14),
            enc.whole(req, 0, 10, 40), enc.whole(req, 0, 26, 40)] == [6, 16, 0, 10, 0, 6, 10, 26]
    assert EncoderCacheManager(64, 64).whole(req, 4, 12, 36) == 12


def test_a_budget_smaller_than_an_image_is_refused(gemma3):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _llm(gemma3[0], max_num_batched_tokens=8)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_stays_exact(gemma3, mode):
    cases = [(PROMPT1, (1,)), (PROMPT2, (2, 3)), (PROMPT1, (4,))]
    refs = [hf_ref(gemma3, t, seeds, n=24) for t, seeds in cases]
    llm = _llm(gemma3[0], num_kv_blocks=56, preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=24,
               long_prefill_token_threshold=24)
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


def test_same_image_shares_blocks_a_hit_inside_the_image_stays_exact(gemma3):
    """Blocks of 16: "w5 <start_of_image>" is 21 tokens (the image at 3..18); the second request's hit is its
    first block, ending inside the image, whose K/V were computed with the whole image in view: it computes
    positions 16..20 (the image's last three tokens see the cached ones and each other) and still gives HF's
    tokens. Another image of the same shape shares nothing; the encoder ran once for the shared image."""
    text = "w5 <start_of_image>"
    ref = hf_ref(gemma3, text, (1,))
    llm = _llm(gemma3[0], block_size=16, num_kv_blocks=16)
    eng, enc = llm.engine, llm.engine.core.scheduler.encoder
    outs = {}
    for rid, seed in (("a", 1), ("b", 1), ("c", 3)):
        eng.add_request(rid, _prompt(text, (seed,)), GREEDY)
        eng.step()
    tables = {rid: eng.core.kv.block_tables(rid)[0] for rid in "abc"}
    req = eng.core.scheduler.requests["b"]
    assert req.num_prompt_tokens == 21 and req.mm_features[0].offset == 3 and req.num_cached_tokens == 16
    assert tables["b"][0] == tables["a"][0] and tables["b"][1] != tables["a"][1]
    assert not set(tables["c"]) & set(tables["a"])
    assert (enc.misses, enc.hits, eng.core.runner.encoder_runs) == (2, 1, 2)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    _match(outs["a"].outputs[0], ref)
    _match(outs["b"].outputs[0], ref)
    assert_idle(llm)


@pytest.mark.parametrize("path", ["torch", "native", "triton"])
def test_prefill_key_limits_open_an_image_both_ways(path):
    """A chunk at positions 6..17 over a 6-token cached prefix, an image at 8..13: its queries see keys up to 13,
    the others causally, each within a window of 10 behind it, whichever path the step was given (the native
    and Triton ones hand such a step to the torch path's mask); without the limits the image's queries differ."""
    from pagedserve.model.attention import AttentionMetadata, LayerKV, paged_attention
    torch.manual_seed(0)
    bs, n_kv, nh, hd, n, q_len, window = 4, 2, 4, 8, 18, 12, 10
    kv = LayerKV(torch.randn(8, bs, n_kv, hd), torch.randn(8, bs, n_kv, hd))
    table = torch.tensor([[3, 1, 5, 2, 7]])
    q = torch.randn(q_len, nh, hd)
    pos = torch.arange(n - q_len, n)
    limits = torch.where((pos >= 8) & (pos <= 13), 13, pos)
    keys, values = (x[table[0]].flatten(0, 1)[:n].repeat_interleave(nh // n_kv, dim=1) for x in (kv.k, kv.v))
    key = torch.arange(n)[None]
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.3
    scores = scores.masked_fill(~((key <= limits[:, None]) & (key > pos[:, None] - window)), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)

    def run(lim):
        md = AttentionMetadata(torch.zeros(q_len, dtype=torch.long), prefill_block_tables=table,
                               prefill_cu_q=torch.tensor([0, q_len]), prefill_context_lens=torch.tensor([n]),
                               native=path == "native", native_prefill=path == "native", triton=path == "triton",
                               max_prefill_q=q_len, prefill_key_limits=lim)
        return paged_attention(q, kv, md, 0.3, window)
    assert torch.allclose(run(limits), want, atol=1e-5)
    causal = run(None) if path == "torch" else None
    if causal is not None:
        assert not torch.allclose(causal[2:7], want[2:7], atol=1e-3) and torch.allclose(causal[8:], want[8:], atol=1e-5)


@pytest.mark.parametrize("field,edit", [
    ("vision_config.hidden_act", {"config.json": lambda c: c["vision_config"].update(hidden_act="relu")}),
    ("vision_config.model_type", {"config.json": lambda c: c["vision_config"].update(model_type="clip_vision_model")}),
    ("mm_tokens_per_image", {"config.json": lambda c: c.update(mm_tokens_per_image=9)}),
    ("image_token_index", {"config.json": lambda c: c.update(image_token_index=100000)}),
    ("use_bidirectional_attention", {"config.json": lambda c: c["text_config"].update(
        use_bidirectional_attention=True)}),
    ("image_seq_length", {"processor_config.json": lambda c: c.update(image_seq_length=9)}),
    ("do_pan_and_scan", {"processor_config.json": lambda c: c["image_processor"].update(do_pan_and_scan=True)}),
    ("vision_config.image_size", {"processor_config.json": lambda c: c["image_processor"].update(
        size={"height": 64, "width": 64})}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_config_we_do_not_compute_is_refused(gemma3, tmp_path, field, edit):
    from pagedserve.model.loader import ModelLoadError
    d = _edited(gemma3[0], tmp_path, field.replace(".", "-"), edit)
    with pytest.raises((ModelLoadError, ValueError), match=field.rpartition(".")[2]):
        LLM(d, dtype="float32", num_kv_blocks=16)
