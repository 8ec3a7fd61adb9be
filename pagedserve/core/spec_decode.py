"""Speculative decoding's plain-Python half: the n-gram proposer and the per-step rule that decides
how many draft tokens each running sequence computes. The sampler verifies (runner/sampler.py:
accepted_run).

The rule (adaptive): a draft token is worth its row when the tokens it is expected to add raise the
step's tokens per second. For sequence j with acceptance estimate a_j, its i-th draft token is
accepted (and so adds a token) with probability a_j^i. a_j (AcceptancePrior.of) is the sequence's own
recent acceptance, shrunk toward the engine-wide rate of drafts like this one: for n-gram drafts, those
proposed by an n-gram of the same length. Candidates are sorted by that probability
and the step takes the prefix m that maximises

    (tokens the step yields without drafts + sum of the first m probabilities) / T(rows + m)

where T(R) is the step time at R rows, measured on this host at start-up (`StepCostTable`). m = 0
(no drafts) wins whenever the measured T rises faster than the expected tokens: large batches on
a compute-bound CPU, or sequences whose drafts keep being rejected. With a draft model the cost of
proposing is added: its pass j runs the sequences that draft at least j tokens, D(rows) each, also
measured at start-up, so the denominator is T(rows + m) + sum over passes of D(sequences in it),
plus, for each sequence that drafts, the draft model reading the context its KV lacks (R seconds a
token, measured too; the whole prompt at a sequence's first draft). That reading lets the sequence
draft for the rest of its output where it would go on drafting: if the rule takes the candidate in
the step's decodes alone (no prefill chunks, no reading: the steady state), the step is charged the
share of the reading that its tokens are of the tokens left to generate, at most SETUP_HORIZON (5
tokens with 100 left: 5 %); otherwise the whole reading (a big batch that would stop drafting the
next step never pays for reading a context to draft once). A step's prefill chunks count at the
measured cost of a chunk row (fixed: drafts or not), its decodes by T.

Probes: the prior may never pay while the drafts would be accepted far more often than it assumes.
After PROBE_EVERY steps without a draft, one sequence drafts anyway when what it costs (its rows, a
draft model's passes and reading) is at most PROBE_SHARE of the step time spent since the last
draft (the reading counted whole here); its outcome moves the prior."""
from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field

from pagedserve.config import SpeculativeConfig

PRIOR_ACCEPTANCE = {        # the engine-wide estimate at start, and where it drifts back to while nothing drafts:
    "ngram": 0.6,           # n-gram lookups, measured on our workloads (BENCHMARKS.md: 0.2 to 0.75)
    "draft_model": 0.8,     # a draft model is chosen to agree with its target (a failure moves it fast)
}
DECAY = 0.8                 # per verified draft of a sequence: older outcomes weigh less (its text changes)
GLOBAL_DECAY = 0.98         # per verified draft, engine-wide
DRIFT = 0.01                # per step without a draft, the engine-wide estimate moves this share back to the prior
PROBE_EVERY = 32            # after this many steps without a draft, one sequence may draft anyway (a probe) ...
PROBE_SHARE = 0.03          # ... when it costs at most this share of the step time since the last draft
SETUP_HORIZON = 128         # a draft model's reading is spread over at most this many of a sequence's tokens


@dataclass(slots=True, frozen=True)
class Drafting:
    """Speculative decoding as the scheduler is built with it: the method (config.SpeculativeConfig) and,
    for adaptive drafting, the step costs measured at start-up (measure_step_costs, measure_draft_costs)."""

    spec: SpeculativeConfig
    cost: StepCostTable | None = None        # the target's step seconds by rows (None: draft whenever proposed)
    prefill_row_s: float = 0.0               # ... and its seconds per prefill chunk row
    draft_cost: StepCostTable | None = None  # the draft model's proposing pass by rows (draft_model)
    draft_read_s: float = 0.0                # ... and its seconds per context token read (its KV's catch-up)
    prior: float | None = None               # the engine-wide acceptance at start (None: PRIOR_ACCEPTANCE's)

    def acceptance_prior(self) -> AcceptancePrior:
        return AcceptancePrior(PRIOR_ACCEPTANCE[self.spec.method] if self.prior is None else self.prior)


