"""Sampling semantics, sharing for n > 1 and beam search, and parameter validation."""
import pytest

import torch

from pagedserve import BeamSearchParams, SamplingParams

PROMPT = {"prompt_token_ids": list(range(1000, 1040))}


def test_n4_shares_prompt_blocks(llm):
    eng = llm.engine
    prompt = {"prompt_token_ids": list(range(2000, 2100))}         # 100 tokens: 6 full blocks + a partial
    peak, saved = 0, 0
    eng.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
        used = eng.core.kv.pool.num_usable_blocks - eng.core.kv.num_free_blocks
        peak = max(peak, used)
        saved = max(saved, eng.core.kv.num_shared_savings())
    out = outs[-1]
    assert len(out.outputs) == 4 and [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    independent = 4 * -(-(100 + 8) // 16)                        # 4 private copies: 28 blocks
    assert peak <= 7 + 3 and peak < independent                   # 6 shared full blocks + 4 private tails
    assert saved == 3 * 7        # right after the fork all 7 prompt blocks have refcount 4 (the partial one until CoW)
    assert eng.core.kv.num_free_blocks == eng.core.kv.pool.num_usable_blocks


def test_beam_search_width1_equals_greedy_and_shares_blocks(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    beam1 = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0]
    assert beam1.outputs[0].token_ids == greedy.outputs[0].token_ids
    long_prompt = {"prompt_token_ids": list(range(3000, 3100))}
    out = llm.beam_search([long_prompt], BeamSearchParams(beam_width=4, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs) == 4
    independent = 4 * -(-(100 + 4) // 16)
    assert llm.beam_peak_blocks < independent                     # beams share the prompt's cached blocks
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.pool.num_usable_blocks


def test_use_beam_search_through_generate(llm):
    out = llm.generate([PROMPT], SamplingParams(n=2, use_beam_search=True, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.outputs[0].token_ids != out.outputs[1].token_ids


def test_seeded_sampling_alone_and_in_a_busy_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(500 + 7 * i, 530 + 7 * i))} for i in range(6)]
    busy = llm.generate(others[:3] + [PROMPT] + others[3:],
                        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3 + [sp] +
                        [SamplingParams(max_tokens=12)] * 3, use_tqdm=False)
    assert busy[3].outputs[0].token_ids == alone


def test_stop_strings_truncate_and_stop_tokens(llm):
    free = llm.generate([PROMPT], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    word = free.text.strip().split()[1] if len(free.text.split()) > 1 else free.text.strip()[:3]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, stop=[word], ignore_eos=True), use_tqdm=False)[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == word and word not in o.text
    assert free.text.startswith(o.text)
    tok = free.token_ids[3]
    o2 = llm.generate([PROMPT], SamplingParams(max_tokens=20, stop_token_ids=[tok], ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert o2.token_ids == free.token_ids[: free.token_ids.index(tok) + 1] and o2.stop_reason == tok


def test_min_tokens_and_logprobs(llm):
    eos = llm.engine.core.eos_token_ids[0]
    o = llm.generate([PROMPT], SamplingParams(max_tokens=10, min_tokens=10, stop_token_ids=[eos], logprobs=3),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 10 and len(o.logprobs) == 10
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert tok in lp and lp[tok].rank == 1            # greedy: the chosen token ranks first
        assert sorted(v.rank for k, v in lp.items() if k != tok) == [2, 3] or len(lp) == 3
    assert abs(o.cumulative_logprob - sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs))) < 1e-4


def test_penalties_change_output(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    pen = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.8,
                                                frequency_penalty=1.5, presence_penalty=1.0),
                       use_tqdm=False)[0].outputs[0]
    assert len(set(pen.token_ids)) >= len(set(base.token_ids)) and pen.token_ids != base.token_ids


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
    ("seed", "x"), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("stop", [""]), ("stop_token_ids", [-1]), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21),
    ("prompt_logprobs", 21), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1}), ("best_of", 0), ("length_penalty", "a"), ("temperature", float("nan")),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_over_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_bad_prompts_and_engine_args(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [10 ** 9]}], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=10 ** 6), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    from pagedserve import EngineArgs
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(block_size=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineArgs(preemption_mode="drop")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineArgs(kv_cache_memory="lots")


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (1.0, 3)])
def test_sampled_tokens_follow_the_distribution(temperature, top_k):
    """The sampler's draws (the exponential race) have the frequencies softmax(logits / T) gives, top-k
    applied: a chi-square test over 40,000 draws from a fixed seed (critical value at p = 1e-6)."""
    from pagedserve.core.step import SamplingRow
    from pagedserve.runner.sampler import Sampler
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    p = torch.softmax(logits / temperature, -1)
    if top_k:
        p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
        p = p / p.sum()
    sp = SamplingParams(temperature=temperature, top_k=top_k or -1)
    rows = [SamplingRow(f"r{i}", sp, None, 1, 1, ()) for i in range(4000)]
    sampler, counts = Sampler(seed=7), torch.zeros(8)
    for _ in range(10):
        counts += torch.bincount(torch.tensor([t.token_id for t in sampler(logits.repeat(4000, 1), rows)]), minlength=8)
    assert counts[p == 0].sum() == 0, "a token top-k removed was drawn"
    expected = p[p > 0] * counts.sum()
    chi2 = ((counts[p > 0] - expected) ** 2 / expected).sum().item()
    assert chi2 < {7: 35.3, 2: 27.6}[int((p > 0).sum()) - 1], (chi2, counts.tolist(), expected.tolist())


