import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import QueueFullError, Scheduler, SchedulerConfig
from pagedserve.sampling_params import SamplingParams


def mk(rid, n, max_tokens=4, priority=0):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   priority=priority)


def sched(num_blocks=64, bs=4, caching=False, **kw):
    return Scheduler(SchedulerConfig(**kw), KVCacheManager(num_blocks, bs, caching))


def fake_step(s, so):
    """What the engine does after the runner: append a token to every sampling sequence."""
    for q in so.seqs:
        if q.sampling is not None:
            s.requests[q.request_id].append_token(5)


def test_decodes_first_then_chunked_prefill_under_budget():
    s = sched(max_num_batched_tokens=10, long_prefill_token_threshold=6)
    a, b = mk("a", 3), mk("b", 20)
    s.add_request(a)
    so = s.schedule()
    assert [(q.request_id, q.num_tokens) for q in so.seqs] == [("a", 3)]
    fake_step(s, so)
    s.add_request(b)
    so = s.schedule()
    # a decodes (1 token), b prefills a chunk capped at 6
    assert [(q.request_id, q.start, q.num_tokens, q.sampling is not None) for q in so.seqs] == \
        [("a", 3, 1, True), ("b", 0, 6, False)]
    assert (so.num_decode_tokens, so.num_prefill_tokens) == (1, 6)
    fake_step(s, so)
    so = s.schedule()
    assert [(q.request_id, q.start, q.num_tokens) for q in so.seqs] == [("a", 4, 1), ("b", 6, 6)]


def test_max_num_seqs_and_fcfs():
    s = sched(max_num_seqs=2)
    for i in range(3):
        s.add_request(mk(f"r{i}", 4))
    so = s.schedule()
    assert [q.request_id for q in so.seqs] == ["r0", "r1"]
    assert s.waiting_reason(s.waiting[0][1]) == "max_num_seqs reached"


def test_priority_orders_the_waiting_queue():
    s = sched(max_num_seqs=1)
    s.add_request(mk("low", 4, priority=5))
    s.add_request(mk("high", 4, priority=-1))
    s.add_request(mk("mid", 4, priority=0))
    assert s.schedule().seqs[0].request_id == "high"


def test_preempts_lowest_priority_most_recent_by_recompute():
    s = sched(num_blocks=5, bs=4, max_num_batched_tokens=64)     # 4 usable blocks
    a, b = mk("a", 8, max_tokens=8), mk("b", 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    assert len(so.seqs) == 2 and s.kv.num_free_blocks == 0
    fake_step(s, so)
    so = s.schedule()     # a needs a 3rd block: b (admitted later) is preempted, its blocks freed
    assert so.preempted == ("b",) and b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [q.request_id for q in so.seqs] == ["a"]
    assert s.waiting[0][1] is b and s.num_preemptions == 1


def test_swap_preemption_keeps_progress():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, preemption_mode="swap"),
                  KVCacheManager(5, 4, False, num_host_blocks=8))
    a, b = mk("a", 8, max_tokens=8), mk("b", 7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    fake_step(s, s.schedule())
    so = s.schedule()
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 7
    assert so.block_ops.swap_out and len(s.kv.swapped["b"][0]) == 2
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    so = s.schedule()
    assert so.block_ops.swap_in and [(q.request_id, q.start, q.num_tokens) for q in so.seqs] == [("b", 7, 1)]


def test_abort_removes_everywhere_and_frees_blocks():
    s = sched(max_num_seqs=1)
    a, b = mk("a", 6), mk("b", 6)
    s.add_request(a)
    s.add_request(b)
    s.schedule()
    free_before = s.kv.num_free_blocks
    s.abort("a")
    s.abort("b")
    assert not s.running and not s.waiting and not s.requests
    assert s.kv.num_free_blocks == free_before + 2 and a.status is RequestStatus.FINISHED_ABORTED


def test_rejects_what_can_never_fit():
    s = sched(num_blocks=5, bs=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(mk("a", 60, max_tokens=10))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(mk("b", 20, max_tokens=4))
    assert not s.waiting


def test_bounded_waiting_queue():
    s = sched(max_waiting_requests=1)
    s.add_request(mk("a", 4))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        s.add_request(mk("b", 4))


def test_static_policy_waits_for_the_whole_batch():
    s = sched(policy="static", max_num_seqs=2)
    a, b, c = mk("a", 4, max_tokens=1), mk("b", 4, max_tokens=3), mk("c", 4)
    for r in (a, b, c):
        s.add_request(r)
    so = s.schedule()
    assert [q.request_id for q in so.seqs] == ["a", "b"]
    fake_step(s, so)
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    so = s.schedule()       # continuous batching would admit c now; static does not
    assert [q.request_id for q in so.seqs] == ["b"]
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    assert [q.request_id for q in s.schedule().seqs] == ["c"]


def test_chunked_prefill_disabled_rejects_long_prompt():
    s = sched(enable_chunked_prefill=False, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.add_request(mk("a", 9))


@pytest.mark.parametrize("classes", [None, [{"name": "only", "priority": 0}]])
def test_max_loras_passes_over_requests_of_a_third_adapter(classes):
    """max_loras 2: a request of a third adapter waits (saying why) while later requests of running
    adapters and of the base model pass it; it runs once an adapter's last sequence finishes. Its
    prefix hashes differ from the base model's for the same tokens."""
    from pagedserve.core.traffic import TrafficClasses
    s = Scheduler(SchedulerConfig(max_loras=2), KVCacheManager(64, 4, True),
                  classes=TrafficClasses.parse(classes) if classes else None)
    reqs = [mk("a", 4), mk("b", 4), mk("c", 4), mk("a2", 4), mk("base", 4)]
    for r, lora in zip(reqs, (1, 2, 3, 1, 0)):
        r.lora_id = lora
        s.add_request(r)
    so = s.schedule()
    assert [q.request_id for q in so.seqs] == ["a", "b", "a2", "base"]
    assert [q.lora_id for q in so.seqs] == [1, 2, 1, 0]
    assert [r.request_id for _, r in s.waiting] == ["c"]
    assert s.waiting_reason(reqs[2]) == "max_loras (2) other LoRA adapters are running"
    fake_step(s, so)
    s.finish(reqs[1], RequestStatus.FINISHED_STOPPED)          # adapter 2's only sequence
    so = s.schedule()
    assert "c" in [q.request_id for q in so.seqs]
    a, a2, base = reqs[0], reqs[3], reqs[4]       # the same tokens
    assert a.block_hashes[0] == a2.block_hashes[0] != base.block_hashes[0]


def test_lora_requests_do_not_share_prefix_blocks():
    kv = KVCacheManager(64, 4, True)
    a, b, c = mk("a", 8), mk("b", 8), mk("c", 8)
    b.lora_id = c.lora_id = 7
    for r in (a, b, c):
        computed, hit = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, 8 - hit, computed)
        r.num_computed_tokens = 8
        kv._cache_full_blocks(r, 8)
        r.num_cached_tokens = hit
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 4)
