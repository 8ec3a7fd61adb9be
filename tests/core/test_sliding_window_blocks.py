"""Sliding windows in the paged cache (every layer attends to the last W positions): blocks wholly
behind the next token's window return to the pool while the request runs, the null block 0 takes
their place in the table; prefix caching, forks, swap and freeing stay exact. Exact block ids."""
from pagedserve.core.kv_cache_manager import KVCacheManager
from tests.core.test_kv_cache_manager import admit, req


def decode(kv, r, n=1):
    """Schedule and compute n decode steps of r (one new token each)."""
    for _ in range(n):
        r.append_token(7)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1


def test_blocks_behind_the_window_return_to_the_pool():
    kv = KVCacheManager(num_blocks=10, block_size=4, windows=(6,))
    r = req("a", range(100, 110), max_tokens=20)          # 10 tokens: blocks 1, 2, 3
    admit(kv, r)
    assert kv.block_ids("a") == (1, 2, 3) and kv.num_free_blocks == 6
    # next token at position 10 sees positions 5..10: block 1 (0..3) is dead
    decode(kv, r)
    assert kv.block_ids("a") == (0, 2, 3) and kv.pool.blocks[1].ref_cnt == 0
    assert kv.num_free_blocks == 7                     # block 1 back, nothing new needed (3 holds 8..11)
    decode(kv, r, 2)                                   # positions 11, 12: the next sees 7..12: block 2 (4..7) lives
    assert kv.block_ids("a")[:2] == (0, 2)
    decode(kv, r)                                      # next token at 13 sees 8..13: block 2 is dead
    assert kv.block_ids("a")[:3] == (0, 0, 3)
    assert kv.pool.blocks[2].ref_cnt == 0 and kv.pool.null_block.ref_cnt == 1
    kv.free(r)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks and kv.pool.null_block.ref_cnt == 1


def test_a_long_sequence_runs_in_a_pool_smaller_than_its_length():
    """40 tokens in blocks of 4 need 10 blocks without the window; with W = 8 a handful suffice."""
    kv = KVCacheManager(num_blocks=5, block_size=4, windows=(8,))      # 4 usable blocks
    r = req("a", range(100, 104), max_tokens=40)
    admit(kv, r)
    decode(kv, r, 36)
    table = kv.block_ids("a")
    # the last step computed position 39, seeing 32..39: blocks 0..7 (positions 0..31) are given back
    assert len(table) == 10 and table[:8] == (0,) * 8 and 0 not in table[8:]
    assert sum(b.ref_cnt for b in kv.pool.blocks[1:]) == 2


def test_forks_share_live_blocks_and_the_prefix_cache_keeps_given_back_blocks():
    kv = KVCacheManager(num_blocks=12, block_size=4, windows=(6,))
    parent = req("p", range(100, 110), max_tokens=8)
    admit(kv, parent)
    decode(kv, parent)                                 # block 1 given back; still cached (evictable)
    assert kv.block_ids("p") == (0, 2, 3) and kv.pool.blocks[1].block_hash is not None
    child = req("c", range(100, 110), max_tokens=8)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert kv.block_ids("c") == (0, 2, 3)
    assert [kv.pool.blocks[i].ref_cnt for i in (2, 3)] == [2, 2] and kv.pool.null_block.ref_cnt == 1
    other = req("o", list(range(100, 108)) + [1, 2, 3])   # the same first 8 tokens: a hit on blocks 1 and 2
    assert admit(kv, other) == 8
    assert kv.block_ids("o")[:2] == (1, 2) and kv.pool.blocks[1].ref_cnt == 1
    for r in (parent, child, other):
        kv.free(r)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_swap_keeps_the_null_blocks_and_copies_only_live_ones():
    kv = KVCacheManager(num_blocks=10, block_size=4, num_host_blocks=4, windows=(6,))
    r = req("a", range(100, 110), max_tokens=8)
    admit(kv, r)
    decode(kv, r)
    assert kv.block_ids("a") == (0, 2, 3)
    kv.take_ops()
    assert kv.can_swap_out(r)
    kv.swap_out(r)
    assert kv.take_ops().swap_out == [(2, 0), (3, 1)] and kv.swapped["a"] == [[None, 0, 1]]
    assert kv.swap_in(r)
    _, b1, b2 = kv.block_ids("a")
    assert kv.block_ids("a")[0] == 0 and kv.take_ops().swap_in == [(0, b1), (1, b2)] and len(kv.host_free) == 4
    kv.free(r)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_a_prefix_hit_takes_only_the_blocks_inside_the_window():
    kv = KVCacheManager(num_blocks=12, block_size=4, windows=(6,))
    admit(kv, req("a", range(100, 117)))              # 17 tokens: blocks 1..5, 1..4 full and cached
    b = req("b", list(range(100, 116)) + [5, 6])       # the same 16 tokens, then others
    computed, n = kv.get_computed_blocks(b)
    # the next token (16) sees 11..16: blocks 1 and 2 (positions 0..7) are not taken
    assert n == 16 and [[c.block_id for c in g] for g in computed] == [[0, 0, 3, 4]]
    assert kv.allocate_slots(b, b.num_tokens - n, computed)
    assert kv.block_ids("b") == (0, 0, 3, 4, 6)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 2, 2]


