"""KVCacheManager: which blocks each request holds. Prefix caching (chained block hashes), sharing
by fork with copy-on-write of a partial block, a host-memory swap tier, and sliding windows: a group
of layers that attends to the last W positions only (every layer of Mistral, Mixtral, Phi-3 with
sliding_window; 5 of 6 of Gemma 3's) gives back each block whose positions all lie behind the window
of the next token while the request runs, and the null block takes its place in that group's table
(the kernels never read it). Groups of layers: core/kv_layout.py."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.core.block_pool import BlockPool, KVBlock
from pagedserve.core.record import record
from pagedserve.core.request import Request


def _image_keys(req: Request, start: int, end: int) -> tuple:
    """The extra key of a block holding positions start..end-1: each image it overlaps, by content hash
    and where in the image the block begins (vLLM's mm_hash extra keys)."""
    return tuple(("image", f.hash, start - f.offset) for f in req.mm_features if f.overlaps(start, end))


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


@record
class TableDelta:
    """How one group's block table changed since it was last sent: entries from `start` on are
    `block_ids` and the table ends there. start 0: the whole table (a new, resumed or forked
    sequence); a decode step usually sends none (ScheduledSeq.tables is ()) or one appended block; a copy-on-write, a
    trim of rejected drafts' blocks or a block given back behind a sliding window rewrites from
    its index. The runner's InputBatch keeps the tables (runner/input_batch.py)."""

    start: int
    block_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return self.start + len(self.block_ids)


class KVCacheManager:
    """Per request, one block list per group of layers (core/kv_layout.py): one group for a model
    whose layers all see the same window (the Llama case), several for a model that mixes sliding and
    full layers. All groups take their blocks from the one pool and advance together: each holds a
    block for every block_size tokens of the request, except that a sliding group's blocks wholly
    behind its window go back to the pool (the null block stands in for them)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, reserve_tokens: int | None = None, windows: tuple[int, ...] = (0,)):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        # contiguous policy: reserve this many tokens' worth of blocks at admission (None = paged)
        self.reserve_tokens = reserve_tokens
        # per group of layers: 0 full attention, W > 0 the last W positions only (KVLayout.windows)
        self.windows: tuple[int, ...] = tuple(windows)
        self.req_blocks: dict[str, list[list[KVBlock]]] = {}   # request -> a block list per group
        self.num_hashed: dict[str, int] = {}               # leading blocks already registered in the cache
        # request -> per group, the first table index changed since the runner was last sent the table
        # (take_table_delta): the runner keeps the tables, a step sends only what changed
        self.changed_from: dict[str, list[int]] = {}
        self.rewritten: set[str] = set()    # requests whose tables had entries rewritten or cut since then
        self.host_free: deque[int] = deque(range(num_host_blocks))
        self.num_host_blocks = num_host_blocks
        self.swapped: dict[str, list[list[int | None]]] = {}   # request -> host blocks per group, in order
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
                "kv.changed_from": len(self.changed_from), "kv.rewritten": len(self.rewritten),
                "kv.swapped": len(self.swapped), "kv.host_blocks_taken": self.num_host_blocks - len(self.host_free)}

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks of one group that num_tokens positions fill."""
        return -(-num_tokens // self.block_size)

    def _window_blocks(self, window: int, max_chunk: int) -> int:
        """The most blocks a group sliding over `window` holds at once: the last W - 1 positions and
        the step's chunk are live (+1: they may straddle a block edge)."""
        return self.blocks_needed(window - 1 + max_chunk) + 1

    def _all_groups(self, blocks: int, max_chunk: int) -> int:
        """`blocks` per group, but at most what its window keeps live in a sliding group."""
        return sum(min(blocks, self._window_blocks(w, max_chunk)) if w else blocks for w in self.windows)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks (all groups together) a request of num_tokens ever holds at once."""
        return self._all_groups(self.blocks_needed(max(num_tokens, self.reserve_tokens or 0)), max_chunk)

    def new_blocks_needed(self, num_tokens: int) -> int:
        """Blocks (all groups) that num_tokens more positions take from the pool, at most."""
        return self._all_groups(self.blocks_needed(num_tokens), num_tokens)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The first group's block table (the only one of a model whose layers all see the same window)."""
        return tuple(b.block_id for b in self.req_blocks[request_id][0]) if request_id in self.req_blocks else ()

    def block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table per group, as the runner gets them (derived from the blocks held)."""
        groups = self.req_blocks.get(request_id)
        if groups is None:
            return tuple(() for _ in self.windows)
        return tuple(tuple(b.block_id for b in blocks) for blocks in groups)

    def take_table_delta(self, request_id: str) -> tuple[TableDelta, ...]:
        """Per group, the request's table from its first entry changed since the last call (all of it
        the first time, after a preemption, a swap-in or a fork); then nothing is pending. () when no
        group's table changed (a decode step within its last block)."""
        groups = self.req_blocks.get(request_id)
        if groups is None:
            return tuple(TableDelta(0, ()) for _ in self.windows)
        changed = self.changed_from.get(request_id)
        if changed is not None and request_id not in self.rewritten and \
                all(c == len(blocks) for c, blocks in zip(changed, groups)):
            return ()                   # nothing changed (most decode steps): the runner keeps its tables
        self.rewritten.discard(request_id)
        changed = changed or [0] * len(groups)
        out = tuple(TableDelta(c, tuple(b.block_id for b in blocks[c:])) for c, blocks in zip(changed, groups))
        self.changed_from[request_id] = [len(blocks) for blocks in groups]
        return out

    def _changed(self, rid: str, group: int, index: int) -> None:
        """Table `group` of rid differs from what the runner was sent from `index` on."""
        changed = self.changed_from.get(rid)
        if changed is not None and index < changed[group]:
            changed[group] = index
            self.rewritten.add(rid)     # (a cut to `index` leaves the lengths equal to what was sent)

    def num_live_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds, all groups (the null block behind a window not counted)."""
        null = self.pool.null_block
        return sum(b is not null for blocks in self.req_blocks.get(request_id, ()) for b in blocks)

    def num_shared_savings(self) -> int:
        """Blocks that sharing (forks, prefix hits) saved: sum of (refcount - 1) over shared blocks."""
        return sum(b.ref_cnt - 1 for b in self.pool.blocks[1:] if b.ref_cnt > 1)

    def take_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        return ops

    # ------------------------------------------------------------ prefix cache
    def _key(self, group: int, block_hash: int) -> int:
        """Each group caches its own copy of a block's keys and values: the cache key names the group."""
        return block_hash if group == 0 else hash((group, block_hash))

    def _dead(self, window: int, position: int) -> int:
        """Leading blocks wholly behind the window of a token at `position` (it sees position - W + 1 on)."""
        return max(0, position - window + 1) // self.block_size if window else 0

    def _ensure_hashes(self, req: Request, upto_tokens: int) -> None:
        bs, hashes = self.block_size, req.block_hashes
        root = hash(("lora", req.lora_id)) if req.lora_id else None    # an adapter's KV differs from the base's
        for i in range(len(hashes), upto_tokens // bs):
            tokens = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
            if req.mm_features:       # image tokens are one id whatever the image: the image's hash says which
                tokens += _image_keys(req, i * bs, (i + 1) * bs)
            hashes.append(hash_block(hashes[-1] if hashes else root, tokens))

    def get_computed_blocks(self, req: Request) -> tuple[list[list[KVBlock]], int]:
        """The longest cached prefix of full blocks (per group), capped at num_tokens - 1 so the last
        token is always computed (its logits are needed). A hit of m blocks needs, in a full group, all
        m cached; in a sliding group only those the next token's window reaches (the ones behind it
        are the null block in the table). A request still owed prompt logprobs (or pooling over more
        than its last token) gets no hit: its prompt is recomputed (its blocks still enter the cache
        for others), since the logits / hidden states of a cached prefix were never kept."""
        if not self.enable_caching or owes_prompt_logprobs(req) or owes_pooling(req):
            return [[] for _ in self.windows], 0
        bs, lookup = self.block_size, self.pool.lookup
        max_blocks = (req.num_tokens - 1) // bs
        self._ensure_hashes(req, max_blocks * bs)
        hashes = req.block_hashes[:max_blocks]
        found: list[list[KVBlock | None]] = [[] for _ in self.windows]   # per group, hashes[0..] looked up
        m = max_blocks
        for g, w in enumerate(self.windows):
            if not w:                      # full attention: the leading run of cached blocks
                for h in hashes[:m]:
                    b = lookup(self._key(g, h))
                    if b is None:
                        break
                    found[g].append(b)
                m = min(m, len(found[g]))
        ok = [True] * (m + 1)              # ok[i]: a hit of i blocks serves every sliding group
        for g, w in enumerate(self.windows):
            if w:
                found[g] = [lookup(self._key(g, h)) for h in hashes[:m]]
                run = 0                    # cached blocks ending at block i - 1
                for i, b in enumerate(found[g], 1):
                    run = run + 1 if b is not None else 0
                    ok[i] = ok[i] and run >= i - self._dead(w, i * bs)
        m = max(i for i in range(m + 1) if ok[i])
        hit = []
        for w, f in zip(self.windows, found):
            dead = self._dead(w, m * bs)
            hit.append([self.pool.null_block] * dead + f[dead:m])
        return hit, m * bs

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (not per retry of a request that had to keep waiting)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: list[list[KVBlock]] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the prefix hit
        `computed`, per group, when admitting). False, with nothing changed (but the blocks behind a
        sliding window returned: they are dead either way), if the pool cannot provide it."""
        rid = req.request_id
        if computed is None and self.windows == (0,) and self.reserve_tokens is None:
            # the common decode step: one full-attention table whose blocks already hold the new tokens, its
            # last block not shared (no copy-on-write): nothing to allocate, only full blocks to register
            held = self.req_blocks.get(rid)
            if held is not None:
                blocks, num_computed = held[0], req.num_computed_tokens
                end = num_computed + num_new_tokens
                if end <= len(blocks) * self.block_size and \
                        not (num_new_tokens and self._needs_cow(blocks, num_computed)):
                    self._cache_full_blocks(req, min(end, req.num_tokens))
                    return True
        G = len(self.windows)
        computed = computed or [[] for _ in range(G)]
        held = self.req_blocks.get(rid) or [[] for _ in range(G)]
        for g, (w, blocks) in enumerate(zip(self.windows, held)):
            if w and blocks:
                self._changed(rid, g, self._free_behind_window(blocks, w, req.num_computed_tokens))
        num_computed = req.num_computed_tokens + len(computed[0]) * self.block_size
        total_tokens = num_computed + num_new_tokens
        if self.reserve_tokens is not None:
            total_tokens = max(total_tokens, self.reserve_tokens)
        need_new = [max(0, self.blocks_needed(total_tokens) - len(h) - len(c)) for h, c in zip(held, computed)]
        cow = [self._needs_cow(h, num_computed) and num_new_tokens > 0 for h in held]
        revived = sum(1 for c in computed for b in c if b.ref_cnt == 0)  # touching these takes them off the free queue
        if sum(need_new) + sum(cow) + revived > self.pool.num_free_blocks:
            return False
        if rid not in self.req_blocks:
            self.req_blocks[rid], self.num_hashed[rid] = held, 0
            self.changed_from.pop(rid, None)   # never sent: the whole table goes
        if computed[0]:                    # the hit's blocks are cached already
            self.num_hashed[rid] = len(held[0]) + len(computed[0])
        for g, (blocks, hit, n, c) in enumerate(zip(held, computed, need_new, cow)):
            self._changed(rid, g, len(blocks) - (1 if c else 0))
            if hit:
                self.pool.touch(hit)
                blocks.extend(hit)
            if c:
                old = blocks[-1]
                new = self.pool.get_new_blocks(1)[0]
                self.ops.copy.append((old.block_id, new.block_id))
                self.pool.free_blocks([old])
                blocks[-1] = new
            if n:
                blocks.extend(self.pool.get_new_blocks(n))
        self._cache_full_blocks(req, min(num_computed + num_new_tokens, req.num_tokens))
        return True

    def _free_behind_window(self, blocks: list[KVBlock], window: int, num_computed: int) -> int:
        """The next token (position num_computed) sees keys from num_computed - W + 1 on: blocks wholly
        before that return to the pool (tail-first, as in free) and the null block stands in for them.
        Returns the first index changed (len(blocks): none)."""
        dead = self._dead(window, num_computed)
        first = self._first_live(blocks, dead)
        if first < dead:
            self.pool.free_blocks(reversed(blocks[first:dead]))
            blocks[first:dead] = [self.pool.null_block] * (dead - first)
            return first
        return len(blocks)

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
        null = self.pool.null_block
        for g, blocks in enumerate(self.req_blocks[rid]):
            for i in range(start, n_full):
                if blocks[i] is not null:              # (given back behind the window, already cached)
                    self.pool.cache_block(blocks[i], self._key(g, req.block_hashes[i]))
        self.num_hashed[rid] = n_full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks `num_tokens` positions need (speculative decoding: the blocks that held
        only rejected draft tokens go back, last first). Their slots were never hashed: the prefix cache
        covers only tokens that are the request's own."""
        keep = self.blocks_needed(max(num_tokens, self.reserve_tokens or 0))
        for g, blocks in enumerate(self.req_blocks.get(req.request_id, ())):
            if len(blocks) > keep:
                self._changed(req.request_id, g, keep)
                self.pool.free_blocks(reversed(blocks[keep:]))
                del blocks[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (refcount + 1); writes into a shared partial
        block are copy-on-write (see allocate_slots)."""
        groups = self.req_blocks[parent.request_id]
        for blocks in groups:
            self.pool.touch(blocks)
        cid = child.request_id
        self.req_blocks[cid] = [list(blocks) for blocks in groups]
        self.changed_from.pop(cid, None)
        self.num_hashed[cid] = self.num_hashed[parent.request_id]
        child.block_hashes = list(parent.block_hashes)

    def free(self, req: Request) -> None:
        """Release every block the request holds, last block first (LRU eviction then takes a
        prefix's later blocks before its earlier ones). Also drops any swapped-out copy."""
        self._release(req.request_id)
        host = self.swapped.pop(req.request_id, None)
        if host:
            self.host_free.extend(h for hs in host for h in hs if h is not None)

    def _release(self, rid: str) -> None:
        for blocks in self.req_blocks.pop(rid, ()):
            self.pool.free_blocks(reversed(blocks))
        self.num_hashed.pop(rid, None)
        self.changed_from.pop(rid, None)
        self.rewritten.discard(rid)

    # ------------------------------------------------------------ swap tier
    def can_swap_out(self, req: Request) -> bool:
        return self.num_live_blocks(req.request_id) <= len(self.host_free)

    def swap_out(self, req: Request) -> None:
        """Live blocks go to host blocks, in order; a null block (behind a sliding window) stays null (None)."""
        rid = req.request_id
        null, host = self.pool.null_block, []
        for blocks in self.req_blocks[rid]:
            hs = [None if b is null else self.host_free.popleft() for b in blocks]
            self.ops.swap_out.extend((b.block_id, h) for b, h in zip(blocks, hs) if h is not None)
            host.append(hs)
        self.swapped[rid] = host
        self._release(rid)

    def swap_in(self, req: Request) -> bool:
        rid = req.request_id
        host = self.swapped[rid]
        live = [h for hs in host for h in hs if h is not None]
        if len(live) > self.pool.num_free_blocks:
            return False
        fresh = iter(self.pool.get_new_blocks(len(live)))
        groups = [[self.pool.null_block if h is None else next(fresh) for h in hs] for hs in host]
        for hs, blocks in zip(host, groups):
            self.ops.swap_in.extend((h, b.block_id) for h, b in zip(hs, blocks) if h is not None)
        del self.swapped[rid]
        self.host_free.extend(live)
        self.req_blocks[rid] = groups
        self.changed_from.pop(rid, None)
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
