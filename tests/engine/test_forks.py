"""n > 1 under KV pressure: the forked samples of one request wait, preempt and resume like any
other sequence (regression: siblings once tied in the waiting heap and crashed the step)."""
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.errors import ParamError


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("n", [2, 3])
def test_forks_survive_preemption(mode, n):
    llm = LLM(num_kv_blocks=24, block_size=16, preemption_mode=mode, swap_space=0.05, max_num_seqs=16)
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(6)]
    sp = SamplingParams(n=n, max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    eng = llm.engine
    assert eng.core.counters.preemptions > 0
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [40] * (6 * n)
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)
    assert all(b.ref_cnt == 0 for b in eng.core.kv.pool.blocks[1:]) and not eng.core.kv.swapped
    assert not eng.core.scheduler.requests and not eng.states


def test_forks_count_against_max_num_seqs():
    kv = KVCacheManager(64, 4, False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    mk = lambda rid, n: Request(rid, [5, 6, 7], SamplingParams(n=n, max_tokens=8), 8, num_samples=n)  # noqa: E731
    s.add_request(mk("a", 3))
    s.add_request(mk("b", 2))
    so = s.schedule()
    assert [q.request_id for q in so.seqs] == ["a"]         # a's 3 samples fill 3 of the 4 slots
    assert s.num_seqs() == 3 and s.waiting_reason(s.waiting[0][1]) == "max_num_seqs reached"
    ups = list(s.update_from_output(so, {"a": [9, 10, 11]}))
    assert [(u.request.request_id, u.sample_index, u.token_id) for u in ups] == [("a#1", 1, 10), ("a#2", 2, 11),
                                                                                 ("a", 0, 9)]
    assert len(s.running) == 3 and s.num_seqs() == 3
    assert [q.request_id for q in s.schedule().seqs] == ["a", "a#1", "a#2"]
    with pytest.raises(ParamError, match="n \\(5\\) exceeds max_num_seqs") as e:
        s.add_request(mk("c", 5))
    assert e.value.param == "n"


def test_sibling_queue_keys_are_a_total_order():
    kv = KVCacheManager(64, 4, False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8), kv)
    s.add_request(Request("a", [5, 6, 7], SamplingParams(n=3, max_tokens=8), 8, num_samples=3))
    list(s.update_from_output(s.schedule(), {"a": [1, 2, 3]}))
    keys = [r.sort_key for r in s.running]
    assert keys == sorted(set(keys)) and len(keys) == 3