def test_admission_counts_only_the_blocks_a_window_keeps_live():
    kv = KVCacheManager(num_blocks=7, block_size=4, windows=(8,))   # 6 usable blocks
    assert kv.max_blocks_held(400, max_chunk=8) == 5           # ceil((7 + 8) / 4) + 1
    assert KVCacheManager(7, 4).max_blocks_held(400, max_chunk=8) == 100


def test_full_and_sliding_groups_share_one_pool():
    """Gemma's layout (core/kv_layout.py): a full group and a sliding group, each with its own table
    from the one pool; the sliding group's blocks behind its window return while the full group's stay."""
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(0, 6))
    r = req("a", range(100, 110), max_tokens=20)          # 10 tokens: 3 blocks in each group
    admit(kv, r)
    assert kv.block_tables("a") == ((1, 2, 3), (4, 5, 6)) and kv.num_free_blocks == 9
    assert kv.block_ids("a") == (1, 2, 3)                  # the first group's table
    decode(kv, r)                                          # the next token (10) sees 5..10: block 4 is dead
    assert kv.block_tables("a") == ((1, 2, 3), (0, 5, 6)) and kv.num_free_blocks == 10
    decode(kv, r, 3)                                       # 12 needs a new block in both; at 13 block 5 is dead
    # (block 4 was cached when it went back: the free queue hands out never-cached blocks first)
    assert kv.block_tables("a") == ((1, 2, 3, 7), (0, 0, 6, 8))
    assert kv.num_live_blocks("a") == 6 and kv.max_blocks_held(400, max_chunk=4) == 100 + 4
    kv.free(r)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_a_prefix_hit_serves_every_group_or_none():
    """A hit of m blocks needs all m in a full group, and in a sliding group only the blocks the next
    token's window reaches: evicting a sliding block behind the window keeps the hit, one inside it
    shortens the hit for every group."""
    kv = KVCacheManager(num_blocks=24, block_size=4, windows=(0, 6))
    a = req("a", range(100, 117))                          # 17 tokens: 5 blocks per group, 4 full ones cached
    admit(kv, a)
    assert kv.block_tables("a") == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    kv.free(a)
    b = req("b", list(range(100, 116)) + [5, 6])
    computed, n = kv.get_computed_blocks(b)
    # next token 16 sees 11..16: the sliding group needs its blocks 2 and 3 (positions 8..15) only
    assert n == 16 and [[c.block_id for c in g] for g in computed] == [[1, 2, 3, 4], [0, 0, 8, 9]]
    assert kv.allocate_slots(b, b.num_tokens - n, computed)
    assert kv.block_tables("b")[1][:4] == (0, 0, 8, 9) and kv.pool.blocks[6].ref_cnt == 0
    kv.free(b)
    kv.pool.blocks[9].block_hash, h = None, kv.pool.blocks[9].block_hash     # the sliding group's block 3 evicted
    del kv.pool.cached[h]
    c = req("c", list(range(100, 116)) + [5, 6])
    computed, n = kv.get_computed_blocks(c)
    # a hit of 3 blocks: next token 12 sees 7..12, the sliding group's blocks 1 and 2 (7, 8) are cached
    assert n == 12 and [[x.block_id for x in g] for g in computed] == [[1, 2, 3], [0, 7, 8]]


def test_swap_and_fork_keep_every_group():
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=8, windows=(0, 6))
    p = req("p", range(100, 110), max_tokens=8)
    admit(kv, p)
    decode(kv, p)                                          # sliding group: block 4 given back
    c = req("c", range(100, 110), max_tokens=8)
    c.num_computed_tokens = p.num_computed_tokens
    kv.fork(p, c)
    assert kv.block_tables("c") == kv.block_tables("p") == ((1, 2, 3), (0, 5, 6))
    kv.swap_out(p)
    assert kv.take_ops().swap_out == [(1, 0), (2, 1), (3, 2), (5, 3), (6, 4)]
    assert kv.swapped["p"] == [[0, 1, 2], [None, 3, 4]]
    assert kv.swap_in(p)
    assert kv.block_tables("p")[1][0] == 0 and len(kv.take_ops().swap_in) == 5
    for r in (p, c):
        kv.free(r)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks and len(kv.host_free) == 8
