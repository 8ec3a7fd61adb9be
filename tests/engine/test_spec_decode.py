"""Speculative decoding (n-gram) against decoding without it, on the default model in float32 (the
exact path) and on small random models that transformers writes (a 12-token vocabulary for the
distributions, 512 words for preemption in a small pool): greedy outputs are identical, seeded
sampled outputs are identical (the generator is rewound past unused draws), unseeded sampling
follows the target distribution (chi-square against the distribution computed with HF on the same
weights), and the mechanics (chunked prefill, preemption, n > 1, stop strings, max_tokens,
logprobs, structured outputs) keep working with nothing leaked."""
from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.core.spec_decode import propose_ngram
from pagedserve.sampling_params import StructuredOutputsParams
from tests.conftest import CHAT_PROMPTS

ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, trimmed the wick, wound the "
           "clockwork that turned the great lens, and wrote the weather in a leather logbook.")
GROUNDED = [f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}\n\nThe passage again:",
            f"{PASSAGE}\n\nCopy the first sentence above:",
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(num_kv_blocks=1024, block_size=16, dtype="float32", speculative_config=ALWAYS)


GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
LONG = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)      # every request runs its 32 tokens


def _mixed(chat_prompt_ids) -> list:
    """Six chat prompts (little for a draft to copy) and the grounded ones (drafts taken)."""
    return [{"prompt_token_ids": p} for p in chat_prompt_ids[::2]] + GROUNDED


def _random_prompts() -> list:
    rng = random.Random(7)          # random token prompts: an n-gram of them rarely predicts the model
    return [{"prompt_token_ids": [rng.randrange(200, 40000) for _ in range(rng.randrange(8, 60))]}
            for _ in range(6)]


@pytest.fixture(scope="module")
def reference(llm, chat_prompt_ids):
    """Decoding without drafts (the shared float32 engine), memoized by (prompt, params): a float32 output
    does not depend on what else shares its batch (tests/engine/test_invariance.py; a seeded request draws
    from its own generator), so what several tests compare with is computed once, and what a call does not
    have yet in one batch. The greedy requests of the tests below are computed together up front: a run's
    time is mostly its steps, which they share."""
    done = {}

    def generate(prompts, params):
        params = params if isinstance(params, list) else [params] * len(prompts)
        keys = [(json.dumps(p, sort_keys=True), repr(sp)) for p, sp in zip(prompts, params)]
        new = {k: (p, sp) for k, p, sp in zip(keys, prompts, params) if k not in done}
        if new:
            outs = llm.generate([p for p, _ in new.values()], [sp for _, sp in new.values()], use_tqdm=False)
            done.update(zip(new, outs))
        return [done[k] for k in keys]

    greedy, long = _mixed(chat_prompt_ids), _random_prompts()
    generate(greedy + long, [GREEDY] * len(greedy) + [LONG] * len(long))
    return generate


def _engine(llm):
    return llm.engine


def _assert_idle_and_clean(llm):
    eng = _engine(llm)
    assert not any(eng.held().values()), eng.held()
    assert eng.core.kv.num_free_blocks == eng.core.kv.pool.num_usable_blocks


def _ids(outs):
    return [[o.token_ids for o in r.outputs] for r in outs]


def test_greedy_outputs_are_identical_and_drafts_are_accepted(reference, spec_llm, chat_prompt_ids):
    prompts, sp = _mixed(chat_prompt_ids), GREEDY
    stats = _engine(spec_llm).core.scheduler.spec_stats
    before = stats.num_accepted_tokens
    ref, got = reference(prompts, sp), spec_llm.generate(prompts, sp)
    assert _ids(got) == _ids(ref)
    assert [r.outputs[0].text for r in got] == [r.outputs[0].text for r in ref]
    assert stats.num_accepted_tokens - before > 50          # the grounded prompts copy: drafts are taken
    _assert_idle_and_clean(spec_llm)


