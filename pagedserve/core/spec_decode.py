"""Speculative decoding's plain-Python half: the n-gram proposer and the per-step rule that decides
how many draft tokens each running sequence computes. The sampler verifies (runner/sampler.py:
accepted_run).

The rule (adaptive): a draft token is worth its row when the tokens it is expected to add raise the
step's tokens per second. For sequence j with acceptance estimate a_j, its i-th draft token is
accepted (and so adds a token) with probability a_j^i. Candidates are sorted by that probability
and the step takes the prefix m that maximises

    (tokens the step yields without drafts + sum of the first m probabilities) / T(rows + m)

where T(R) is the step time at R rows, measured on this host at start-up (`StepCostTable`). m = 0
(no drafts) wins whenever the measured T rises faster than the expected tokens: large batches on
a compute-bound CPU, or sequences whose drafts keep being rejected."""
from __future__ import annotations

from array import array
from bisect import bisect_left
from itertools import accumulate
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.6      # the engine-wide estimate at start, and where it drifts back to while nothing drafts
DECAY = 0.8                 # per verified draft of a sequence: older outcomes weigh less (its text changes)
GLOBAL_DECAY = 0.98         # per verified draft, engine-wide
DRIFT = 0.01                # per step without a draft, the engine-wide estimate moves this share back to the prior


def propose_ngram(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram (n_max down to
    n_min) ending `tokens`; [] when none occurred before. Searched as bytes (C speed): 4 per token."""
    L = len(tokens)
    if L < n_min + 1 or k < 1:
        return []
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
                return tokens[j:j + k]
            end = at + len(pat) - 1         # a misaligned hit: look further left
    return []


@dataclass(slots=True)
class StepCostTable:
    """Step seconds by rows computed, measured at start-up; piecewise linear between the measured
    points, extended past the last one by the last slope. Non-decreasing in rows: a step of more rows
    never costs less, so a lower reading is noise and is raised to the one before it."""

    rows: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seconds = list(accumulate(self.seconds, max))

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


def choose_drafts(cands: list[Candidate], base_rows: int, base_tokens: int, cost: StepCostTable | None,
                  budget: int) -> dict[int, int]:
    """Draft tokens per candidate (index -> count), by the rule in the module docstring; without a
    cost table (adaptive off) every proposal is taken whole, as the budget allows."""
    if cost is None:
        out, left = {}, budget
        for i, c in enumerate(cands):
            n = min(len(c.draft), left)
            if n:
                out[i], left = n, left - n
        return out
    probs = sorted(((c.acceptance ** (d + 1), i) for i, c in enumerate(cands) for d in range(len(c.draft))),
                   reverse=True)[:budget]
    best_m, best, tokens = 0, base_tokens / cost(base_rows), float(base_tokens)
    for m, (p, _) in enumerate(probs, start=1):
        tokens += p
        score = tokens / cost(base_rows + m)
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
    toward PRIOR_ACCEPTANCE, so a workload whose drafts once failed is tried again later."""

    tried: float = 0.0
    accepted: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 4 * PRIOR_ACCEPTANCE) / (self.tried + 4)

    def update(self, num_draft: int, num_accepted: int) -> None:
        self.tried, self.accepted = _decayed(self.tried, self.accepted, GLOBAL_DECAY, num_draft, num_accepted)

    def idle_step(self) -> None:
        self.tried *= 1 - DRIFT
        self.accepted *= 1 - DRIFT

    def of(self, req) -> float:
        """A sequence's estimate: its own decayed outcomes, with this prior counted as two tries."""
        return (req.spec_accepted + 2 * self.rate) / (req.spec_tried + 2)


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


__all__ = ["propose_ngram", "StepCostTable", "Candidate", "choose_drafts", "update_acceptance", "AcceptancePrior",
           "SpecStats"]
