"""The continuous-batching scheduler. Each step forms one batch under a token budget:
running requests first (decodes and unfinished prefill chunks), then waiting requests in
priority order while their blocks fit. When the pool is full, the lowest-priority, most recently
admitted running request is preempted (recompute or swap). Plain Python: no torch.

With traffic classes (core/traffic.py) the order is class first, and each step also keeps every
class within its limits (`_StepLimits`): its running sequences, its share of the token budget, and,
while a class with an ITL target has running decodes, a prefill budget sized so the step's
predicted time (`step_cost`, the engine's fitted model) stays under the tightest target. A waiting
request of a higher class preempts running requests of lower classes when it lacks a slot or blocks
(lowest class, most recently admitted first, each in its class's preemption mode). No class starves
(a minimum share): class preemption never takes a class's last running sequence, and while a class
has waiting work and nothing running, higher classes leave a max_num_seqs slot free for it."""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.config import EngineArgs
from pagedserve.core.encoder_cache import EncoderCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus, fork_id
from pagedserve.core.spec_decode import SETUP_HORIZON, AcceptancePrior, Candidate, Drafting, SpecStats, \
    choose_drafts, ngram_match, update_acceptance
from pagedserve.core.step import DRAFT_PENDING, PoolRow, PromptLogprobsRow, ScheduledSeq, SchedulerOutput, \
    SeqUpdate
from pagedserve.core.traffic import MIN_PREFILL_CHUNK, StepHeadroom, TrafficClasses, TtftShare, \
    itl_floor_s, least_step_rows
from pagedserve.errors import CONTEXT_LENGTH_EXCEEDED, ParamError, QueueFullError

if TYPE_CHECKING:                             # numpy (the grammar's masks): not imported by the plain-Python core
    from pagedserve.core.grammar import GrammarCompiler

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "ScheduledSeq", "SeqUpdate", "QueueFullError",
           "build_kv_cache", "build_scheduler"]


_ARGS = EngineArgs.defaults()


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's slice of EngineArgs: the same names, and the defaults are EngineArgs' own."""

    max_num_batched_tokens: int = _ARGS["max_num_batched_tokens"]
    max_num_seqs: int = _ARGS["max_num_seqs"]
    max_model_len: int = 8192                    # EngineArgs' None resolves to the model's context, at most this
    enable_chunked_prefill: bool = _ARGS["enable_chunked_prefill"]
    long_prefill_token_threshold: int = _ARGS["long_prefill_token_threshold"]
    preemption_mode: str = _ARGS["preemption_mode"]
    max_waiting_requests: int | None = _ARGS["max_waiting_requests"]
    policy: str = _ARGS["scheduling_policy"]     # "continuous" | "static" (a batch runs until its longest member ends)
    max_loras: int = _ARGS["max_loras"]          # most LoRA adapters among running sequences (with enable_lora)

    @classmethod
    def from_args(cls, args: EngineArgs, max_model_len: int) -> SchedulerConfig:
        return cls(args.max_num_batched_tokens, args.max_num_seqs, max_model_len, args.enable_chunked_prefill,
                   args.long_prefill_token_threshold, args.preemption_mode, args.max_waiting_requests,
                   args.scheduling_policy, args.max_loras)


def build_kv_cache(args: EngineArgs, max_model_len: int, num_blocks: int, block_bytes: int,
                   windows: tuple[int, ...] = (0,)) -> KVCacheManager:
    """The KV cache manager of num_blocks blocks of block_bytes each, as EngineArgs ask (block size, prefix
    caching, contiguous reservation, host blocks for swap preemption in swap_space GiB): the engine's and the
    simulator's one way to build it."""
    classes = TrafficClasses.parse(args.traffic_classes)
    swaps = args.preemption_mode == "swap" or any(c.preemption_mode == "swap" for c in (classes or ()))
    num_host = int(args.swap_space * 2**30 // block_bytes) if swaps else 0
    reserve = max_model_len if args.kv_allocation == "contiguous" else None
    return KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching, num_host, reserve, windows=windows)


def build_scheduler(args: EngineArgs, max_model_len: int, kv: KVCacheManager, *,
                    clock: Callable[[], float] = time.monotonic, encoder: EncoderCacheManager | None = None,
                    step_cost: Callable[[list[tuple[int, int, int]]], float] | None = None,
                    grammar: GrammarCompiler | None = None, drafting: Drafting | None = None) -> Scheduler:
    """The scheduler as EngineArgs ask (its limits, policy, traffic classes), over kv (build_kv_cache): the
    engine's and the simulator's one way to build it. step_cost is kept only with traffic classes (nothing
    else reads it)."""
    classes = TrafficClasses.parse(args.traffic_classes)
    return Scheduler(SchedulerConfig.from_args(args, max_model_len), kv, clock, encoder, classes=classes,
                     step_cost=step_cost if classes is not None else None, grammar=grammar, drafting=drafting)


