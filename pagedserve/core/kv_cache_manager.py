"""KVCacheManager: which blocks each request holds. Prefix caching (chained block hashes), sharing
by fork with copy-on-write of a partial block, a host-memory swap tier, and sliding windows: when
every layer attends to the last W positions only (Mistral, Mixtral, Phi-3 with sliding_window), a
block whose positions all lie behind the window of the next token goes back to the pool while the
request runs, and the null block takes its place in the table (the kernels never read it)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.core.request import Request


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A full block is named by its tokens and everything before it (the parent's hash)."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class BlockOps:
    """Cache-memory copies the model runner performs before the next forward, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    copy: list[tuple[int, int]] = field(default_factory=list)       # copy-on-write (src, dst)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, reserve_tokens: int | None = None, sliding_window: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        # contiguous policy: reserve this many tokens' worth of blocks at admission (None = paged)
        self.reserve_tokens = reserve_tokens
        # > 0: every layer sees only the last sliding_window positions (0: some layer sees them all)
        self.sliding_window = sliding_window
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_hashed: dict[str, int] = {}               # leading blocks already registered in the cache
        self.host_free: deque[int] = deque(range(num_host_blocks))
        self.num_host_blocks = num_host_blocks
        self.swapped: dict[str, list[int]] = {}            # request -> host blocks, in order
        self.ops = BlockOps()
        self.prefix_queries = 0                            # tokens looked up in the prefix cache
        self.prefix_hits = 0                               # tokens found there

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def held(self) -> dict[str, int]:
        """Entries per request-keyed structure (none once every request has finished); the prefix
        cache is bounded by the pool (one entry per cached block)."""
        return {"kv.req_blocks": len(self.req_blocks), "kv.num_hashed": len(self.num_hashed),
                "kv.swapped": len(self.swapped), "kv.host_blocks_taken": self.num_host_blocks - len(self.host_free)}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens ever holds at once; behind a sliding window only
        the last W - 1 positions and the step's chunk are live (+1: they may straddle a block edge)."""
        full = self.blocks_needed(max(num_tokens, self.reserve_tokens or 0))
        if not self.sliding_window:
            return full
        return min(full, self.blocks_needed(self.sliding_window - 1 + max_chunk) + 1)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table as the runner gets it (derived from the blocks it holds)."""
        return tuple(b.block_id for b in self.req_blocks.get(request_id, ()))

    def num_shared_savings(self) -> int:
        """Blocks that sharing (forks, prefix hits) saved: sum of (refcount - 1) over shared blocks."""
        return sum(b.ref_cnt - 1 for b in self.pool.blocks[1:] if b.ref_cnt > 1)

    def take_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        return ops

    # ------------------------------------------------------------ prefix cache
    def _ensure_hashes(self, req: Request, upto_tokens: int) -> None:
        bs, hashes = self.block_size, req.block_hashes
        for i in range(len(hashes), upto_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(req.all_token_ids[i * bs:(i + 1) * bs])))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks, capped at num_tokens - 1 so the last token is
        always computed (its logits are needed). A request still owed prompt logprobs (or pooling over
        more than its last token) gets no hit: its prompt is recomputed (its blocks still enter the
        cache for others), since the logits / hidden states of a cached prefix were never kept."""
        if not self.enable_caching or owes_prompt_logprobs(req) or owes_pooling(req):
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._ensure_hashes(req, max_blocks * self.block_size)
        hit: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (not per retry of a request that had to keep waiting)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the prefix hit
        `computed`, when admitting). False, with nothing changed (but the blocks behind a sliding
        window returned: they are dead either way), if the pool cannot provide it."""
        computed = computed or []
        held = self.req_blocks.get(req.request_id, [])
        if self.sliding_window and held:
            self._free_behind_window(held, req.num_computed_tokens)
        if self.sliding_window and computed:       # a prefix hit: what lies behind the window is not taken
            dead = max(0, len(computed) * self.block_size - self.sliding_window + 1) // self.block_size
            computed = [self.pool.null_block] * dead + computed[dead:]
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        total_tokens = num_computed + num_new_tokens
        if self.reserve_tokens is not None:
            total_tokens = max(total_tokens, self.reserve_tokens)
        need_new = max(0, self.blocks_needed(total_tokens) - len(held) - len(computed))
        cow = self._needs_cow(held, num_computed) and num_new_tokens > 0
        revived = sum(1 for b in computed if b.ref_cnt == 0)   # touching these takes them off the free queue
        if need_new + cow + revived > self.pool.num_free_blocks:
            return False
        rid = req.request_id
        if rid not in self.req_blocks:
            self.req_blocks[rid], self.num_hashed[rid] = [], 0
        blocks = self.req_blocks[rid]
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self.num_hashed[rid] = len(blocks)
        if cow:
            old = blocks[-1]
            new = self.pool.get_new_blocks(1)[0]
            self.ops.copy.append((old.block_id, new.block_id))
            self.pool.free_blocks([old])
            blocks[-1] = new
        if need_new:
            fresh = self.pool.get_new_blocks(need_new)
            blocks.extend(fresh)
        self._cache_full_blocks(req, min(num_computed + num_new_tokens, req.num_tokens))
        return True

    def _free_behind_window(self, blocks: list[KVBlock], num_computed: int) -> None:
        """The next token (position num_computed) sees keys from num_computed - W + 1 on: blocks wholly
        before that return to the pool (tail-first, as in free) and the null block stands in for them."""
        dead = max(0, num_computed - self.sliding_window + 1) // self.block_size
        first = self._first_live(blocks, dead)
        if first < dead:
            self.pool.free_blocks(reversed(blocks[first:dead]))
            blocks[first:dead] = [self.pool.null_block] * (dead - first)

    def _first_live(self, blocks: list[KVBlock], upto: int) -> int:
        """Index of the first block that is not the null block (the null ones lead), searched in [0, upto)."""
        lo, hi, null = 0, min(upto, len(blocks)), self.pool.null_block
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if blocks[mid] is null else (lo, mid)
        return lo

    def _needs_cow(self, held: list[KVBlock], num_computed: int) -> bool:
        """The next token lands in the last held block, which someone else also references."""
        return bool(held) and num_computed % self.block_size != 0 and \
            len(held) == self.blocks_needed(num_computed) and held[-1].ref_cnt > 1

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = req.request_id
        n_full = num_tokens // self.block_size
        start = self.num_hashed[rid]
        if n_full <= start:
            return
        self._ensure_hashes(req, n_full * self.block_size)
        blocks = self.req_blocks[rid]
        for i in range(start, n_full):
            if blocks[i] is not self.pool.null_block:      # (given back behind the window, already cached)
                self.pool.cache_block(blocks[i], req.block_hashes[i])
        self.num_hashed[rid] = n_full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks `num_tokens` positions need (speculative decoding: the blocks that held
        only rejected draft tokens go back, last first). Their slots were never hashed: the prefix cache
        covers only tokens that are the request's own."""
        blocks = self.req_blocks.get(req.request_id)
        keep = self.blocks_needed(max(num_tokens, self.reserve_tokens or 0))
        if blocks and len(blocks) > keep:
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (refcount + 1); writes into a shared partial
        block are copy-on-write (see allocate_slots)."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        cid = child.request_id
        self.req_blocks[cid] = list(blocks)
        self.num_hashed[cid] = self.num_hashed[parent.request_id]
        child.block_hashes = list(parent.block_hashes)

    def free(self, req: Request) -> None:
        """Release every block the request holds, last block first (LRU eviction then takes a
        prefix's later blocks before its earlier ones). Also drops any swapped-out copy."""
        self._release(req.request_id)
        host = self.swapped.pop(req.request_id, None)
        if host:
            self.host_free.extend(h for h in host if h is not None)

    def _release(self, rid: str) -> None:
        blocks = self.req_blocks.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        self.num_hashed.pop(rid, None)

    # ------------------------------------------------------------ swap tier
    def can_swap_out(self, req: Request) -> bool:
        null = self.pool.null_block
        return sum(b is not null for b in self.req_blocks.get(req.request_id, ())) <= len(self.host_free)

    def swap_out(self, req: Request) -> None:
        """Live blocks go to host blocks, in order; a null block (behind a sliding window) stays null (None)."""
        rid = req.request_id
        blocks, null = self.req_blocks[rid], self.pool.null_block
        host = [None if b is null else self.host_free.popleft() for b in blocks]
        self.ops.swap_out.extend((b.block_id, h) for b, h in zip(blocks, host) if h is not None)
        self.swapped[rid] = host
        self._release(rid)

    def swap_in(self, req: Request) -> bool:
        rid = req.request_id
        host = self.swapped[rid]
        live = [h for h in host if h is not None]
        if len(live) > self.pool.num_free_blocks:
            return False
        fresh = iter(self.pool.get_new_blocks(len(live)))
        blocks = [self.pool.null_block if h is None else next(fresh) for h in host]
        self.ops.swap_in.extend((h, b.block_id) for h, b in zip(host, blocks) if h is not None)
        del self.swapped[rid]
        self.host_free.extend(live)
        self.req_blocks[rid] = blocks
        self.num_hashed[rid] = 0
        # swapped-in blocks are private copies; register the full ones in the prefix cache again
        self._cache_full_blocks(req, req.num_computed_tokens)
        return True


def owes_pooling(req: Request) -> bool:
    """An embedding request pooling more than its last token (MEAN, CLS) needs the hidden states of
    prompt positions a prefix hit would skip."""
    return req.pooling is not None and req.pooling.pooling_type != "LAST" and req.pooled_done < req.num_prompt_tokens


def owes_prompt_logprobs(req: Request) -> bool:
    return req.params.prompt_logprobs is not None and req.prompt_logprobs_done < req.num_prompt_tokens - 1
