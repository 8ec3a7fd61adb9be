"""Prompt logprobs (against HF's full forward), logit bias and structured outputs, offline."""
from __future__ import annotations

import json
import re

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams

PROMPT = ("The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in fixed-size blocks "
          "taken from one pool, and the scheduler re-forms the batch at every step.")


def _hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_against_hf(hf_model, ids, plp, k):
    ref = _hf_prompt_logprobs(hf_model, ids)
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        d = plp[p]
        assert ids[p] in d
        assert abs(d[ids[p]].logprob - ref[p - 1, ids[p]].item()) < 1e-3
        assert d[ids[p]].rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1 or abs(
            d[ids[p]].logprob - ref[p - 1].max().item()) < 1e-4   # near-ties may swap ranks
        top = sorted((v for v in d.values() if v.rank <= k), key=lambda v: v.rank)
        assert len(top) >= k


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """A random Llama that transformers writes, with a 512-word tokenizer, and HF's model of it: what prompt
    logprobs are (which rows predict which position, values, ranks, chunks) is checked against HF's full
    forward on the same weights. (The default model against HF is tests/model/test_reference.py; transformers'
    read of the bundled GGUF took ~30 s of this file. 512 ids, not 49152: a prompt token's rank among them is
    not a float32 near-tie that another host's rounding could swap.)"""
    from tests.model.families import save_family, tiny_tokenizer
    d, tok = tmp_path_factory.mktemp("small_llama"), tiny_tokenizer(512)
    return str(d), save_family("llama", d, len(tok), tok)


WORDS = " ".join(f"w{3 + 37 * i % 509}" for i in range(40))      # 40 tokens of the 512-word vocabulary


def test_prompt_logprobs_match_hf(small_llama):
    path, hf = small_llama
    llm = LLM(path, num_kv_blocks=64, block_size=16, dtype="float32")
    out = llm.generate(WORDS, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 40
    _check_against_hf(hf, out.prompt_token_ids, out.prompt_logprobs, 3)


def test_prompt_logprobs_chunked_and_with_a_cached_prefix(small_llama):
    """Chunks of 16 tokens, and a prompt whose prefix is already in the prefix cache: the logprobs are
    whole and equal to the unchunked ones (the cache is skipped for such requests)."""
    path, hf = small_llama
    eng = LLM(path, num_kv_blocks=256, block_size=16, dtype="float32", max_num_batched_tokens=16,
              long_prefill_token_threshold=16, enable_prefix_caching=True)
    warm = eng.generate(WORDS, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    out = eng.generate(WORDS, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert warm.prompt_token_ids == out.prompt_token_ids
    assert out.num_cached_tokens == 0
    _check_against_hf(hf, out.prompt_token_ids, out.prompt_logprobs, 0)
    assert eng.engine.core.kv.num_free_blocks == eng.engine.core.kv.pool.num_usable_blocks


def test_prompt_logprobs_with_n_and_streaming(llm):
    one = llm.generate(PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=1), use_tqdm=False)[0]
    many = llm.generate(PROMPT, SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=1, prompt_logprobs=1),
                        use_tqdm=False)[0]
    assert len(many.outputs) == 3
    assert [None if d is None else {t: round(v.logprob, 4) for t, v in d.items()} for d in many.prompt_logprobs] == \
           [None if d is None else {t: round(v.logprob, 4) for t, v in d.items()} for d in one.prompt_logprobs]
    eng = llm.engine
    eng.add_request("s", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=1), stream=True)
    got = []
    while eng.has_unfinished_requests():
        got += [o.prompt_logprobs for o in eng.step() if o.prompt_logprobs is not None]
    assert len(got) == 1 and len(got[0]) == len(one.prompt_logprobs)


PRESSED = [{"prompt_token_ids": list(range(200 + 7 * i, 260 + 7 * i))} for i in range(6)]


def _pressed_params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=30, prompt_logprobs=1, ignore_eos=True, n=n, temperature=1.0 if n > 1 else 0.0,
                          seed=5)


@pytest.fixture(scope="module")
def unpressed(small_llama):
    """The runs without pressure the preemption cases compare with, n = 1 and n = 2 in one batch: a float32
    output does not depend on what shares its batch (tests/engine/test_invariance.py; the sampled forks draw
    from their seeded generators), and a run's time is mostly its steps."""
    llm = LLM(small_llama[0], num_kv_blocks=256, block_size=16, dtype="float32")
    outs = llm.generate(PRESSED * 2, [_pressed_params(1)] * len(PRESSED) + [_pressed_params(2)] * len(PRESSED),
                        use_tqdm=False)
    return {1: outs[:len(PRESSED)], 2: outs[len(PRESSED):]}