class Scheduler:
    """Configured once, in the constructor (build_scheduler: from EngineArgs, for the engine and the simulator
    alike); what it is built with does not change while it runs."""

    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 encoder: EncoderCacheManager | None = None, *, classes: TrafficClasses | None = None,
                 step_cost: Callable[[list[tuple[int, int, int]]], float] | None = None,
                 grammar: GrammarCompiler | None = None, drafting: Drafting | None = None):
        """encoder: a vision-language model's encoder cache and budget. classes: traffic classes (--traffic-classes).
        step_cost: predicted seconds of a step from its rows (start, tokens, samples), which sizes prefill under an
        ITL target (with classes). grammar: masks the rows of constrained requests. drafting: running sequences
        may draft tokens (speculative decoding)."""
        self.cfg = cfg
        self.kv = kv
        self.encoder = encoder
        self.clock = clock                        # injectable: the simulator runs on simulated time
        self.classes = classes
        self.step_cost = step_cost
        self.grammar = grammar
        self.drafting = drafting
        self.spec = drafting.spec if drafting is not None else None
        self.waiting: list[tuple[tuple[int, ...], Request]] = []   # heap on Request.sort_key (a total order)
        self.running: list[Request] = []          # kept sorted by (class, priority, arrival): victims come off the end
        self.requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.static_batch: set[str] = set()       # static policy: ids of the batch in flight (running or not)
        self.spec_stats = SpecStats()
        self.spec_prior = drafting.acceptance_prior() if drafting is not None else AcceptancePrior()
        self.last_limits: dict[str, str] = {}     # class name -> the limit that held it back in the last step
        # the share of a time target steps are planned under, kept by their measured times (observe_step_time):
        # one for steps an ITL target binds, one for those half a TTFT target binds; the last step's (share, target)
        self.headroom, self.ttft_headroom = StepHeadroom(), StepHeadroom()
        self.ttft_share = TtftShare()             # the share of a TTFT target a step may take, kept by first tokens
        self.planned: tuple[StepHeadroom, float] | None = None
        self._num_admitted = 0                    # waiting requests admitted in the step being formed
        # sequences that ended (any way) since the last schedule(): the next SchedulerOutput names them, so
        # the runner and the sampler drop what they keep per sequence (at most the requests of one step
        # plus those aborted or failed between two steps)
        self.finished_ids: list[str] = []

    def held(self) -> dict[str, int]:
        """Per-request entries (none once every request has finished)."""
        return {"scheduler.requests": len(self.requests), "scheduler.running": len(self.running),
                "scheduler.waiting": len(self.waiting), "scheduler.static_batch": len(self.static_batch),
                "scheduler.finished_ids": len(self.finished_ids),
                **(self.encoder.held() if self.encoder is not None else {})}

    # ------------------------------------------------------------ admission
    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Reject at once a request that could never run (ParamError names the field). A prompt with no room
        left for one token is the prompt's fault (OpenAI's context_length_exceeded); one that fits but not with
        its max_tokens is max_tokens' (as vLLM: that is what the client lowers), with the same code unless
        max_tokens alone is more than the context (then trimming the prompt would not help)."""
        total, limit = prompt_len + max_tokens, self.cfg.max_model_len
        if prompt_len < 1:
            raise ParamError("prompt", "prompt: must contain at least one token")
        if n > self.cfg.max_num_seqs:
            raise ParamError("n", f"n ({n}) exceeds max_num_seqs ({self.cfg.max_num_seqs}): each sample is a "
                                  f"running sequence")
        if prompt_len >= limit:
            raise ParamError("prompt", f"this model's maximum context length is {limit} tokens, and the prompt has "
                                       f"{prompt_len} (it must leave room for at least one output token): shorten "
                                       f"the prompt", CONTEXT_LENGTH_EXCEEDED)
        if total > limit:
            raise ParamError("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} "
                                           f"exceeds max_model_len ({limit}): max_tokens can be at most "
                                           f"{limit - prompt_len} here",
                             None if max_tokens > limit else CONTEXT_LENGTH_EXCEEDED)
        usable = self.kv.pool.num_usable_blocks
        asked = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens})"
        for field_, what, tokens in (("prompt", f"prompt ({prompt_len} tokens) + 1 output token", prompt_len + 1),
                                     ("max_tokens", asked, total)):
            need = self.kv.max_blocks_held(tokens, self.cfg.max_num_batched_tokens)
            if need > usable:
                raise ParamError(field_, f"{what} needs {need} KV blocks, more than the whole KV cache ({usable} "
                                         f"blocks of {self.kv.block_size} tokens)", CONTEXT_LENGTH_EXCEEDED)
        if not self.cfg.enable_chunked_prefill and prompt_len > self.cfg.max_num_batched_tokens:
            raise ParamError("prompt", f"prompt ({prompt_len} tokens) exceeds max_num_batched_tokens "
                                       f"({self.cfg.max_num_batched_tokens}) and chunked prefill is disabled")

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        cap = self.cfg.max_waiting_requests
        if cap is not None and len(self.waiting) >= cap:
            raise QueueFullError(f"the waiting queue is full ({cap} requests); retry later")
        if self.classes is not None:
            tc = self.classes[req.traffic_class]
            if tc.max_running is not None and req.num_samples > tc.max_running:
                raise ParamError("n", f"n ({req.num_samples}) exceeds max_running ({tc.max_running}) of traffic class "
                                      f"{tc.name!r}: each sample is a running sequence")
            if tc.max_waiting is not None and sum(r.traffic_class == req.traffic_class
                                                  for _, r in self.waiting) >= tc.max_waiting:
                raise QueueFullError(f"the waiting queue of traffic class {tc.name!r} is full ({tc.max_waiting} "
                                     f"requests); retry later")
        self.check_fits(req.num_prompt_tokens, req.max_tokens, req.num_samples)
        req.arrival_seq = next(self._seq)
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _fork(self, parent: Request, i: int) -> Request:
        """Sample i of an n > 1 request: shares the parent's blocks and runs from where it is."""
        seed = None if parent.generator_seed is None else (parent.generator_seed + i) % 2**64
        child = Request(fork_id(parent.request_id, i), parent.prompt_token_ids, parent.params, parent.max_tokens,
                        parent.eos_token_ids, parent.priority, parent.traffic_class, parent.arrival_time,
                        arrival_seq=parent.arrival_seq,
                        status=RequestStatus.RUNNING, num_computed_tokens=parent.num_computed_tokens, seq_index=i,
                        parent_id=parent.request_id, num_cached_tokens=parent.num_cached_tokens,
                        first_scheduled_time=parent.first_scheduled_time, generator_seed=seed,
                        prompt_logprobs_done=parent.prompt_logprobs_done,   # a recompute must not redo them
                        lora_id=parent.lora_id, mm_features=parent.mm_features)   # (a recompute reads its images)
        self.requests[child.request_id] = child
        self.kv.fork(parent, child)
        bisect.insort(self.running, child, key=_sort_key)   # lands right after its parent and siblings
        if self.cfg.policy == "static":
            self.static_batch.add(child.request_id)
        if parent.grammar is not None:            # the parent has not consumed its own first token yet
            child.grammar = parent.grammar.deep_copy()
        return child

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self.waiting, (req.sort_key, req))

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        plan: list[tuple[Request, int]] = []      # (request, tokens to compute), in scheduling order
        preempted: list[str] = []
        budget, self._num_admitted = self.cfg.max_num_batched_tokens, 0
        if self.encoder is not None:
            self.encoder.begin_step()
        if self.classes is None:
            budget = self._schedule_running(plan, preempted, budget, None)
            if not preempted:
                budget = self._schedule_waiting(plan, budget, None, preempted, self._waiting_head())
        else:                                     # class by class: its running requests, then its waiting ones
            lim = _StepLimits(self)
            order = [r for _, r in sorted(self.waiting, key=lambda e: e[0])]
            starved = {r.traffic_class for r in order if lim.running[r.traffic_class] == 0}
            for c in range(len(self.classes)):
                budget = self._schedule_running(plan, preempted, budget, lim, c)
                if not preempted and not lim.stopped:
                    reserve = sum(1 for k in starved if k > c)   # a slot kept for each starved class below
                    budget = self._schedule_waiting(plan, budget, lim, preempted,
                                                    (r for r in order if r.traffic_class == c), reserve)
            self._rebuild_waiting()
            self.last_limits = lim.held
        drafts = self._drafts(plan, budget) if self.spec is not None and budget > 0 else {}
        plan.sort(key=lambda p: p[1] != 1)        # decodes (with their drafts) first: the runner batches them
        seqs = tuple(self._scheduled(req, n, drafts.get(req.request_id, ())) for req, n in plan)
        constrained = tuple(s.request_id for s in seqs if s.sampling is not None
                            and self.requests[s.request_id].grammar is not None)
        mask = self.grammar.fill_bitmask([self.requests[r].grammar for r in constrained]) if constrained else None
        finished, self.finished_ids = tuple(self.finished_ids), []
        return SchedulerOutput(seqs, self.kv.take_ops(), tuple(preempted), constrained, mask,
                               num_admitted=self._num_admitted, finished_req_ids=finished,
                               encoder_frees=self.encoder.take_frees() if self.encoder is not None else ())

    def _drafts(self, plan: list[tuple[Request, int]], budget: int) -> dict[str, tuple[int, ...]]:
        """Speculative decoding: draft tokens for the step's decodes, from what is left of the token
        budget once every running and admitted sequence has its share (drafts never delay a prompt),
        as spec_decode.choose_drafts decides; only where the slots allocate (drafts never preempt).
        A step without drafts lets the engine-wide acceptance prior drift back (AcceptancePrior)."""
        base_tokens = sum(1 for req, n in plan if req.num_computed_tokens + n >= req.num_tokens)
        # the step's cost: its one-row entries by the table (decode rows), its prefill chunks' rows at the
        # measured cost of a chunk row
        base_rows = sum(1 for _, n in plan if n == 1)
        d = self.drafting
        fixed = sum(n for _, n in plan if n > 1) * d.prefill_row_s
        cost, dcost, out = d.cost, d.draft_cost, {}
        # no lookups when not even sure draft tokens pay for their rows (and a draft model's passes)
        k = self.spec.num_speculative_tokens
        base_s, pass_s = (cost(base_rows) + fixed, dcost(1) if dcost is not None else 0.0) if cost is not None \
            else (0.0, 0.0)
        if cost is None or any((base_tokens + m) * base_s > base_tokens * (cost(base_rows + m) + fixed + m * pass_s)
                               for m in range(1, k + 1)):
            cands = self._candidates(plan)
            if dcost is not None and cost is not None and any(c.setup_s for c in cands):
                self._spread_readings(cands, base_rows, base_tokens, budget)
            chosen = choose_drafts(cands, base_rows, base_tokens, cost, budget, dcost, fixed)
            if not chosen and cands and cost is not None and budget > 0:
                chosen = self._probe(cands, base_rows, budget)
            for i, n in chosen.items():
                if self.kv.allocate_slots(cands[i].request, 1 + n):
                    out[cands[i].request.request_id] = tuple(cands[i].draft[:n])
                    cands[i].request.spec_length = cands[i].length
        if not out:
            self.spec_prior.idle_step(base_s if plan else 0.0)
        return out

    def _spread_readings(self, cands: list[Candidate], base_rows: int, base_tokens: int, budget: int) -> None:
        """A draft model's reading lets a sequence draft for the rest of its output, but only where it
        would go on drafting: a candidate the rule takes in this step's decodes alone (no prefill, no
        reading) is charged the share of its reading that this step's tokens are of those left to
        generate (at most SETUP_HORIZON); any other pays it whole (spec_decode's module docstring)."""
        steady = choose_drafts([Candidate(c.request, c.draft, c.acceptance) for c in cands], base_rows, base_tokens,
                               self.drafting.cost, budget, self.drafting.draft_cost)
        for i in steady:
            req, c = cands[i].request, cands[i]
            left = min(req.max_tokens - req.num_output_tokens, SETUP_HORIZON)
            c.setup_s *= min(1.0, (1 + len(c.draft)) / max(1, left))

    def _reading_s(self, req: Request) -> float:
        """A draft model's seconds to read the context its KV lacks."""
        return (req.num_computed_tokens - req.num_draft_computed) * self.drafting.draft_read_s

    def _probe(self, cands: list[Candidate], base_rows: int, budget: int) -> dict[int, int]:
        """A probe (spec_decode's module docstring): the candidate of the cheapest reading, its whole
        proposal, when the prior allows one at its whole cost (the reading counted in full)."""
        cost, dcost = self.drafting.cost, self.drafting.draft_cost
        i = min(range(len(cands)), key=lambda i: (cands[i].setup_s, -cands[i].acceptance))
        n = min(len(cands[i].draft), budget)
        extra = max(0.0, cost(base_rows + n) - cost(base_rows)) + self._reading_s(cands[i].request) + (
            n * dcost(1) if dcost is not None else 0.0)
        return {i: n} if self.spec_prior.may_probe(extra) else {}

    def _candidates(self, plan: list[tuple[Request, int]]) -> list[Candidate]:
        """The step's decodes that have a proposal. Not sequences a grammar constrains (their masks are
        made for one token), nor a request's first token while it still has to fork (n > 1)."""
        spec, cands = self.spec, []
        for req, n in plan:
            past_prompt = req.num_computed_tokens + 1 == req.num_tokens
            if n != 1 or not past_prompt or req.grammar is not None or req.num_pending_forks:
                continue
            room = min(spec.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                       self.cfg.max_model_len - req.num_tokens - 1)
            setup, length = 0.0, 0
            if spec.method == "draft_model":    # the runner's draft model proposes them (ScheduledSeq.draft_prefix)
                draft = [DRAFT_PENDING] * room
                setup = self._reading_s(req)
            else:
                draft, length = ngram_match(req.all_token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, room)
            if draft:
                cands.append(Candidate(req, draft, self.spec_prior.of(req, length), setup, length))
        return cands

    def _scheduled(self, req: Request, n: int, draft: tuple[int, ...] = ()) -> ScheduledSeq:
        """The step's record of one sequence; advances its progress counters (past its draft tokens
        too: update_from_output moves them back to what was accepted)."""
        start = req.num_computed_tokens
        plp = None
        if req.params.prompt_logprobs is not None:   # rows at positions lo..hi-1 predict prompt tokens lo+1..hi
            lo, hi = max(start, req.prompt_logprobs_done), min(start + n, req.num_prompt_tokens - 1)
            if hi > lo:
                plp = PromptLogprobsRow(lo - start, tuple(req.prompt_token_ids[lo + 1:hi + 1]),
                                        req.params.prompt_logprobs)
                req.prompt_logprobs_done = hi
        pool = None
        if req.pooling is not None:                  # the prompt positions this chunk pools, each once
            first = {"LAST": req.num_prompt_tokens - 1, "CLS": 0}.get(req.pooling.pooling_type, 0)
            end = req.num_prompt_tokens if req.pooling.pooling_type == "MEAN" else first + 1
            lo, hi = max(start, req.pooled_done, first), min(start + n, end)
            if hi > lo:
                pool, req.pooled_done = PoolRow(lo - start, hi - lo, req.pooling if hi == end else None), hi
        prefix = None
        if draft and draft[0] == DRAFT_PENDING:      # the draft model first reads what its KV lacks
            prefix = tuple(req.all_token_ids[req.num_draft_computed:start])
        mm = self.encoder.use(req, start, n) if req.mm_features and start < req.mm_features[-1].end else ()
        seq = ScheduledSeq.of(req, start, n, self.kv.take_table_delta(req.request_id), start + n == req.num_tokens,
                              plp, pool, draft, prefix, mm)
        req.num_computed_tokens += n + len(draft)
        return seq

    def _chunk(self, req: Request, budget: int, num_computed: int | None = None,
               lim: _StepLimits | None = None) -> int:
        """Tokens req computes this step; with classes, within its class's share of the budget and cut to
        the step's time target (0: none fit)."""
        done = req.num_computed_tokens if num_computed is None else num_computed
        if lim is not None:
            budget = lim.allowance(req, budget)
        n = most = min(req.num_tokens - done, budget)
        if self.cfg.enable_chunked_prefill and n > 1:
            n = min(n, self.cfg.long_prefill_token_threshold)
            if lim is not None:
                n = lim.fit(req, done, n)
        # images beyond the step's encoder budget wait for a later step (past the last image: nothing to check)
        if req.mm_features and n > 0 and done < req.mm_features[-1].end:
            n = self.encoder.cut(req, done, self.encoder.whole(req, done, n, most))
        return n

    def _schedule_running(self, plan: list, preempted: list[str], budget: int, lim: _StepLimits | None,
                          klass: int | None = None) -> int:
        """Running requests (of one class, with classes) in order: decodes and prefill chunks. When
        blocks run out the last running request (lowest class, most recently admitted) is preempted.
        Under an ITL target, a class without a target of its own goes longest-waiting first, and its
        decodes that would push the step past the target wait for a later step (one always runs)."""
        order = [r for r in self.running if klass is None or r.traffic_class == klass]
        deferrable = lim is not None and lim.target is not None and self.classes[klass].itl_p99_ms is None
        if deferrable:
            order.sort(key=lambda r: r.last_token_time or 0.0)
        for req in order:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or (lim is not None and req.request_id in lim.rows):
                continue                          # preempted below, or admitted earlier in this step
            if deferrable and req.num_computed_tokens + 1 == req.num_tokens and lim.defer(req):
                continue
            n = self._chunk(req, budget, lim=lim)
            if n <= 0 or (not self.cfg.enable_chunked_prefill and n < req.num_tokens - req.num_computed_tokens):
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]         # lowest priority, most recently admitted
                budget += self._evict(victim, plan, preempted, lim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:    # preempted itself: nothing below it runs either
                continue
            plan.append((req, n))
            if lim is not None:
                lim.take(req, req.num_computed_tokens, n)
            budget -= n
        return budget

    def _rebuild_waiting(self) -> None:
        """The queue without the requests admitted this step (with classes they are taken from a snapshot,
        not popped), each request once (one admitted and preempted again in the same step was pushed anew)."""
        seen: set[int] = set()
        keep = []
        for k, r in self.waiting:
            if r.status is not RequestStatus.RUNNING and id(r) not in seen:
                seen.add(id(r))
                keep.append((r.sort_key, r))
        heapq.heapify(keep)
        self.waiting = keep

    def _waiting_head(self) -> Iterator[Request]:
        """The queue's head, again and again (the caller pops what it admits, or stops)."""
        while self.waiting:
            yield self.waiting[0][1]

    def _schedule_waiting(self, plan: list, budget: int, lim: _StepLimits | None, preempted: list[str],
                          candidates: Iterator[Request], reserve: int = 0) -> int:
        """Admit waiting requests in the order given while slots, blocks and budget allow. With classes
        (the candidates are one class's), a request lacking a slot or blocks may preempt running requests
        of lower classes; a class held by its own limits stops, its requests keeping their order; one
        lacking blocks stops every class after it. `reserve`: slots kept for lower classes that have
        waiting work and nothing running (their minimum share)."""
        static = self.cfg.policy == "static"
        if static and not self.static_batch:
            # static batching: the next max_num_seqs waiting requests form a batch; nothing else is
            # admitted until its last member finishes (members still join as budget and blocks allow)
            self.static_batch = {r.request_id for _, r in heapq.nsmallest(self.cfg.max_num_seqs, self.waiting)}
        slots, num_seqs = self.cfg.max_num_seqs - reserve, self.num_seqs()
        skipped: list[Request] = []               # waiting on a LoRA slot: later requests may pass them
        for req in candidates:
            if budget <= 0:
                break
            if static and req.request_id not in self.static_batch:
                break
            if req.lora_id and not self._lora_fits(req.lora_id):
                if lim is None:                   # out of the queue while the pass goes on; pushed back below
                    skipped.append(heapq.heappop(self.waiting)[1])
                continue
            if lim is not None and lim.blocked(req):
                break                             # its class's own limit: its later requests wait too
            while num_seqs + 1 + req.num_pending_forks > slots:
                freed = None if lim is None else self._preempt_lower(req, plan, preempted, lim)
                if freed is None:
                    break
                budget, num_seqs = budget + freed, self.num_seqs()
            if num_seqs + 1 + req.num_pending_forks > slots:
                if lim is not None:
                    lim.held.setdefault(self.classes[req.traffic_class].name, "max_num_seqs" if not reserve else
                                        f"max_num_seqs ({reserve} kept for lower classes with nothing running)")
                break
            n = self._admit(req, budget, plan, preempted, lim)
            if not n:                             # no blocks (None) or no prefill time (0) for it
                if lim is not None:
                    lim.stop(req, "no free KV blocks" if n is None else "no prefill time left (ITL target)")
                break
            if lim is None:
                heapq.heappop(self.waiting)       # with classes the queue is rebuilt after the step's plan
            self._num_admitted += 1
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            bisect.insort(self.running, req, key=_sort_key)
            plan.append((req, n))
            budget -= n
            num_seqs = self.num_seqs()            # _admit may have preempted lower classes for blocks
            if lim is not None:
                lim.take(req, req.num_computed_tokens, n, admitted=True)
        for req in skipped:
            self._push_waiting(req)
        return budget

    def _lora_fits(self, lora_id: int) -> bool:
        """Whether a sequence of this adapter can run beside the running ones: its adapter already
        runs, or fewer than max_loras adapters do (the runner has max_loras slots)."""
        active = {r.lora_id for r in self.running} - {0}
        return lora_id in active or len(active) < self.cfg.max_loras

    def _admit(self, req: Request, budget: int, plan: list, preempted: list[str], lim: _StepLimits | None) -> int | None:
        """Blocks for a waiting request's first chunk (its swapped blocks back, or its prefix hits and new
        blocks); with classes, lower classes are preempted while that fails. Its chunk, 0 when an ITL
        target leaves no prefill time, or None when it does not fit."""
        if req.status is RequestStatus.SWAPPED:
            n = self._chunk(req, budget, lim=lim)
            if n <= 0:
                return 0
            if not self.kv.swap_in(req):
                return None
            if not self.kv.allocate_slots(req, n):
                self.kv.free(req)                 # cannot happen often: undo, recompute later
                req.num_computed_tokens, req.status = 0, RequestStatus.PREEMPTED
                return None
            return n
        while True:
            computed, num_hit = self.kv.get_computed_blocks(req)
            n = self._chunk(req, budget, num_hit, lim)
            if n <= 0:
                return 0
            if not self.cfg.enable_chunked_prefill and n < req.num_tokens - num_hit:
                return None
            if self.kv.allocate_slots(req, n, computed):
                break
            if lim is None or self._preempt_lower(req, plan, preempted, lim) is None:
                return None
        self.kv.record_prefix_lookup(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        return n

    def _preempt_lower(self, req: Request, plan: list, preempted: list[str], lim: _StepLimits) -> int | None:
        """Preempt one running sequence of a class below req's: the lowest class, most recently admitted
        first, never a class's last running sequence (the minimum share). The tokens it gives back to
        the step's budget, or None when there is none to preempt."""
        for victim in reversed(self.running):
            c = victim.traffic_class
            if c <= req.traffic_class:
                return None                       # running is in class order: nothing lower is left
            if lim.running[c] - 1 - victim.num_pending_forks >= 1:
                return self._evict(victim, plan, preempted, lim)
        return None

    def _evict(self, victim: Request, plan: list, preempted: list[str], lim: _StepLimits | None) -> int:
        """Preempt a running request; if this step had planned it, its rows leave the plan. The
        tokens that gives back to the step's budget."""
        freed = 0
        for k, (r, n) in enumerate(plan):
            if r is victim:
                del plan[k]
                freed = n
                if lim is not None:
                    lim.untake(victim, n)
                break
        self._preempt(victim, preempted, lim)
        return freed

    def num_seqs(self) -> int:
        """Running sequences, counting the forks an n > 1 request adds at its first token."""
        return len(self.running) + sum(r.num_pending_forks for r in self.running)

    def _preempt(self, req: Request, preempted: list[str], lim: _StepLimits | None = None) -> None:
        self.running.remove(req)
        mode = self.cfg.preemption_mode
        if lim is not None:
            lim.running[req.traffic_class] -= 1 + req.num_pending_forks
            mode = self.classes[req.traffic_class].preemption_mode or mode
        req.num_draft_computed = 0               # a draft model's KV is neither kept nor swapped: it reads again
        if self.encoder is not None:
            self.encoder.release(req.request_id)
        if mode == "swap" and self.kv.can_swap_out(req):
            self.kv.swap_out(req)
            req.status = RequestStatus.SWAPPED
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        preempted.append(req.request_id)
        self._push_waiting(req)

    # ------------------------------------------------------------ after the step
    def update_from_output(self, so: SchedulerOutput, sampled: dict[str, list[int]]) -> Iterator[SeqUpdate]:
        """Apply the runner's sampled tokens: fork n > 1 requests at their first token, append, and
        finish on EOS, a stop token or length. Each token is applied as its update is taken (a sequence
        ended meanwhile takes no more); the engine core takes them all, and a stop string its frontend
        finds later in a speculative run ends the sequence then (finish()), its text and tokens cut there."""
        now = self.clock()
        for s in so.seqs:
            tokens = sampled.get(s.request_id)
            req = self.requests.get(s.request_id)
            if not tokens or req is None or req.status is not RequestStatus.RUNNING:
                continue
            if s.num_draft:
                yield from self._apply_run(req, s, tokens, now)
                continue
            for i, tok in enumerate(tokens[1:], start=1):
                yield self._apply_token(self._fork(req, i), req.request_id, i, tok, now, forked=True)
            yield self._apply_token(req, req.request_id, 0, tokens[0], now)

    def _apply_run(self, req: Request, s: ScheduledSeq, tokens: list[int], now: float) -> Iterator[SeqUpdate]:
        """A speculative step's tokens: the accepted drafts, then the runner's own. The sequence's
        progress moves back to the accepted ones and the blocks that held only rejected drafts return
        to the pool; its tokens are applied one by one while it runs."""
        accepted = len(tokens) - 1
        self.spec_stats.record(s.num_draft, accepted)
        self.spec_prior.update(s.num_draft, accepted, req.spec_length)
        update_acceptance(req, s.num_draft, accepted)
        req.num_computed_tokens = s.start + 1 + accepted
        if s.draft_prefix is not None:   # the draft model read up to its last draft's input (not the draft itself)
            req.num_draft_computed = min(req.num_computed_tokens, s.start + s.num_draft)
        self.kv.trim(req, req.num_computed_tokens + 1)
        for i, tok in enumerate(tokens):
            if req.status is not RequestStatus.RUNNING:
                return
            yield self._apply_token(req, req.request_id, i, tok, now)

    def _apply_token(self, req: Request, row_id: str, k: int, tok: int, now: float, forked: bool = False) -> SeqUpdate:
        if req.first_token_time is None:
            req.first_token_time = now
            if self.classes is not None and not forked:
                target = self.classes[req.traffic_class].ttft_p99_ms
                if target is not None:
                    self.ttft_share.observe(now - req.arrival_time, target / 1e3)
        req.last_token_time = now
        req.append_token(tok)
        p = req.params
        status = None
        if req.grammar is not None:
            req.grammar.consume_token(tok)        # the mask allowed tok; EOS is allowed once the grammar accepts
        if req.num_output_tokens >= p.min_tokens and (tok in req.eos_token_ids or tok in p.stop_token_ids):
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok if tok in p.stop_token_ids else None
        elif req.grammar is not None and req.grammar.is_stopped():
            status = RequestStatus.FINISHED_STOPPED   # the grammar is complete: nothing may follow
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish(req, status)
        return SeqUpdate(req, row_id, k, tok, status is not None, forked)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Leave the batch now: free blocks, drop from whichever queue holds it (a no-op on a request
        that already finished). The one way a sequence ends: by its tokens here, a stop string found
        by the frontend (EngineCore.finish), an abort or a failure."""
        if req.status.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting = [(k, r) for k, r in self.waiting if r is not req]
            heapq.heapify(self.waiting)
        req.status = status
        self.kv.free(req)
        if self.encoder is not None:
            self.encoder.release(req.request_id)
        self.requests.pop(req.request_id, None)
        self.static_batch.discard(req.request_id)
        self.finished_ids.append(req.request_id)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def class_name(self, req: Request) -> str | None:
        return None if self.classes is None else self.classes[req.traffic_class].name

    def class_summary(self) -> list[dict] | None:
        """Per traffic class: its settings, running and waiting requests, and the limit that held it back
        in the last step (None without classes)."""
        if self.classes is None:
            return None
        running, waiting = [0] * len(self.classes), [0] * len(self.classes)
        for r in list(self.running):
            running[r.traffic_class] += 1
        for _, r in list(self.waiting):
            waiting[r.traffic_class] += 1
        limits, floor = dict(self.last_limits), self.itl_floor_s()
        return [{**d, "running": nr, "waiting": nw, "held_by": limits.get(d["name"]),
                 "itl_floor_ms": None if floor is None or d["itl_p99_ms"] is None else round(floor * 1e3, 1)}
                for d, nr, nw in zip(self.classes.describe(), running, waiting)]

    def observe_step_time(self, seconds: float) -> None:
        """The measured time of the step schedule() last formed (the engine's, or the simulator's model): where a
        time target bound it, it moves that target's planning share (StepHeadroom)."""
        if self.planned is not None:
            self.planned[0].observe(seconds, self.planned[1])

    def itl_floor_s(self) -> float | None:
        """The least ITL target the host can hold now (traffic.least_step_rows on the running and waiting
        requests, by the step-time model), or None without classes with an ITL target or a fitted model."""
        cls = self.classes
        if cls is None or cls.itl_target_s is None or self.step_cost is None:
            return None
        targeted, others, starts = [], [[] for _ in cls.classes], []
        for r in list(self.running):
            if r.num_computed_tokens + 1 < r.num_tokens:    # a prompt (or a recompute) still computing
                starts.append(r.num_computed_tokens)
            elif cls[r.traffic_class].itl_p99_ms is not None:
                targeted.append(r.num_computed_tokens)
            else:
                others[r.traffic_class].append(r.num_computed_tokens)
        starts += [r.num_computed_tokens for _, r in list(self.waiting)]
        return itl_floor_s(self.step_cost, least_step_rows(targeted, others, starts))

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def waiting_reason(self, req: Request) -> str:
        """Why a waiting request is not running (for /debug/scheduler)."""
        ahead = [r for _, r in self.waiting if r.sort_key < req.sort_key]
        if self.classes is not None:
            name = self.classes[req.traffic_class].name
            if name in self.last_limits:
                return f"traffic class {name}: {self.last_limits[name]}"
            if any(r.traffic_class < req.traffic_class for r in ahead):
                return "a higher traffic class is waiting"
        if self.cfg.policy == "static" and self.static_batch and req.request_id not in self.static_batch:
            return "static batch in flight"
        if self.num_seqs() + 1 + req.num_pending_forks > self.cfg.max_num_seqs:
            return "max_num_seqs reached"
        if req.lora_id and not self._lora_fits(req.lora_id):
            return f"max_loras ({self.cfg.max_loras}) other LoRA adapters are running"
        if ahead and any(r.priority < req.priority for r in ahead):
            return "lower priority"
        need = self.kv.new_blocks_needed(req.num_tokens - req.num_computed_tokens)
        if need > self.kv.num_free_blocks:
            return "no free KV blocks"
        if ahead:
            return "queued behind earlier requests (token budget used)"
        return "token budget used"


def _sort_key(r: Request) -> tuple[int, ...]:
    return r.sort_key


_CHUNK = object()                                 # _StepLimits.forced's key for the step's forced prefill chunk


class _StepLimits:
    """One step's accounting of traffic classes: sequences running and tokens taken per class, the rows
    planned so far (for the step-time prediction under an ITL target), and the limit that held each
    class back (shown in /debug/scheduler)."""

    def __init__(self, sch: Scheduler):
        cls = self.classes = sch.classes
        budget = sch.cfg.max_num_batched_tokens
        self.cap = [None if c.max_budget_share is None else max(1, int(c.max_budget_share * budget))
                    for c in cls.classes]
        self.tokens = [0] * len(cls)              # tokens each class takes in this step
        self.running = [0] * len(cls)             # sequences running per class (pending forks counted)
        for r in sch.running:
            self.running[r.traffic_class] += 1 + r.num_pending_forks
        self.rows: dict[str, tuple[int, int, int]] = {}   # request id -> (start, tokens, samples)
        self.prefill = 0                          # prefill tokens granted in this step
        self.decodes = [0] * len(cls)             # decodes per class in this step
        self.cost = sch.step_cost
        # the step's time target: the tightest ITL target among classes with running decodes (a decode: a
        # request past its prompt), and always a share of any TTFT target (an arrival waits for the step in
        # flight, then needs its own): at most TTFT_STEP_SHARE, less while first tokens come late (TtftShare)
        itl = [cls[r.traffic_class].itl_p99_ms for r in sch.running
               if r.output_token_ids and cls[r.traffic_class].itl_p99_ms is not None]
        ttft = [sch.ttft_share.value * c.ttft_p99_ms for c in cls.classes if c.ttft_p99_ms is not None]
        self.target = sch.planned = None
        if self.cost is not None and (itl or ttft):
            bound = min(itl + ttft) / 1e3
            share = sch.headroom if itl and min(itl) <= min(ttft, default=math.inf) else sch.ttft_headroom
            sch.planned = (share, bound)
            self.target = bound * share.value
        # the one-token rows the step will carry whatever comes first (issue 54: a prefill chunk sized before
        # them pushed the step past the target): every decode of a class with an ITL target, and one of each
        # other class (its deepest); each leaves this map when its class's decode is planned. A prompt's last
        # token is such a row too (one token that samples: `defer` treats it as a decode, `fit` never cuts it)
        # And the step's one forced prefill chunk (prompts never stall) where a prompt has tokens left, at the
        # deepest such start: counted before the decodes of classes without a target, as least_step_rows counts it
        self.forced: dict[object, tuple[int, int, int]] = {}
        if self.target is not None:
            deepest = -1
            for r in sch.running:
                if r.num_computed_tokens + 1 == r.num_tokens:
                    c, row = r.traffic_class, (r.num_computed_tokens, 1, 1)
                    if cls[c].itl_p99_ms is not None:
                        self.forced[r.request_id] = row
                    elif row > self.forced.get(c, (-1, 0, 0)):
                        self.forced[c] = row
                elif r.num_computed_tokens + 1 < r.num_tokens:
                    deepest = max(deepest, r.num_computed_tokens)
            if sch.waiting and sch.num_seqs() < sch.cfg.max_num_seqs:
                deepest = max(deepest, max(r.num_computed_tokens for _, r in sch.waiting))
            if deepest >= 0:
                self.forced[_CHUNK] = (deepest, MIN_PREFILL_CHUNK, 1)
        self.held: dict[str, str] = {}            # class name -> what held it back
        self.stopped = False                      # a class lacked slots or blocks: no class after it is admitted

    def allowance(self, req: Request, budget: int) -> int:
        cap = self.cap[req.traffic_class]
        return budget if cap is None else min(budget, cap - self.tokens[req.traffic_class])

    def blocked(self, req: Request) -> bool:
        """Its class's own limits hold a waiting request back (max_running, max_budget_share)."""
        c = self.classes[req.traffic_class]
        if c.max_running is not None and self.running[req.traffic_class] + 1 + req.num_pending_forks > c.max_running:
            self.held.setdefault(c.name, f"max_running ({c.max_running})")
            return True
        if self.allowance(req, 1) <= 0:
            self.held.setdefault(c.name, f"max_budget_share ({c.max_budget_share:g})")
            return True
        return False

    def fit(self, req: Request, start: int, n: int) -> int:
        """A prefill chunk of n tokens at `start`, cut so the step's predicted time stays under the ITL
        target (a step's first prefill chunk always gets up to MIN_PREFILL_CHUNK tokens: prompts never stall)."""
        if self.target is None or n <= 1:
            return n
        if not self.prefill:                      # this is the step's forced chunk: counted as itself now
            self.forced.pop(_CHUNK, None)

        def over(k: int) -> bool:
            return self.over((start, k, 1 if start + k >= req.num_tokens else 0))
        if not over(n):
            return n
        lo = floor = min(n, MIN_PREFILL_CHUNK) if not self.prefill else 0   # one forced chunk a step, not two
        if floor < n and not over(floor):
            hi = n                                # over(lo) is False, over(hi) is True
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if not over(mid) else (lo, mid)
        self.held.setdefault(self.classes[req.traffic_class].name, f"prefill cut to {lo} tokens by the ITL target")
        return lo

    def over(self, row: tuple[int, int, int]) -> bool:
        """The step planned so far plus `row` would pass the time target."""
        return self.cost([*self.rows.values(), *self.forced.values(), row]) > self.target

    def defer(self, req: Request) -> bool:
        """A decode of a class without an ITL target waits if it would push the step's predicted time
        past the target, unless its class has no decode in this step yet."""
        c = req.traffic_class
        if not self.decodes[c] or not self.over((req.num_computed_tokens, 1, 1)):
            return False                          # (its class's first decode is counted in `forced` till then)
        self.held.setdefault(self.classes[c].name, "decodes deferred by the ITL target")
        return True

    def take(self, req: Request, start: int, n: int, admitted: bool = False) -> None:
        c = req.traffic_class
        self.tokens[c] += n
        self.rows[req.request_id] = (start, n, 1 if start + n >= req.num_tokens else 0)
        if n > 1 or start + n < req.num_tokens:
            self.prefill += n
            self.forced.pop(_CHUNK, None)
        else:
            self.decodes[c] += 1
            self.forced.pop(req.request_id, None)
            self.forced.pop(c, None)
        if admitted:
            self.running[c] += 1 + req.num_pending_forks

    def untake(self, req: Request, n: int) -> None:
        start, _, _ = self.rows.pop(req.request_id)
        self.tokens[req.traffic_class] -= n
        if n > 1 or start + n < req.num_tokens:
            self.prefill -= n
        else:
            self.decodes[req.traffic_class] -= 1

    def stop(self, req: Request, why: str) -> None:
        self.held.setdefault(self.classes[req.traffic_class].name, why)
        self.stopped = True