def test_the_adaptive_rule_measures_its_costs_behind_a_context_and_gives_the_blocks_back(small_vocab):
    """The start-up cost table is measured behind a written context (or, in a pool too small for one,
    without): either way every block is back in the pool before a request exists, and the rule's
    drafts leave greedy outputs as they are. (The small random model: what is measured is the engine's
    bookkeeping, not the default model's speed; on it this test took 45 s of the suite.)"""
    path, _ = small_vocab
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)
    prompt = [{"prompt_token_ids": PROMPT * 3}]        # repeats: the n-gram lookup drafts
    ref = LLM(path, num_kv_blocks=64, block_size=16, dtype="float32").generate(prompt, sp)
    for blocks in (24, 1024):             # 24 x 16 tokens: no room for a context beside the 256 rows measured
        a = LLM(path, num_kv_blocks=blocks, block_size=16, dtype="float32",
                speculative_config=ALWAYS | {"adaptive": True})
        table = a.engine.core.scheduler.drafting.cost
        assert table.rows[0] == 1 and table.rows[-1] == 256 and all(t > 0 for t in table.seconds)
        _assert_idle_and_clean(a)
        assert _ids(a.generate(prompt, sp)) == _ids(ref)
        _assert_idle_and_clean(a)


def test_greedy_outputs_are_identical_when_most_drafts_are_rejected(reference, spec_llm):
    prompts, sp = _random_prompts(), LONG
    stats = _engine(spec_llm).core.scheduler.spec_stats
    d0, a0 = stats.num_draft_tokens, stats.num_accepted_tokens
    assert _ids(spec_llm.generate(prompts, sp)) == _ids(reference(prompts, sp))
    drafted, accepted = stats.num_draft_tokens - d0, stats.num_accepted_tokens - a0
    assert drafted > 100 and accepted < 0.5 * drafted
    _assert_idle_and_clean(spec_llm)


def test_seeded_sampling_is_identical_to_decoding_without_drafts(reference, spec_llm, chat_prompt_ids):
    """Token i of a seeded request always uses its generator's i-th draw, however many drafts a step
    verified, so its output is the one decoding without speculation gives (penalties and min_tokens
    see the accepted drafts)."""
    prompts = GROUNDED + [{"prompt_token_ids": p} for p in chat_prompt_ids[:3]]
    params = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=100 + i, logprobs=2,
                             repetition_penalty=1.1 if i % 2 else 1.0, presence_penalty=0.3 if i % 3 == 0 else 0.0,
                             min_tokens=20) for i in range(len(prompts))]
    ref, got = reference(prompts, params), spec_llm.generate(prompts, params)
    assert _ids(got) == _ids(ref)
    for r, g in zip(ref, got):         # the logprobs returned are the target model's, the same numbers
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lr.keys() == lg.keys()
            assert all(abs(lr[t].logprob - lg[t].logprob) < 1e-4 and lr[t].rank == lg[t].rank for t in lr)
    _assert_idle_and_clean(spec_llm)