@pytest.mark.parametrize("mode,n", [("recompute", 1), ("swap", 1), ("recompute", 2)])
def test_prompt_logprobs_survive_preemption(small_llama, unpressed, mode, n):
    """A request preempted mid-prefill (recompute restarts from token 0) still yields each prompt
    position's logprobs exactly once, equal to a run without pressure; so does a fork of an n > 1
    request recomputed after it forked (regression: it asked for them again, under its own id). On the
    small random model: which rows are computed when is the scheduler's bookkeeping, whatever the model."""
    prompts, sp, ref = PRESSED, _pressed_params(n), unpressed[n]
    tight = LLM(small_llama[0], num_kv_blocks=20, block_size=16, dtype="float32", preemption_mode=mode,
                swap_space=0.05, max_num_batched_tokens=32, long_prefill_token_threshold=32)
    outs = tight.generate(prompts, sp, use_tqdm=False)
    assert tight.engine.core.counters.preemptions > 0
    assert all(o.finish_reason == "length" and len(o.token_ids) == 30 for out in outs for o in out.outputs)
    for a, b in zip(outs, ref):
        assert len(a.prompt_logprobs) == 60 and a.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert all(blk.ref_cnt == 0 for blk in tight.engine.core.kv.pool.blocks[1:])


def test_prompt_logprob_rows_in_the_schedule():
    """The scheduler's records: chunk rows predict the following prompt tokens, never twice."""
    from pagedserve.core.kv_cache_manager import KVCacheManager
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler import Scheduler, SchedulerConfig
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4, long_prefill_token_threshold=4), KVCacheManager(32, 4))
    s.add_request(Request("a", [10, 11, 12, 13, 14, 15], SamplingParams(prompt_logprobs=2, max_tokens=2), 2))
    first, second = s.schedule().seqs[0], s.schedule().seqs[0]
    assert (first.prompt_logprobs.first, first.prompt_logprobs.targets, first.prompt_logprobs.k) == (0, (11, 12, 13, 14), 2)
    assert (second.prompt_logprobs.first, second.prompt_logprobs.targets) == (0, (15,))
    assert second.sampling is not None        # the last prompt row samples; it predicts no prompt token


def test_detokenize_false(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 4
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(detokenize=False, stop=["x"])


def test_logit_bias_forces_and_bans(llm):
    base = llm.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = llm.generate(PROMPT, SamplingParams(max_tokens=1, logit_bias={base: -100}),
                          use_tqdm=False)[0].outputs[0].token_ids[0]
    assert banned != base
    forced = llm.generate(PROMPT, SamplingParams(max_tokens=3, logit_bias={1234: 100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [1234, 1234, 1234]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "colour": {"enum": ["red", "green", "blue"]},
    "sizes": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}},
    "required": ["name", "colour", "sizes", "owner"], "additionalProperties": False}


def _valid(obj, schema=SCHEMA) -> bool:
    return (set(obj) == set(schema["required"]) and isinstance(obj["name"], str)
            and obj["colour"] in ("red", "green", "blue") and all(isinstance(x, int) for x in obj["sizes"])
            and isinstance(obj["owner"]["age"], int))


def test_json_schema_regex_choice_in_one_batch(llm):
    prompts = ["Describe a cat as JSON:", "My phone number is", "Is the sky blue? Answer:", "Tell me a story."]
    params = [SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
              SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(max_tokens=8)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert _valid(json.loads(outs[0].text)) and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"\d{3}-\d{4}", outs[1].text)
    assert outs[2].text in ("yes", "no")
    free = llm.generate(prompts[3], SamplingParams(max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert outs[3].text == free.text       # an unconstrained neighbour is untouched


def test_constrained_n_and_sampling(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    out = llm.generate("A JSON pet:", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=120,
                                                      structured_outputs=so), use_tqdm=False)[0]
    for o in out.outputs:
        if o.finish_reason == "stop":
            assert _valid(json.loads(o.text))


def test_bad_constraints_name_the_field(llm):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9")), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "foo"})),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
