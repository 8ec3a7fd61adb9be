"""Streams carry deltas: each step hands out only what is new, so a 1,000-token generation moves
1,000 tokens' worth of ids and text in total (a snapshot per step would move ~500,000)."""
import pytest

from pagedserve import LLM, LLMEngine, SamplingParams
from tests.model.helpers import save_random_llama


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, tokenizer):
    """A small random Llama with the default model's tokenizer: thousands of steps in seconds."""
    d = save_random_llama(tmp_path_factory.mktemp("tiny-with-tokenizer"), tokenizer)
    return LLMEngine(model=d, num_kv_blocks=300, max_model_len=4200)


# Every step's output is checked, so a stream that handed out snapshots, merged two tokens or re-sent
# held-back text fails at any length; 1,000 random tokens put thousands of characters, partial UTF-8
# sequences among them, through the incremental detokenizer, and cost ~3 ms a step here (the LM head and
# the sampler over the 49,152-token vocabulary), twice over: longer would add time, not checks.
STREAM_TOKENS = 1000


def test_a_long_stream_moves_each_token_once(tiny_engine):
    eng = tiny_engine
    sp = SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=1.0, seed=1, logprobs=1,
                        stop=["\u0000\u0001"])
    eng.add_request("s", [1, 2, 3], sp, stream=True)
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(outs) == STREAM_TOKENS and len(tokens) == STREAM_TOKENS
    assert max(len(o.outputs[0].token_ids) for o in outs) == 1
    assert sum(len(o.outputs[0].logprobs) for o in outs) == STREAM_TOKENS
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


def test_a_lagging_stream_gets_its_deltas_merged(tiny_engine):
    """AsyncLLMEngine hands a step's outputs to the event loop once; a stream whose reader has not
    taken its last delta gets the next merged into it: a reader that lags receives fewer chunks whose
    tokens, logprobs and text add up to exactly what a prompt reader (and a non-streaming request) gets."""
    import asyncio

    from pagedserve.engine.async_engine import AsyncLLMEngine
    sp = SamplingParams(n=2, max_tokens=300, ignore_eos=True, temperature=1.0, seed=5, logprobs=1)

    async def run():
        aeng = AsyncLLMEngine(tiny_engine)
        try:
            prompt_reader = [o async for o in await aeng.add_request("quick", [1, 2, 3], sp)]
            slow = await aeng.add_request("slow", [1, 2, 3], sp)
            lagged = []
            async for o in slow:
                lagged.append(o)
                await asyncio.sleep(0.2)           # a client far slower than the engine's steps (also on a busy host)
            whole = [o async for o in await aeng.add_request("whole", [1, 2, 3], sp, stream=False)]
        finally:
            aeng.shutdown()
        return prompt_reader, lagged, whole
    quick, lagged, whole = asyncio.run(run())
    assert len(whole) == 1 and len(lagged) < len(quick) / 3         # merged: far fewer chunks
    for i in range(2):
        def joined(outs, f):
            return [x for o in outs for c in o.outputs if c.index == i for x in getattr(c, f)]
        want = next(c for c in whole[0].outputs if c.index == i)
        for outs in (quick, lagged):
            assert joined(outs, "token_ids") == want.token_ids and len(joined(outs, "logprobs")) == 300
            assert "".join(c.text for o in outs for c in o.outputs if c.index == i) == want.text
        assert [c.finish_reason for c in lagged[-1].outputs] == ["length", "length"]


def test_the_core_hands_its_frontend_token_ids_as_values(tiny_engine, monkeypatch):
    """EngineCore.step returns values only (SeqToken: ids, logprobs, finish, timings; never the core's
    Request objects), and the frontend's outputs are made from them alone: each sequence's token ids are
    the ones its SeqTokens carried, in order, n = 2 forks and a seeded sampler included."""
    import dataclasses

    from pagedserve.core.request import Request
    from pagedserve.engine.outputs import EngineCoreOutputs, SeqTimes, SeqToken
    from pagedserve.runner.sampler import Logprob
    eng = tiny_engine
    step, seen = eng.core.step, []
    monkeypatch.setattr(eng.core, "step", lambda: seen.append(step()) or seen[-1])
    eng.add_request("seam", {"prompt_token_ids": list(range(300, 340))},
                    SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=1, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()

    def values(x):                  # every leaf a plain value: no core object can cross the seam
        if isinstance(x, (EngineCoreOutputs, SeqToken, SeqTimes, Logprob)):
            return all(values(getattr(x, f.name)) for f in dataclasses.fields(x))
        if isinstance(x, dict):
            return all(values(k) and values(v) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return all(values(v) for v in x)
        return not isinstance(x, Request) and isinstance(x, (str, int, float, type(None)))
    assert seen and all(values(co) for co in seen)
    carried = {}
    for co in seen:
        for t in co.tokens:
            assert t.owner_id == "seam"
            carried.setdefault(t.seq_index, []).append(t.token_id)
    final = outs[-1]
    assert final.finished and [o.token_ids for o in final.outputs] == [carried[0], carried[1]]
    assert all(len(ids) == 12 for ids in carried.values()) and carried[0] != carried[1]
    assert all(v == 0 for v in eng.held().values())


def test_the_async_frontend_keeps_its_streams_in_the_engines_one_registry(tiny_engine):
    """A request's RequestStream lives in its RequestState (`sink`): AsyncLLMEngine keeps no dict of its
    own keyed by request; the deadline heap is an index into engine.states. Finished, aborted and
    timed-out requests leave nothing in either."""
    import asyncio

    from pagedserve.engine.async_engine import AsyncLLMEngine
    sp = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=1.0, seed=2)

    async def run():
        aeng = AsyncLLMEngine(tiny_engine, request_timeout_s=3600)
        try:
            a = await aeng.add_request("a", [1, 2, 3], sp)
            b = await aeng.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
            seen = await aeng.call(lambda: {rid: st.sink for rid, st in tiny_engine.states.items()})
            per_request = [k for k, v in vars(aeng).items() if isinstance(v, (dict, set)) and v]
            first = await a.__anext__()
            a.abort()
            rest = [o async for o in a]
            done = [o async for o in b]
            for _ in range(200):        # ended ids reach the runner with the engine's next step: read after it
                held = await aeng.call(aeng.held)
                if not held["scheduler.finished_ids"]:
                    break
                await asyncio.sleep(0.01)
            return seen, per_request, first, rest, done, held, len(aeng._deadlines)
        finally:
            aeng.shutdown()
    seen, per_request, first, rest, done, held, deadlines = asyncio.run(run())
    assert set(seen) == {"a", "b"} and all(s is not None and s.request_id == rid for rid, s in seen.items())
    assert per_request == []
    assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert done[-1].finished and done[-1].outputs[0].finish_reason == "length"
    assert "async.streams" not in held and not any(v for k, v in held.items() if k != "async.deadlines"), held
    assert deadlines <= 2
