"""The block pool: every KV block of the preallocated cache, with reference counts, an O(1) free
queue (a doubly linked list threaded through the blocks themselves, LRU order for eviction) and
the prefix-cache index (block hash -> block). Block 0 is the reserved null block: block tables
are padded with it and it is never handed out."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None          # set once the block is full and registered in the prefix cache
    prev: KVBlock | None = None            # free-queue links; None when not in the queue
    next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={'-' if self.block_hash is None else 'y'})"


class FreeBlockQueue:
    """Free blocks in eviction order: popleft() takes the least recently freed; remove() is O(1)."""

    def __init__(self, blocks: list[KVBlock]):
        self.head = KVBlock(-1)            # sentinels: no None checks on the hot path
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, b: KVBlock) -> None:
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.num_free += 1

    def appendleft(self, b: KVBlock) -> None:
        first = self.head.next
        self.head.next, b.prev, b.next, first.prev = b, self.head, first, b
        self.num_free += 1

    def remove(self, b: KVBlock) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        b = self.head.next
        if b is self.tail:
            raise ValueError("no free KV blocks")
        self.remove(b)
        return b

    def ids(self) -> list[int]:
        out, b = [], self.head.next
        while b is not self.tail:
            out.append(b.block_id)
            b = b.next
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (one is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1        # never freed, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, KVBlock] = {}   # block hash -> block holding those tokens
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: truly free plus cached-but-unreferenced (evictable)."""
        return self.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} KV blocks: only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:   # evict: its tokens leave the prefix cache
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (or shared by a fork). The null block
        (standing in a table for a block given back behind a sliding window) is nobody's."""
        for b in blocks:
            if b is self.null_block:
                continue
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: list[KVBlock]) -> None:
        """Drop one reference each; a block whose count reaches 0 joins the free queue's tail when it holds a
        cached prefix (so pass a request's blocks tail-first: its later blocks are then evicted before earlier
        ones), its head when it holds none: nothing is lost by handing it out next, and its memory is already
        mapped. Taking the never-used blocks first instead walked requests through the whole pool, paying each
        page's first touch (on the project's VMs ~33 us a page in order, ~560 us scattered across the pool's
        planes: 0.8 s in the first step of a process) and growing RSS toward the whole pool."""
        for b in ordered:
            if b is self.null_block:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None or not self.enable_caching:
                    b.block_hash = None
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)

    def cache_block(self, b: KVBlock, block_hash: int) -> None:
        if not self.enable_caching or b.block_hash is not None:
            return
        if block_hash in self.cached:      # the same tokens were computed twice at once: keep the first
            return
        b.block_hash = block_hash
        self.cached[block_hash] = b

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only possible when no block is in use)."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        return True