def _stop_inside_the_copy(reference) -> str:
    """Six characters from the middle of GROUNDED[0]'s greedy answer: inside the copied passage, where
    drafts are accepted in runs."""
    ref_text = reference([GROUNDED[0]], GREEDY)[0].outputs[0].text
    return ref_text[len(ref_text) // 2: len(ref_text) // 2 + 6]


def test_stop_strings_max_tokens_n_and_prompt_logprobs_as_without_drafts(reference, spec_llm):
    stop = _stop_inside_the_copy(reference)
    cases = [SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]),
             SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
             SamplingParams(max_tokens=7, temperature=0.0),
             SamplingParams(max_tokens=30, temperature=0.9, n=3, seed=5),
             SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1, logprobs=1)]
    # every case on both prompts in one batch (one generate each: the cases meet in the same steps)
    refs = reference(GROUNDED[:2] * len(cases), [sp for sp in cases for _ in range(2)])
    gots = spec_llm.generate(GROUNDED[:2] * len(cases), [sp for sp in cases for _ in range(2)])
    for k, sp in enumerate(cases):
        ref, got = refs[2 * k: 2 * k + 2], gots[2 * k: 2 * k + 2]
        assert _ids(got) == _ids(ref), sp
        assert [[(o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in got] == \
               [[(o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in ref], sp
        if sp.prompt_logprobs:
            for r, g in zip(ref, got):
                assert [None if d is None else sorted(d) for d in g.prompt_logprobs] == \
                       [None if d is None else sorted(d) for d in r.prompt_logprobs]
    assert len(gots[-2].outputs[0].token_ids) == 12
    _assert_idle_and_clean(spec_llm)


def test_structured_outputs_do_not_draft_and_stay_valid(spec_llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    sp = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    out = spec_llm.generate(["Describe a person named Ann, aged 31, as JSON."], sp)[0].outputs[0]
    assert set(json.loads(out.text)) == {"name", "age"}
    _assert_idle_and_clean(spec_llm)


# What preemption and chunked prefill do with drafts is the engine's bookkeeping, not the default model's outputs:
# the two small-pool tests run a random Llama of 512 words (on the default model they took ~25 s each)
PRESSED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pressed(sharp_llama):
    """conftest's sharp random Llama of 512 words, seven prompts of 33-61 of its tokens, and their greedy
    outputs without drafts in a pool that holds them all."""
    d = sharp_llama
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in (33, 40, 47, 52, 58, 61, 45)]
    roomy = LLM(d, num_kv_blocks=256, block_size=8, dtype="float32")
    return d, prompts, _ids(roomy.generate(prompts, PRESSED))


def _small_pool(path: str, mode: str, spec: dict) -> LLM:
    """24 blocks of 8 for the ~500 tokens `pressed`'s requests hold: they are preempted (4-7 times an engine);
    prompts chunked at 32 tokens."""
    return LLM(path, num_kv_blocks=24, block_size=8, dtype="float32", max_num_batched_tokens=64,
               long_prefill_token_threshold=32, preemption_mode=mode, speculative_config=spec)


def test_chunked_prefill_and_preemption_with_drafts(pressed):
    """A pool far smaller than the work (recompute and swap), prompts chunked at 32 tokens: the same
    tokens as decoding without drafts in a pool that holds them all (preemption alone is exact:
    test_invariance), and every block back at the end."""
    path, prompts, ref = pressed
    for mode in ("recompute", "swap"):
        small = _small_pool(path, mode, ALWAYS)
        assert _ids(small.generate(prompts, PRESSED)) == ref, mode
        eng = _engine(small)
        assert eng.core.counters.preemptions > 0 and eng.core.scheduler.spec_stats.num_accepted_tokens > 0
        _assert_idle_and_clean(small)


def test_served_drafts_show_on_metrics_and_debug_state(spec_llm):
    """A streamed completion through the server: the deltas carry several tokens when drafts are
    accepted; /metrics has vLLM's spec_decode counters; /debug/state the totals and each step's drafts."""
    import httpx
    from pagedserve.entrypoints.server import build_app
    from tests.entrypoints.helpers import serve_in_thread
    eng = _engine(spec_llm)
    ref = spec_llm.generate([GROUNDED[0]], SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0].text
    with serve_in_thread(build_app(eng)) as base:
        text = ""
        with httpx.stream("POST", base + "/v1/completions", timeout=120,
                          json={"prompt": GROUNDED[0], "max_tokens": 40, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == ref
        metrics = httpx.get(base + "/metrics").text
        vals = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("pagedserve:spec")}
        drafted, accepted = (vals[f"pagedserve:spec_decode_num_{k}_tokens_total"] for k in ("draft", "accepted"))
        assert drafted >= accepted > 0
        assert vals['pagedserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
        state = httpx.get(base + "/debug/state").json()
        sp = state["health"]["spec_decode"]
        assert sp["method"] == "ngram" and sp["num_accepted_tokens"] == eng.core.scheduler.spec_stats.num_accepted_tokens
        assert any(x["draft"] for x in state["steps"])
    _assert_idle_and_clean(spec_llm)


# ---------------------------------------------------------------- the target distribution
VOCAB = 12
PROMPT = [5, 0, 3, 9, 1, 7, 11, 2, 8, 4, 10, 6, 5, 0, 3]   # every token occurred: n-gram lookup always drafts


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tokenizer):
    """A random Llama of 12 tokens with soft next-token distributions (drafts accepted about as often
    as not), and the exact distribution of its first three sampled tokens, from HF on the same weights."""
    from tests.model.families import save_family
    d = tmp_path_factory.mktemp("small_vocab")
    hf = save_family("llama", d, VOCAB, tokenizer, sharpen=4.0, tie_word_embeddings=True)
    with torch.inference_mode():
        seqs = [list(s) for s in itertools.product(range(VOCAB), repeat=2)]
        p1 = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
        p2 = torch.softmax(hf(torch.tensor([PROMPT + [t] for t in range(VOCAB)])).logits[:, -1].float(), -1)
        p3 = torch.softmax(hf(torch.tensor([PROMPT + s for s in seqs])).logits[:, -1].float(), -1)
    joint2 = p1[:, None] * p2                                          # P(t1, t2)
    joint3 = joint2.reshape(-1, 1) * p3                                # P(t1, t2, t3), (t1, t2) row-major
    return str(d), {1: p1, 2: joint2.sum(0), 3: joint3.sum(0), 12: joint2.reshape(-1)}


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells expected below 5 are merged into one."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp > 0
    x2 = (((obs - exp) ** 2) / exp)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), x2 / 2))


def _sample(path: str, spec, n: int, temperature: float = 1.0, seed: int = 0):
    llm = LLM(path, dtype="float32", num_kv_blocks=2048, block_size=16, max_num_seqs=64, seed=seed,
              speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n,
                        SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True, detokenize=False))
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])
    stats = _engine(llm).core.scheduler.spec_stats
    _assert_idle_and_clean(llm)
    return toks, stats


