"""Property tests: BlockPool + KVCacheManager + Scheduler driven by hypothesis, without a model.

A random program of add (n, lengths, shared prefixes, priorities), step (random sampled tokens,
EOS, stop tokens, lengths), abort, with forks, preemption by recompute and by swap and
prefix-cache eviction happening as the small pool forces them, and (in half the programs) n-gram
speculative decoding with a random number of each step's drafts accepted. After every rule the bookkeeping
must be exact; at the end, after aborting everything, no block is owned."""
from __future__ import annotations

import collections
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pagedserve.config import SpeculativeConfig
from pagedserve.core.spec_decode import Drafting
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.traffic import TrafficClasses
from pagedserve.errors import ParamError, QueueFullError
from pagedserve.sampling_params import SamplingParams

EOS, STOP = 2, 3
PREFIXES = [[], list(range(10, 22)), list(range(30, 39))]     # shared prefixes, so the prefix cache hits
RULES = collections.Counter()
# traffic classes: none, two bands with limits, three with a swap class, a budget share and an ITL target
CLASSES = [None,
           [{"name": "hi", "priority": 0, "max_running": 2}, {"name": "lo", "priority": 1, "max_budget_share": 0.5}],
           [{"name": "a", "priority": -1, "itl_p99_ms": 10, "preemption_mode": "swap"},
            {"name": "b", "priority": 0, "max_waiting": 3, "max_budget_share": 0.6},
            {"name": "c", "priority": 1, "preemption_mode": "recompute", "max_budget_share": 0.4}]]


