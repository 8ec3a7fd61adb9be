"""Streams carry deltas: each step hands out only what is new, so a 4,000-token generation moves
4,000 tokens' worth of ids and text in total (a snapshot per step would move ~8 million)."""
import pytest

from pagedserve import LLM, LLMEngine, SamplingParams
from tests.model.helpers import save_random_llama


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, tokenizer):
    """A small random Llama with the default model's tokenizer: thousands of steps in seconds."""
    d = save_random_llama(tmp_path_factory.mktemp("tiny-with-tokenizer"), tokenizer)
    return LLMEngine(model=d, num_kv_blocks=300, max_model_len=4200)


def test_4000_token_stream_moves_each_token_once(tiny_engine):
    eng = tiny_engine
    sp = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=1.0, seed=1, logprobs=1, stop=["\u0000\u0001"])
    eng.add_request("s", [1, 2, 3], sp, stream=True)
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(outs) == 4000 and len(tokens) == 4000
    assert max(len(o.outputs[0].token_ids) for o in outs) == 1
    assert sum(len(o.outputs[0].logprobs) for o in outs) == 4000
    # the deltas add up to exactly what a non-streaming request of the same seed gets
    eng.add_request("full", [1, 2, 3], sp, stream=False)
    final = []
    while eng.has_unfinished_requests():
        final.extend(eng.step())
    assert len(final) == 1 and final[0].outputs[0].token_ids == tokens
    assert "".join(o.outputs[0].text for o in outs) == final[0].outputs[0].text
    held = max(len(o.outputs[0].text) for o in outs)
    assert held < 200                          # a delta is a token's text plus at most the held-back tail


def test_stream_deltas_with_n2_and_stop_strings(llm):
    eng = llm.engine
    sp = SamplingParams(n=2, max_tokens=40, temperature=0.9, seed=7, stop=["\n\n", "The end"])
    eng.add_request("s", "Once upon a time", sp, stream=True)
    pieces = {0: [], 1: []}
    toks = {0: [], 1: []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            for c in o.outputs:
                pieces[c.index].append(c.text)
                toks[c.index].extend(c.token_ids)
    full = LLM.__new__(LLM)
    full.engine = eng
    ref = full.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    for c in ref.outputs:
        assert "".join(pieces[c.index]) == c.text and toks[c.index] == c.token_ids
