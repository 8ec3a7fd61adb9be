"""Greedy output is the same however the engine batches, chunks, pages, caches or preempts.
In float32 (asked for explicitly: --dtype auto is bfloat16 on CPUs with native bf16, and bf16 GEMMs
round differently with the batch's row count, so there only check_logprobs_close holds)."""
import random

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def workload(chat_prompt_ids):
    rng = random.Random(0)
    # a prompt's rows are most of a run's time: four chat prompts (32-66 tokens), and random ones across the chunk
    # limits the configs set (16, 64, the default 256) and many blocks, one over 256, not several
    prompts = [list(p) for p in chat_prompt_ids[:8:2]]
    prompts += [[rng.randrange(17, 49152) for _ in range(n)] for n in (5, 130, 270)]
    # two requests share a long prefix, so prefix caching has something to hit
    prompts.append(prompts[-1][:100] + [rng.randrange(17, 49152) for _ in range(20)])
    # requests end at different steps, so batches shrink; the one-at-a-time reference runs sum(max_tokens) steps
    max_tokens = [rng.randint(4, 12) for _ in prompts]
    return prompts, max_tokens


def run(workload, one_at_a_time=False, **engine_args):
    prompts, max_tokens = workload
    llm = LLM(**{"dtype": "float32", **engine_args})
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    if one_at_a_time:
        outs = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eng = llm.engine
    # no leaks: every block is free again (blocks kept by the prefix cache are free and reclaimable)
    assert eng.core.kv.num_free_blocks == eng.core.kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in eng.core.kv.pool.blocks[1:])
    assert not eng.core.kv.req_blocks and not eng.core.kv.swapped and len(eng.core.kv.host_free) == eng.core.kv.num_host_blocks
    assert not eng.core.scheduler.running and not eng.core.scheduler.waiting and not eng.states
    return [o.outputs[0].token_ids for o in outs], eng


@pytest.fixture(scope="module")
def reference(workload):
    return run(workload, one_at_a_time=True, num_kv_blocks=512)[0]


CONFIGS = {
    "all_at_once": dict(num_kv_blocks=512),
    "chunk16": dict(num_kv_blocks=512, long_prefill_token_threshold=16),
    "chunk64": dict(num_kv_blocks=512, long_prefill_token_threshold=64),
    "chunk512": dict(num_kv_blocks=512, long_prefill_token_threshold=512, max_num_batched_tokens=2048),
    "block8": dict(num_kv_blocks=1024, block_size=8),
    "block32": dict(num_kv_blocks=256, block_size=32),
    "no_prefix_caching": dict(num_kv_blocks=512, enable_prefix_caching=False),
    "no_chunked_prefill": dict(num_kv_blocks=512, enable_chunked_prefill=False, max_num_batched_tokens=512),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_tokens(workload, reference, name):
    got, _ = run(workload, **CONFIGS[name])
    assert got == reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_same_tokens_under_preemption(workload, reference, mode):
    # 20 blocks of 16 (the longest request needs 18) for the workload's ~770 tokens: a request is preempted
    got, eng = run(workload, num_kv_blocks=20, block_size=16, preemption_mode=mode, swap_space=0.1)
    assert eng.core.counters.preemptions > 0
    assert got == reference


def test_prefix_cache_hits_are_counted(workload):
    prompts, _ = workload
    llm = LLM(num_kv_blocks=512)
    p = {"prompt_token_ids": max(prompts, key=len)}
    llm.generate([p], SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate([p], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(p["prompt_token_ids"]) - 1) // 16 * 16
    assert llm.engine.core.counters.prefix_hits >= out.num_cached_tokens
