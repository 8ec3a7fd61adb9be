import pytest

from pagedserve.core.block_pool import BlockPool


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 3, 4]
    assert pool.null_block.ref_cnt == 1


def test_free_queue_order_after_frees():
    """A freed block that holds no cached prefix goes to the queue's head (handed out next: nothing is lost, and
    its memory is mapped already); one that holds a cached prefix to its tail (evicted least recently freed first),
    behind the never-used blocks."""
    pool = BlockPool(7)
    a = pool.get_new_blocks(4)            # 1, 2, 3, 4
    pool.cache_block(a[0], 101)
    pool.cache_block(a[2], 103)
    pool.free_blocks([a[1]])              # 2 holds no prefix: the head
    assert pool.free_queue.ids() == [2, 5, 6]
    pool.free_blocks(reversed(a[:1] + a[2:]))   # tail-first: 4 (no prefix: head), 3 and 1 (cached: tail)
    assert pool.free_queue.ids() == [4, 2, 5, 6, 3, 1]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [4, 2, 5, 6] and pool.num_evictions == 0
    assert [b.block_id for b in pool.get_new_blocks(1)] == [3] and pool.num_evictions == 1
    assert pool.lookup(101) is a[0] and pool.lookup(103) is None


def test_refcounts_and_touch():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 3


def test_failed_allocation_changes_nothing():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2 and all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_cached_block_is_evicted_when_reused():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 1234)
    pool.free_blocks([b])
    assert pool.lookup(1234) is b           # unreferenced but still cached
    pool.get_new_blocks(2)                  # takes 2, then 1 (the cached one, LRU)
    assert pool.lookup(1234) is None and pool.num_evictions == 1


def test_caching_off_keeps_no_hashes():
    pool = BlockPool(3, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 7)
    assert pool.lookup(7) is None