def _fit(toks: torch.Tensor, dist: dict) -> dict[str, float]:
    c = lambda x, m: torch.bincount(x, minlength=m)        # noqa: E731
    return {"t1": _chi2_p(c(toks[:, 0], VOCAB), dist[1]), "t2": _chi2_p(c(toks[:, 1], VOCAB), dist[2]),
            "t3": _chi2_p(c(toks[:, 2], VOCAB), dist[3]),
            "t1t2": _chi2_p(c(toks[:, 0] * VOCAB + toks[:, 1], VOCAB * VOCAB), dist[12])}


def test_sampled_tokens_follow_the_target_distribution(small_vocab):
    """Rejection sampling as the runner does it (accept draft d when the target's sample is d, which
    for a one-token draft is min(1, p/q) acceptance with the residual max(p - q, 0)): the first three
    sampled tokens' marginals and the first two's joint fit the exact distribution; samples drawn at
    another temperature, and a verifier that takes every draft, are told apart by the same test."""
    path, dist = small_vocab
    toks, stats = _sample(path, ALWAYS | {"num_speculative_tokens": 2}, 3000)
    assert stats.num_draft_tokens > 5000 and stats.num_accepted_tokens > 300 and stats.accepted_per_pos[1] > 0
    fit = _fit(toks, dist)
    assert min(fit.values()) > 1e-3, fit
    hot, _ = _sample(path, None, 3000, temperature=1.2)               # the test has the power to reject
    assert min(_fit(hot, dist).values()) < 1e-3
    taken = torch.tensor([[t] + (propose_ngram(PROMPT + [t], 1, 3, 2) + [t, t])[:2] for t in toks[:, 0].tolist()])
    assert min(_fit(taken, dist).values()) < 1e-3                      # what accepting every draft would give


# ---------------------------------------------------------------- method draft_model
# The target's own GGUF file as its draft, kept packed (Q4_1 weights, int8-rounded activations): a cheap
# draft that agrees with the float32 target almost always. A random model with the target's tokenizer
# and vocabulary: a draft that is almost always wrong. Neither may change a token of the output.