def test_ended_sequences_reach_the_runner_through_the_schedule(llm):
    """A seeded request's generator lives in the runner's sampler; the scheduler names every sequence
    that ended (finished, aborted or failed) in the next SchedulerOutput, and the runner drops it."""
    eng = llm.engine
    eng.add_request("seeded", PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True))
    eng.add_request("cut", PROMPT, SamplingParams(temperature=1.0, seed=4, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.core.runner.sampler.held()["sampler.req_generators"] == 3         # two forks and "cut"
    eng.abort("cut")
    assert eng.core.scheduler.finished_ids == ["cut"]
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        seen += eng.core.last_schedule.finished_req_ids
    assert len(seen) == 3 and {"cut", "seeded"} < set(seen)                # "cut", then both samples
    assert not any(eng.held().values()), eng.held()


def test_a_stop_string_in_the_last_token_allowed_is_a_stop(llm):
    """The token that reaches max_tokens also completes a stop string: the output processor's finish
    ("stop", the string, the text cut before it) is what the client sees and what is counted, in
    both output modes; the core ended the sequence by length and is not asked again."""
    free = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    tok = llm.engine.tokenizer
    last = tok.decode(free.token_ids[-1:]).strip()
    before = tok.decode(free.token_ids[:-1])
    assert last and last not in before, (before, last)       # the stop string appears only in the last token
    counts = dict(llm.engine.counters.finished)
    for stream in (False, True):
        eng = llm.engine
        eng.add_request(f"last-{stream}", PROMPT, SamplingParams(max_tokens=12, stop=[last], ignore_eos=True),
                        stream=stream)
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        o = outs[-1].outputs[0]
        text = "".join(x.outputs[0].text for x in outs) if stream else o.text
        assert o.finish_reason == "stop" and o.stop_reason == last, (o.finish_reason, o.stop_reason)
        assert last not in text and free.text.startswith(text)
    assert eng.counters.finished.get("stop", 0) == counts.get("stop", 0) + 2
    assert eng.counters.finished.get("length", 0) == counts.get("length", 0)


def test_text_prompts_are_tokenized_in_one_batch_before_submit(llm, tokenizer, monkeypatch):
    """LLM.generate tokenizes its text prompts in one batch call before any reaches the engine, and the
    engine tokenizes none of them again: the same token ids as one by one, the text kept as the prompt."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    calls = []
    eng_tokenize = llm.engine.tokenize
    monkeypatch.setattr(llm.engine, "tokenize", lambda p: calls.append(isinstance(p, str)) or eng_tokenize(p))
    outs = llm.generate(texts + [{"prompt_token_ids": [1000, 1001]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert calls == [False] * 4, "the engine was handed token ids, never text"
    assert [o.prompt for o in outs] == texts + [None]
    assert [o.prompt_token_ids for o in outs[:3]] == [tokenizer(t)["input_ids"] for t in texts]


def test_plain_argmax_rows_split_off_give_what_the_whole_sampler_gives():
    """The accelerator path (Sampler.split_argmax): greedy rows without logprobs, penalties, bias, pending
    min_tokens or a grammar take their argmax where the logits are; the rest go through the host sampler.
    Every row's token (and logprobs) is what one call over all rows gives; seeded rows draw the same."""
    import numpy as np
    from pagedserve.core.step import SamplingRow
    from pagedserve.runner.sampler import Sampler, takes_plain_argmax
    V = 300
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, V, generator=g) * 3
    P = SamplingParams
    rows = [SamplingRow("plain", P(max_tokens=4), None, 1, 0, (2,)),
            SamplingRow("logprobs", P(max_tokens=4, logprobs=3), None, 1, 0, (2,)),
            SamplingRow("seeded", P(temperature=0.8, top_p=0.9, seed=5, max_tokens=4), 5, 1, 0, (2,)),
            SamplingRow("min-tokens", P(max_tokens=4, min_tokens=3), None, 1, 1, (int(logits[3].argmax()),)),
            SamplingRow("bias", P(max_tokens=4, logit_bias={7: 100.0}), None, 1, 0, (2,)),
            SamplingRow("grammar", P(max_tokens=4), None, 1, 0, (2,)),
            SamplingRow("plain-2", P(max_tokens=4), None, 1, 0, (2,)),
            SamplingRow("past-min", P(max_tokens=4, min_tokens=1), None, 1, 1, (2,))]
    assert [takes_plain_argmax(r) for r in rows] == [True, False, False, False, False, True, True, True]
    allowed = np.zeros((1, -(-V // 32)), dtype=np.int32)
    allowed[0, 0] = 1 << 9                                  # the grammar row may only say token 9
    masks = ([5], allowed)
    whole = Sampler(0)(logits.clone(), rows, masks)
    split = Sampler(0).split_argmax(logits.clone(), rows, masks)
    assert [s.token_id for s in split] == [s.token_id for s in whole]
    assert split[5].token_id == 9 and split[4].token_id == 7 and split[3].token_id != int(logits[3].argmax())
    assert split[0].token_id == int(logits[0].argmax()) and split[0].logprobs is None
    assert split[1].logprobs.keys() == whole[1].logprobs.keys()
    assert all(split[1].logprobs[t].logprob == pytest.approx(whole[1].logprobs[t].logprob) for t in split[1].logprobs)
    every_plain = Sampler(0).split_argmax(logits[[0, 6]], [rows[0], rows[6]])
    assert [s.token_id for s in every_plain] == [int(logits[0].argmax()), int(logits[6].argmax())]