def fake_cost(rows):
    """A step-time model for the ITL target: 1 ms a row plus 0.5 ms a token."""
    return 1e-3 * len(rows) + 5e-4 * sum(n for _, n, _ in rows)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([2, 4, 8]),
                mode=st.sampled_from(["recompute", "swap"]), max_num_seqs=st.integers(1, 8),
                budget=st.integers(4, 64), chunk=st.integers(1, 32), caching=st.booleans(),
                host_blocks=st.integers(0, 48), spec=st.integers(0, 5),
                windows=st.sampled_from([(0,), (0,), (0,), (7,), (0, 6, 6), (0, 9)]),
                classes=st.sampled_from(range(len(CLASSES))))
    def setup(self, num_blocks, block_size, mode, max_num_seqs, budget, chunk, caching, host_blocks, spec, windows,
              classes):
        # windows: the groups of layers (KVLayout): one full group (Llama), every layer sliding
        # (Mistral), or full and sliding groups sharing the pool (Gemma)
        self.kv = KVCacheManager(num_blocks, block_size, caching, host_blocks if mode == "swap" or classes == 2 else 0,
                                 windows=windows)
        # spec: drafts whenever an n-gram matches (no cost table: adaptive off)
        self.sch = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                             max_model_len=96, long_prefill_token_threshold=chunk,
                                             preemption_mode=mode), self.kv,
                             classes=TrafficClasses.parse(CLASSES[classes]),
                             step_cost=fake_cost if classes == 2 else None,
                             drafting=Drafting(SpeculativeConfig(num_speculative_tokens=spec, adaptive=False))
                             if spec else None)
        self.users: dict[str, list[Request]] = {}     # user request -> its sequences
        self.next_id = 0

    def _record(self, name):
        RULES[name] += 1

    @rule(n=st.integers(1, 3), prefix=st.integers(0, len(PREFIXES) - 1), tail=st.integers(1, 20),
          max_tokens=st.integers(1, 40), priority=st.integers(-1, 1), stop_token=st.booleans(),
          ignore_eos=st.booleans())
    def add(self, n, prefix, tail, max_tokens, priority, stop_token, ignore_eos):
        self._record("add")
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = PREFIXES[prefix] + [100 + (self.next_id * 7 + i) % 50 for i in range(tail)]
        params = SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=[STOP] if stop_token else [])
        req = Request(rid, prompt, params, max_tokens, eos_token_ids=() if ignore_eos else (EOS,),
                      priority=priority, num_samples=n)
        if self.sch.classes is not None:
            req.traffic_class = self.sch.classes.resolve(priority)
        before = (self.kv.num_free_blocks, len(self.sch.waiting))
        try:
            self.sch.add_request(req)
        except (ParamError, QueueFullError):
            assert (self.kv.num_free_blocks, len(self.sch.waiting)) == before     # rejected: nothing changed
            return
        self.users[rid] = [req]

    @rule(k=st.integers(1, 6), seed=st.integers(0, 2**32))
    def steps(self, k, seed):
        """k engine steps; the fake runner samples tokens from a seeded generator (EOS and the stop
        token included)."""
        self._record("steps")
        rng = random.Random(seed)
        for _ in range(k):
            RULES["step"] += 1
            evictions = self.kv.pool.num_evictions
            so = self.sch.schedule()
            assert so.num_tokens <= self.sch.cfg.max_num_batched_tokens
            self._check_class_limits(so)
            RULES["preempted"] += len(so.preempted)
            RULES["swapped_out"] += len(so.block_ops.swap_out)
            RULES["copy_on_write"] += len(so.block_ops.copy)
            RULES["evicted"] += self.kv.pool.num_evictions - evictions
            sampled = {s.request_id: [rng.randrange(60) for _ in range(s.sampling.num_samples)]
                       for s in so.seqs if s.sampling is not None and not s.num_draft}
            for s in so.seqs:
                if s.num_draft:          # a verified run: some drafts accepted, then a token of the runner's own
                    a = rng.randint(0, s.num_draft)
                    sampled[s.request_id] = list(s.draft[:a]) + [rng.randrange(60)]
                    RULES["drafted"] += 1
                    RULES["rejected"] += a < s.num_draft
            for u in self.sch.update_from_output(so, sampled):
                if u.forked:
                    RULES["forked"] += 1
                    self.users[u.request.parent_id].append(u.request)
            for rid in [r for r, seqs in self.users.items() if all(q.status.finished for q in seqs)
                        and len(seqs) == seqs[0].num_samples]:
                del self.users[rid]

    def _drain(self):
        """Nothing starves: stepping on, every request left finishes (whatever its class or priority)."""
        rng = random.Random(0)
        for _ in range(3000):
            if not self.sch.has_unfinished():
                RULES["drained"] += 1
                return
            so = self.sch.schedule()
            self._check_class_limits(so)
            sampled = {s.request_id: [rng.randrange(60) for _ in range(s.sampling.num_samples)]
                       for s in so.seqs if s.sampling is not None}
            for s in so.seqs:
                if s.num_draft:
                    sampled[s.request_id] = [rng.randrange(60)]
            for u in self.sch.update_from_output(so, sampled):
                if u.forked:
                    self.users[u.request.parent_id].append(u.request)
        left = [(r.request_id, r.status, r.traffic_class) for r in self.sch.requests.values()]
        raise AssertionError(f"requests left after 3000 steps: {left}")

    def _check_class_limits(self, so):
        """Each class within its share of the step's budget (drafts come from what is left over) and
        its max_running."""
        classes = self.sch.classes
        if classes is None:
            return
        tokens = collections.Counter()
        for s in so.seqs:
            tokens[self.sch.requests[s.request_id].traffic_class] += s.num_tokens - s.num_draft
        running = collections.Counter()
        for r in self.sch.running:
            running[r.traffic_class] += 1 + r.num_pending_forks
        for i, c in enumerate(classes):
            if c.max_budget_share is not None:
                assert tokens[i] <= max(1, int(c.max_budget_share * self.sch.cfg.max_num_batched_tokens)), (c, tokens)
            if c.max_running is not None:
                assert running[i] <= c.max_running, (c, running)
        RULES["class_steps"] += 1

    @precondition(lambda self: self.users)
    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        self._record("abort")
        rid = sorted(self.users)[pick % len(self.users)]
        for q in self.users.pop(rid):
            self.sch.abort(q.request_id)
            assert q.status.finished

    # ------------------------------------------------------------ invariants
    @invariant()
    def blocks_are_accounted(self):
        pool = self.kv.pool
        holders = collections.Counter(b.block_id for groups in self.kv.req_blocks.values() for blocks in groups
                                      for b in blocks if b is not pool.null_block)    # (behind a window)
        free_ids = pool.free_queue.ids()
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        for b in pool.blocks[1:]:
            assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
            assert (b.ref_cnt == 0) == (b.block_id in free_ids)          # free xor owned
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        cached_free = sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None)
        truly_free = pool.num_free_blocks - cached_free
        assert truly_free + cached_free + used == pool.num_usable_blocks
        assert pool.null_block.ref_cnt == 1 and 0 not in holders

    @invariant()
    def no_block_beyond_the_next_token(self):
        """After a step a sequence holds blocks for its computed tokens and the next one at most:
        what rejected drafts took is back in the pool."""
        for rid, groups in self.kv.req_blocks.items():
            r = self.sch.requests[rid]
            assert len(groups) == len(self.kv.windows)
            for blocks in groups:
                assert len(blocks) <= self.kv.blocks_needed(r.num_computed_tokens + 1), (rid, len(blocks))
            assert r.num_computed_tokens <= r.num_tokens

    @invariant()
    def every_group_holds_what_its_window_reads(self):
        """The null block stands only behind a group's window: every block the next token (or a
        computed token inside the window) reads is a real block; a full group holds no null block."""
        null, bs = self.kv.pool.null_block, self.kv.block_size
        for rid, groups in self.kv.req_blocks.items():
            r = self.sch.requests[rid]
            for w, blocks in zip(self.kv.windows, groups):
                dead = max(0, r.num_computed_tokens - w + 1) // bs if w else 0
                assert all(b is not null for b in blocks[dead:]), (rid, w, r.num_computed_tokens, blocks)
                RULES["window_freed"] += any(b is null for b in blocks)

    @invariant()
    def prefix_index_names_its_blocks(self):
        for h, b in self.kv.pool.cached.items():
            assert b.block_hash == h
        for rid, groups in self.kv.req_blocks.items():
            req = self.sch.requests[rid]
            for g, i, b in ((g, i, b) for g, blocks in enumerate(groups)
                            for i, b in enumerate(blocks[: self.kv.num_hashed[rid]])):
                if b.block_hash is not None and b is not self.kv.pool.null_block:
                    assert b.block_hash == self.kv._key(g, req.block_hashes[i])
                    # the block's tokens are the request's tokens at that position
                    bs = self.kv.block_size
                    assert len(req.all_token_ids) >= (i + 1) * bs

    @invariant()
    def queues_are_disjoint_and_match_states(self):
        sch, kv = self.sch, self.kv
        running = {r.request_id for r in sch.running}
        waiting = [r for _, r in sch.waiting]
        waiting_ids = {r.request_id for r in waiting}
        assert len(running) == len(sch.running) and len(waiting_ids) == len(waiting)
        assert not running & waiting_ids
        assert running | waiting_ids == set(sch.requests)
        assert all(r.status is RequestStatus.RUNNING for r in sch.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED) for r in waiting)
        assert set(kv.swapped) == {r.request_id for r in waiting if r.status is RequestStatus.SWAPPED}
        assert set(kv.req_blocks) <= running
        keys = [k for k, _ in sch.waiting]
        assert len(keys) == len(set(keys))                                     # a total order: no ties
        assert sch.running == sorted(sch.running, key=lambda r: r.sort_key)
        assert sch.num_seqs() <= sch.cfg.max_num_seqs
        host = list(kv.host_free) + [h for groups in kv.swapped.values() for hs in groups for h in hs if h is not None]
        assert sorted(host) == list(range(kv.num_host_blocks))

    def teardown(self):
        if not hasattr(self, "sch"):
            return
        self._drain()
        for rid in list(self.users):
            for q in self.users.pop(rid):
                self.sch.abort(q.request_id)
        assert not self.sch.running and not self.sch.waiting and not self.sch.requests
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks[1:])
        assert self.kv.num_free_blocks == self.kv.pool.num_usable_blocks
        assert not self.kv.req_blocks and not self.kv.swapped


def test_scheduler_state_machine():
    RULES.clear()
    run_state_machine_as_test(SchedulerMachine, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    total = RULES["add"] + RULES["steps"] + RULES["abort"]
    print(f"\nstate machine: {total} rules ({dict(RULES)})")
    assert total >= 3000 and RULES["step"] >= 1000
    # the program reached every mechanism it is meant to check
    assert all(RULES[k] > 0 for k in ("preempted", "swapped_out", "copy_on_write", "evicted", "forked", "drafted",
                                      "rejected", "window_freed", "class_steps", "drained"))