def _draft_config(path, **kw):
    return {"model": path, "num_speculative_tokens": 4, "adaptive": False} | kw


@pytest.fixture(scope="module")
def packed_draft(default_source):
    return LLM(num_kv_blocks=1024, block_size=16, dtype="float32",
               speculative_config=_draft_config(default_source.path, quantization="gguf"))


@pytest.fixture(scope="module")
def random_draft_path(tmp_path_factory, tokenizer):
    from tests.model.families import save_family
    d = tmp_path_factory.mktemp("random_draft")
    save_family("llama", d, tokenizer.vocab_size, tokenizer, num_hidden_layers=1, hidden_size=32,
                intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return str(d)


def test_draft_model_greedy_outputs_are_identical(reference, packed_draft, random_draft_path, chat_prompt_ids):
    prompts, sp = _mixed(chat_prompt_ids), GREEDY
    ref = _ids(reference(prompts, sp))
    stats = _engine(packed_draft).core.scheduler.spec_stats
    d0, a0 = stats.num_draft_tokens, stats.num_accepted_tokens
    assert _ids(packed_draft.generate(prompts, sp)) == ref
    drafted, accepted = stats.num_draft_tokens - d0, stats.num_accepted_tokens - a0
    assert drafted > 200 and accepted > 0.8 * drafted           # the packed copy agrees: drafts are taken
    _assert_idle_and_clean(packed_draft)
    rand = LLM(num_kv_blocks=256, block_size=16, dtype="float32", speculative_config=_draft_config(random_draft_path))
    assert _ids(rand.generate(prompts[:4], sp)) == ref[:4]
    stats = _engine(rand).core.scheduler.spec_stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens < 0.2 * stats.num_draft_tokens
    _assert_idle_and_clean(rand)


def test_draft_model_seeded_sampling_stop_strings_n_and_prompt_logprobs(reference, packed_draft, chat_prompt_ids):
    prompts = GROUNDED + [{"prompt_token_ids": p} for p in chat_prompt_ids[:2]]
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=7 + i, logprobs=1,
                             repetition_penalty=1.1 if i % 2 else 1.0) for i in range(len(prompts))]
    ref, got = reference(prompts, params), packed_draft.generate(prompts, params)
    assert _ids(got) == _ids(ref)
    for r, g in zip(ref, got):
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lr.keys() == lg.keys() and all(abs(lr[t].logprob - lg[t].logprob) < 1e-4 for t in lr)
    stop = _stop_inside_the_copy(reference)
    cases = (SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]), SamplingParams(max_tokens=7, temperature=0.0),
             SamplingParams(max_tokens=20, temperature=0.9, n=3, seed=5),
             SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=1))
    refs = reference(GROUNDED[:2] * len(cases), [sp for sp in cases for _ in range(2)])     # one batch each
    gots = packed_draft.generate(GROUNDED[:2] * len(cases), [sp for sp in cases for _ in range(2)])
    for k, sp in enumerate(cases):
        ref, got = refs[2 * k: 2 * k + 2], gots[2 * k: 2 * k + 2]
        assert _ids(got) == _ids(ref), sp
        assert [[(o.text, o.finish_reason) for o in r.outputs] for r in got] == \
               [[(o.text, o.finish_reason) for o in r.outputs] for r in ref], sp
    _assert_idle_and_clean(packed_draft)


def test_draft_model_through_chunked_prefill_and_preemption(pressed):
    """A pool far smaller than the work: sequences are preempted (recompute and swap) and their draft
    reads its context again; prompts chunked at 32 tokens. The same tokens as without drafts (in a pool
    that holds them all), drafts still accepted, every block back. (The target is its own draft: each
    greedy proposal is taken unless the draft read a wrong context.)"""
    path, prompts, ref = pressed
    for mode in ("recompute", "swap"):
        small = _small_pool(path, mode, _draft_config(path))
        assert _ids(small.generate(prompts, PRESSED)) == ref, mode
        eng = _engine(small)
        assert eng.core.counters.preemptions > 0
        st = eng.core.scheduler.spec_stats
        assert st.num_accepted_tokens > 0.7 * st.num_draft_tokens > 0
        _assert_idle_and_clean(small)


