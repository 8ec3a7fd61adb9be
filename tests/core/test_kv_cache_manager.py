from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams


def req(rid, ids, max_tokens=4):
    return Request(rid, list(ids), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def admit(kv, r):
    computed, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, computed)
    kv.record_prefix_lookup(r.num_tokens, n)
    r.num_computed_tokens = r.num_tokens
    return n


def test_same_prefix_gets_same_blocks_with_refcount_2():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", range(100, 113))          # 13 tokens: 3 full blocks + 1
    b = req("b", list(range(100, 112)) + [7, 8])
    assert admit(kv, a) == 0
    assert list(kv.block_ids("a")) == [1, 2, 3, 4]
    assert admit(kv, b) == 12               # the 3 full blocks are a prefix hit
    assert list(kv.block_ids("b"))[:3] == [1, 2, 3] and list(kv.block_ids("b"))[3] == 5
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert kv.prefix_hits == 12 and kv.prefix_queries == 13 + 14
    assert kv.num_shared_savings() == 3


def test_last_token_always_computed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, req("a", range(8)))          # exactly 2 full blocks
    b = req("b", range(8))
    computed, n = kv.get_computed_blocks(b)
    assert n == 4 and len(computed[0]) == 1    # capped at num_tokens - 1


def test_free_returns_blocks_tail_first_and_keeps_them_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(12))
    admit(kv, a)
    kv.free(a)
    # blocks 1..3 freed tail-first: eviction takes the prefix's later blocks before earlier ones
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 3, 2, 1]
    assert kv.num_free_blocks == 7 and kv.pool.num_cached_blocks() == 3
    b = req("b", range(12))
    assert admit(kv, b) == 8                # cached, unreferenced blocks are reused


def test_failed_allocation_changes_no_refcount():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a = req("a", range(8))
    admit(kv, a)
    b = req("b", list(range(8)) + list(range(50, 62)))     # prefix hit of 2 blocks, then 3 new: only 2 free
    computed, n = kv.get_computed_blocks(b)
    before = [blk.ref_cnt for blk in kv.pool.blocks]
    assert not kv.allocate_slots(b, b.num_tokens - n, computed)
    assert [blk.ref_cnt for blk in kv.pool.blocks] == before and kv.num_free_blocks == 2
    assert list(kv.block_ids("b")) == []


def test_fork_shares_and_copy_on_write_copies_only_the_partial_block():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    p = req("p", range(10))                 # 2 full blocks + a partial one
    admit(kv, p)
    c = req("c", range(10))
    c.num_computed_tokens = 10
    kv.fork(p, c)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    p.append_token(1)
    c.append_token(2)
    assert kv.allocate_slots(p, 1)          # p writes into the shared partial block 3: copy-on-write
    ops = kv.take_ops()
    assert ops.copy == [(3, 4)] and list(kv.block_ids("p")) == [1, 2, 4]
    assert kv.allocate_slots(c, 1)          # c is now block 3's only user: writes in place
    assert kv.take_ops().copy == [] and list(kv.block_ids("c")) == [1, 2, 3]
    assert kv.num_shared_savings() == 2


def test_swap_out_and_in():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, num_host_blocks=4)
    a = req("a", range(7))
    admit(kv, a)
    assert list(kv.block_ids("a")) == [1, 2]
    kv.swap_out(a)
    assert kv.take_ops().swap_out == [(1, 0), (2, 1)] and kv.num_free_blocks == 5
    assert kv.swap_in(a)
    ops = kv.take_ops()
    # the device blocks swapped out held no cached prefix: the pool hands them out first again
    assert ops.swap_in == [(0, 1), (1, 2)] and list(kv.block_ids("a")) == [1, 2]
    assert len(kv.host_free) == 4


def test_contiguous_policy_reserves_max_len():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=False, reserve_tokens=32)
    a = req("a", range(5))
    admit(kv, a)
    assert len(list(kv.block_ids("a"))) == 8