def propose_ngram(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram (n_max down to
    n_min) ending `tokens`; [] when none occurred before."""
    return ngram_match(tokens, n_min, n_max, k)[0]


def ngram_match(tokens: list[int], n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
    """propose_ngram's tokens and the length n of the n-gram that found them (0: none). Searched as
    bytes (C speed): 4 per token."""
    L = len(tokens)
    if L < n_min + 1 or k < 1:
        return [], 0
    buf = array("i", tokens).tobytes()
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pat = buf[4 * (L - n):]
        end = 4 * (L - 1)                   # the match must end before the last token: an earlier occurrence
        while True:
            at = buf.rfind(pat, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                j = at // 4 + n              # the token after the match
                return tokens[j:j + k], n
            end = at + len(pat) - 1         # a misaligned hit: look further left
    return [], 0


@dataclass(slots=True)
class StepCostTable:
    """Step seconds by rows computed, measured at start-up (the best of two runs); piecewise linear
    between the measured points, extended past the last one by the last slope. Not forced to rise
    with rows: on an AVX2 host MKL's float32 GEMM takes a matrix-vector path for one row and 2 or 3
    rows cost more than 5 or 8 (measured: 1 row 41 ms, 2: 74, 3: 94, 5: 71, 8: 69), which the rule
    should see."""

    rows: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def __call__(self, r: int) -> float:
        rows, sec = self.rows, self.seconds
        i = bisect_left(rows, r)
        if i < len(rows) and rows[i] == r:
            return sec[i]
        if i == 0:
            return sec[0]
        if i == len(rows):
            i -= 1
        r0, r1, t0, t1 = rows[i - 1], rows[i], sec[i - 1], sec[i]
        return t0 + (t1 - t0) * (r - r0) / (r1 - r0)

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.rows, self.seconds))


@dataclass(slots=True)
class Candidate:
    """A sequence that could draft this step, with its proposal."""

    request: object                 # core.request.Request
    draft: list[int]
    acceptance: float
    setup_s: float = 0.0            # a draft model's reading of the context its KV lacks: this step's share
    length: int = 0                 # the n-gram that proposed it (0: a draft model's)


def choose_drafts(cands: list[Candidate], base_rows: int, base_tokens: int, cost: StepCostTable | None,
                  budget: int, draft_cost: StepCostTable | None = None, fixed_s: float = 0.0) -> dict[int, int]:
    """Draft tokens per candidate (index -> count), by the rule in the module docstring; without a
    cost table (adaptive off) every proposal is taken whole, as the budget allows. draft_cost: a draft
    model's seconds per proposing pass by sequences in it (None: proposals cost nothing, n-gram).
    base_rows: the step's decode rows; fixed_s: the rest of its time (prefill chunks), drafts or not."""
    if cost is None:
        out, left = {}, budget
        for i, c in enumerate(cands):
            n = min(len(c.draft), left)
            if n:
                out[i], left = n, left - n
        return out
    active = list(range(len(cands)))
    while True:      # a candidate whose reading keeps it out would hold back those after it: drop, choose again
        out = _best_prefix(cands, active, base_rows, base_tokens, cost, budget, draft_cost, fixed_s)
        dropped = {i for i in active if i not in out and cands[i].setup_s > 0}
        if not dropped:
            return out
        active = [i for i in active if i not in dropped]


def _best_prefix(cands: list[Candidate], active: list[int], base_rows: int, base_tokens: int, cost: StepCostTable,
                 budget: int, draft_cost: StepCostTable | None, fixed_s: float) -> dict[int, int]:
    probs = sorted(((cands[i].acceptance ** (d + 1), i) for i in active for d in range(len(cands[i].draft))),
                   reverse=True)[:budget]
    best_m, best, tokens = 0, base_tokens / (cost(base_rows) + fixed_s), float(base_tokens)
    taken, passes, extra = [0] * len(cands), [], 0.0     # draft model: sequences in each proposing pass
    for m, (p, i) in enumerate(probs, start=1):
        tokens += p
        if draft_cost is not None:
            j = taken[i]                 # candidate i's next token needs its pass j (its own come in order)
            taken[i] += 1
            if j == len(passes):
                passes.append(0)
            extra += draft_cost(passes[j] + 1) - (draft_cost(passes[j]) if passes[j] else 0.0)
            extra += cands[i].setup_s if j == 0 else 0.0
            passes[j] += 1
        score = tokens / (cost(base_rows + m) + fixed_s + extra)
        if score > best:
            best_m, best = m, score
    out: dict[int, int] = {}
    for _, i in probs[:best_m]:      # a sequence's own candidates come in order (a^1 > a^2 > ...)
        out[i] = out.get(i, 0) + 1
    return out


def _decayed(tried: float, accepted: float, decay: float, num_draft: int, num_accepted: int) -> tuple[float, float]:
    """Decayed (tried, accepted) counts after one verified draft: the accepted tokens were tried, and
    so was the first rejected one, which ends the run (the rest were never tried)."""
    return tried * decay + num_accepted + (num_accepted < num_draft), accepted * decay + num_accepted


def update_acceptance(req, num_draft: int, num_accepted: int) -> None:
    """A sequence's own acceptance counts after one of its drafts was verified."""
    req.spec_tried, req.spec_accepted = _decayed(req.spec_tried, req.spec_accepted, DECAY, num_draft, num_accepted)


@dataclass(slots=True)
class AcceptancePrior:
    """The engine-wide acceptance of draft tokens: what a sequence's estimate starts from. It follows
    every verified draft and, while no sequence drafts (the rule found none worth it), drifts back
    toward its method's PRIOR_ACCEPTANCE, so a workload whose drafts once failed is tried again later.

    N-gram drafts are also counted by the length of the n-gram that proposed them: how long a match is
    says more about its continuation than anything else (measured on our grounded and chat prompts,
    tokens accepted of 8 proposed: a 1-token match 0.6, 2 tokens 1.9-3.9, 3 tokens 2.6-6.2, 8 tokens
    4.2-6.9), so a candidate's estimate starts from its length's rate (which starts from the engine-wide
    one)."""

    prior: float = PRIOR_ACCEPTANCE["ngram"]
    tried: float = 0.0
    accepted: float = 0.0
    idle_steps: int = 0             # steps since the last draft
    idle_s: float = 0.0             # their step time (as the cost table has it)
    by_length: dict[int, list[float]] = field(default_factory=dict)   # n-gram length -> [tried, accepted]

    @property
    def rate(self) -> float:
        return (self.accepted + 4 * self.prior) / (self.tried + 4)

    def rate_of(self, length: int) -> float:
        """The acceptance of drafts an n-gram of this length proposed (0: any draft)."""
        counts = self.by_length.get(length)
        return self.rate if counts is None else (counts[1] + 4 * self.rate) / (counts[0] + 4)

    def update(self, num_draft: int, num_accepted: int, length: int = 0) -> None:
        self.tried, self.accepted = _decayed(self.tried, self.accepted, GLOBAL_DECAY, num_draft, num_accepted)
        if length:
            counts = self.by_length.setdefault(length, [0.0, 0.0])
            counts[:] = _decayed(*counts, GLOBAL_DECAY, num_draft, num_accepted)
        self.idle_steps, self.idle_s = 0, 0.0

    def idle_step(self, step_s: float = 0.0) -> None:
        self.tried *= 1 - DRIFT
        self.accepted *= 1 - DRIFT
        for counts in self.by_length.values():
            counts[0] *= 1 - DRIFT
            counts[1] *= 1 - DRIFT
        self.idle_steps += 1
        self.idle_s += step_s

    def may_probe(self, cost_s: float) -> bool:
        """Whether a step the rule leaves without drafts may try one costing cost_s seconds anyway (see
        the module docstring): probes take at most PROBE_SHARE of the time."""
        return self.idle_steps >= PROBE_EVERY and cost_s <= PROBE_SHARE * self.idle_s

    def of(self, req, length: int = 0) -> float:
        """A sequence's estimate for a draft: its own decayed outcomes, with the prior counted as two
        tries; for an n-gram's draft (length > 0) its length's rate, counted as eight (the match
        length predicts better than the sequence's few recent drafts, which still move it)."""
        weight = 8 if length else 2
        return (req.spec_accepted + weight * self.rate_of(length)) / (req.spec_tried + weight)


@dataclass(slots=True)
class SpecStats:
    """vLLM's spec_decode counters: drafts (sequences that drafted in a step), draft tokens, accepted
    tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


__all__ = ["SETUP_HORIZON", "propose_ngram", "ngram_match", "StepCostTable", "Candidate", "choose_drafts", "update_acceptance", "AcceptancePrior",
           "SpecStats"]


# ---------------------------------------------------------------- the cost tables, measured at start-up
PROFILE_CONTEXT = 256        # tokens behind the rows whose step time the target's cost table measures


def measure_step_costs(execute, kv, args, max_model_len: int, k: int) -> tuple[StepCostTable, float]:
    """The target's step seconds by rows, on this host (`execute`: the executor's, one SchedulerOutput):
    one sequence of R tokens whose rows all sample (a verification's shape: a decode and R - 1 drafts)
    behind a context of PROFILE_CONTEXT tokens (written first, by the prefill chunk measured for a chunk
    row's cost), so each row's attention is in its cost; R from 1 up to the most rows a step of k drafts
    per sequence reaches; the best of two runs, after one warm-up. Also a prefill chunk's row: what an
    n-row chunk costs beyond a one-row step (both at a prompt's start), a row. The blocks it writes are
    taken from the pool and given back before any request exists."""
    from pagedserve.core.step import SamplingRow, ScheduledSeq, SchedulerOutput, whole
    from pagedserve.sampling_params import SamplingParams
    a = args
    top = min(a.max_num_batched_tokens, a.max_num_seqs * (1 + k), 256)
    grid = (1, 2, 3, 4, 5, 6, 8, 12, 17, 24, 33, 48, 65, 97, 129, 193, 256)
    rows = sorted({r for r in grid if r <= top} | {top})
    n = max(2, min(top, a.long_prefill_token_threshold))          # a prefill chunk's rows
    free = kv.num_free_blocks * a.block_size - top
    ctx = max(0, min(PROFILE_CONTEXT, free, max_model_len - top)) // n * n   # 0: a pool too small
    blocks = kv.pool.get_new_blocks(kv.blocks_needed(ctx + top))
    ids = whole((tuple(b.block_id for b in blocks),) * len(kv.windows))   # (groups may share them: values unused)
    row = SamplingRow("spec-profile", SamplingParams(temperature=0.0, max_tokens=1), None, 1, 0, ())

    def run(r: int, start: int = ctx, chunk: bool = False) -> float:
        so = SchedulerOutput((ScheduledSeq("spec-profile", (0,) * r, start, ids, row,
                                           num_draft=0 if chunk else r - 1),))
        t0 = time.perf_counter()
        execute(so)
        return time.perf_counter() - t0
    try:
        run(n, 0, chunk=True)
        chunk_s = min(run(n, 0, chunk=True), run(n, 0, chunk=True))
        one_s = min(run(1, 0), run(1, 0))
        for start in range(n, ctx, n):                          # the rest of the context, written once
            run(n, start, chunk=True)
        run(1)
        seconds = [min(run(r), run(r)) for r in rows]
    finally:
        kv.pool.free_blocks(blocks)
        execute(SchedulerOutput(finished_req_ids=("spec-profile",)))
    return StepCostTable(rows, seconds), max(0.0, chunk_s - one_s) / (n - 1)


def measure_draft_costs(drafter, kv, args) -> tuple[StepCostTable, float]:
    """The draft model's proposing pass by sequences in it (one decode row each), and its seconds per
    token of reading a context (a 128-token chunk), on this host."""
    from pagedserve.core.step import SamplingRow
    from pagedserve.sampling_params import SamplingParams
    top = min(args.max_num_seqs, args.max_num_batched_tokens, 64)
    rows = sorted({r for r in (1, 2, 4, 8, 16, 32, 64) if r <= top} | {top})
    blocks = kv.pool.get_new_blocks(min(kv.blocks_needed(128), kv.pool.num_usable_blocks // 2))
    row = SamplingRow("draft-profile", SamplingParams(temperature=0.0, max_tokens=1), None, 1, 0, ())
    try:
        seconds, read_s = drafter.measure(rows, tuple(b.block_id for b in blocks), row)
    finally:
        kv.pool.free_blocks(blocks)
    return StepCostTable(rows, seconds), read_s