def test_a_draft_model_that_cannot_draft_for_the_target_is_refused_naming_it(tmp_path, tokenizer, small_vocab,
                                                                             random_draft_path):
    import shutil
    from tests.model.families import save_family
    cases = [(small_vocab[0], "vocabulary has 12 tokens"), (str(tmp_path / "nowhere"), "")]
    # the target's vocabulary size, two tokens' ids swapped: another tokenizer
    other = tmp_path / "other_tokenizer"
    shutil.copytree(random_draft_path, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    cases.append((str(other), "tokenizer differs"))
    for path, what in cases:
        with pytest.raises(ValueError, match=r"speculative_config\.model.*" + what):
            LLM(num_kv_blocks=64, dtype="float32", speculative_config={"model": path})
    windowed = tmp_path / "mistral"                  # a target whose layers keep a window: one table is needed
    save_family("mistral", windowed, tokenizer.vocab_size, tokenizer)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*windows"):
        LLM(str(windowed), num_kv_blocks=64, dtype="float32", speculative_config={"model": random_draft_path})
    llm = LLM(str(windowed), num_kv_blocks=64, dtype="float32", disable_hybrid_kv_cache_manager=True,
              speculative_config=_draft_config(random_draft_path))
    assert len(llm.generate(["Hi"], SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids) == 5


def test_draft_model_samples_follow_the_target_distribution(small_vocab, tokenizer, tmp_path):
    """A random draft of the same 12 tokens (another distribution than the target's) samples its proposals
    from its own q; verified by rejection sampling (accept min(1, p/q), else the residual max(p - q, 0)),
    the sampled tokens fit the target's exact distribution (accepting every draft would give q's)."""
    from tests.model.families import save_family
    path, dist = small_vocab
    save_family("llama", tmp_path, VOCAB, tokenizer, sharpen=2.0, num_hidden_layers=1, tie_word_embeddings=True)
    toks, stats = _sample(path, _draft_config(str(tmp_path), num_speculative_tokens=2), 3000)
    assert stats.num_draft_tokens > 5000 and stats.num_accepted_tokens > 300 and stats.accepted_per_pos[1] > 0
    fit = _fit(toks, dist)
    assert min(fit.values()) > 1e-3, fit


def test_a_draft_that_matches_the_target_in_distribution_is_nearly_always_accepted(small_vocab):
    """The target as its own draft, temperature 1: a sampled proposal from q = p is accepted with
    probability min(1, p/q) = 1, where a greedy proposal would be accepted only as often as the target
    samples its argmax; the samples still fit the exact distribution. Seeded requests keep greedy
    proposals (their output must not depend on the drafting), so they accept far less."""
    path, dist = small_vocab
    toks, stats = _sample(path, _draft_config(path, num_speculative_tokens=2), 1500)
    assert stats.num_draft_tokens > 2500 and stats.num_accepted_tokens > 0.97 * stats.num_draft_tokens, stats
    assert dist[1].max() < 0.8                 # a greedy proposal's acceptance at the first token
    assert min(_fit(toks, dist).values()) > 1e-3
    llm = LLM(path, dtype="float32", num_kv_blocks=2048, block_size=16, max_num_seqs=64,
              speculative_config=_draft_config(path, num_speculative_tokens=2))
    llm.generate([{"prompt_token_ids": PROMPT}] * 300, [SamplingParams(max_tokens=4, temperature=1.0, seed=i,
                 ignore_eos=True, detokenize=False) for i in range(300)])
    seeded = _engine(llm).core.scheduler.spec_stats
    assert seeded.num_accepted_tokens < 0.9 * seeded.num_draft_tokens
    _assert_idle_and_clean(llm)
