"""The engine core in its own process (engine/core_proc.py), through the protocol: the same greedy tokens and
logprobs as the core in process on the reference prompts, the named queries answered, an abort (before the
frontend has seen a request's forks, too) leaves no block or entry behind, a request the core refuses fails
alone, and a core killed with SIGKILL mid-generation is engine death, reported at once."""
import os
import signal
import time

import pytest

from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError, ParamError
from pagedserve.sampling_params import SamplingParams

ARGS = dict(num_kv_blocks=1024, block_size=16, dtype="float32")


@pytest.fixture(scope="module")
def proc_engine():
    eng = LLMEngine(EngineArgs(engine_process=True, **ARGS))
    yield eng
    eng.shutdown()


def _run(eng: LLMEngine, limit_s: float = 120) -> dict:
    done, t0 = {}, time.monotonic()
    while eng.has_unfinished_requests():
        assert time.monotonic() - t0 < limit_s, "the core stopped answering"
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _idle(eng: LLMEngine) -> dict:
    """The core's per-request entries once its last step ran (it steps once more to drop ended sequences)."""
    t0 = time.monotonic()
    while True:
        held = eng.held()
        if not any(held.values()) or time.monotonic() - t0 > 30:
            return held
        eng.step()


def test_greedy_tokens_and_logprobs_through_the_seam_equal_in_process(proc_engine, llm, chat_prompt_ids):
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, stop=["\n\n"])
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompt_ids[:6]]
    ref = llm.generate(prompts, sp, use_tqdm=False)
    for i, p in enumerate(prompts):
        proc_engine.add_request(f"g{i}", p, sp)
    got = _run(proc_engine)
    for i, r in enumerate(ref):
        a, b = r.outputs[0], got[f"g{i}"].outputs[0]
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason, i
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    stats = proc_engine.stats()
    assert stats.counters.steps > 0 and stats.counters.generation_tokens >= 6
    assert proc_engine.last_step().step_s > 0


def test_queries_cross_as_values(proc_engine):
    info = proc_engine.info
    assert info.generates and info.block_size == 16 and info.num_kv_blocks == 1023   # (block 0: the null block)
    assert proc_engine.scheduler_view()["limits"]["max_num_seqs"] == info.max_num_seqs
    assert len(proc_engine.cache_view()["blocks"]["state"]) == info.num_kv_blocks + 1
    with pytest.raises(ParamError) as e:
        proc_engine.check_fits(info.max_model_len, 10)
    assert e.value.param
    with pytest.raises(ParamError):
        proc_engine.load_lora("x", "/nowhere")
    assert proc_engine.lora_names() == frozenset()


def test_abort_leaves_nothing_behind_forks_included(proc_engine):
    eng = proc_engine
    long = SamplingParams(max_tokens=2000, ignore_eos=True)
    eng.add_request("a", [1, 2, 3, 4, 5], long, stream=True)
    eng.add_request("f", [1, 2, 3], SamplingParams(n=3, max_tokens=400, temperature=1.0, seed=1, ignore_eos=True),
                    stream=True)
    t0 = time.monotonic()
    while not eng.step() and time.monotonic() - t0 < 60:    # until the first deltas come
        pass
    eng.add_request("late", [7, 8, 9], long)         # its fork-free state, aborted before any step reports it
    for rid in ("a", "f", "late"):
        assert eng.abort(rid).finished
    held = _idle(eng)
    assert not any(held.values()), held
    s = eng.stats()
    assert s.num_running == 0 and s.num_used_blocks == 0 and s.counters.finished.get("abort", 0) >= 3


def test_a_request_the_core_refuses_fails_alone(proc_engine):
    eng = proc_engine
    with pytest.raises(ParamError):
        eng.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=10 ** 6))
    assert "bad" not in eng.states
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(_run(eng)["ok"].outputs[0].token_ids) == 3


def test_sigkill_of_the_core_is_engine_death():
    eng = LLMEngine(EngineArgs(engine_process=True, **ARGS))
    try:
        eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True), stream=True)
        t0 = time.monotonic()
        while not eng.step() and time.monotonic() - t0 < 60:
            pass
        os.kill(eng.client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine core process exited"):
            while time.monotonic() - t0 < 60:
                eng.step()
        with pytest.raises(EngineDeadError):
            eng.check_alive()
        with pytest.raises(EngineDeadError):
            eng.add_request("s", [1, 2], SamplingParams(max_tokens=2))
    finally:
        eng.shutdown()


def test_an_embedding_the_core_sends_after_its_abort_is_dropped(proc_engine):
    """The core steps by itself: an embedding request the frontend aborts after the core ran its step, before
    the frontend took that step, has its vector arrive for a request this side has ended. It is dropped (its
    tokens would be): the frontend's step goes on, nothing is held. (Before: KeyError in step_states, and the
    server's engine thread died.)"""
    from pagedserve.sampling_params import PoolingParams
    eng = proc_engine
    eng.add_request("e", [5, 6, 7, 8], PoolingParams())
    t0 = time.monotonic()
    while eng.client._steps.empty():                 # the core's step with the vector has arrived, untaken
        assert time.monotonic() - t0 < 60, "the core did not step"
        time.sleep(0.01)
    assert eng.abort("e").finished
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(_run(eng)["ok"].outputs[0].token_ids) == 2
    assert not any(_idle(eng).values())


def test_readers_polling_as_fast_as_answered_do_not_stop_the_steps(proc_engine):
    """Three readers each queue their next call as soon as the last is answered (the soak's observers,
    the dashboard), each a round trip to the core's process: the engine thread runs the calls queued when a
    pass begins and then steps, so a stream still ends. (Before: it drained the inbox until empty, which
    three such readers never let it be, and the stream waited for ever.)"""
    import asyncio

    from pagedserve.engine.async_engine import AsyncLLMEngine

    async def main():
        aeng = AsyncLLMEngine(proc_engine)
        stop = asyncio.Event()

        async def reader():
            n = 0
            while not stop.is_set():
                await aeng.call(proc_engine.cache_view)
                n += 1
            return n
        # a long request keeps the core stepping, so each call waits for a step's end to be answered
        bg = await aeng.add_request("bg", [4, 5, 6], SamplingParams(max_tokens=4000, ignore_eos=True))
        readers = [asyncio.create_task(reader()) for _ in range(3)]
        await asyncio.sleep(0.2)
        stream = await aeng.add_request("p", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
        toks = [t async for o in stream for t in o.outputs[0].token_ids]
        stop.set()
        bg.abort()
        counts = await asyncio.gather(*readers)
        aeng._stop = True                        # (the module's engine lives on: stop the thread, not the core)
        aeng._wake.set()
        aeng._thread.join(5)
        return toks, counts
    toks, counts = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(toks) == 20 and min(counts) > 0


FRONTEND_ONLY = """
import sys
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve import SamplingParams
import pagedserve.entrypoints.server                     # the HTTP side too
if __name__ == "__main__":
    eng = LLMEngine(EngineArgs(engine_process=True, num_kv_blocks=64))
    eng.add_request("a", "Hello", SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1))
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    eng.shutdown()
    print(len(done[0].outputs[0].token_ids), "torch" in sys.modules)
"""


def test_the_frontend_of_a_core_in_its_own_process_never_imports_torch(tmp_path):
    """Tokenizer, outputs, logprobs and the server's modules: the frontend's process needs no torch (its idle
    RSS ~100 MB instead of ~290, its imports 1.2 s instead of 3.3 on an AVX2 host); only the core's does."""
    import subprocess
    import sys
    script = tmp_path / "front.py"
    script.write_text(FRONTEND_ONLY)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["3", "False"], r.stdout
