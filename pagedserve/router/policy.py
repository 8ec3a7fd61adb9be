"""Where to send a request among data-parallel replicas (SGLang's cache-aware routing): to the
replica that most recently saw the longest prefix of this prompt, unless it is much busier than
the least loaded one. Plain Python, no I/O: the router app feeds it loads and health.

Each replica's recent prompts are remembered as chained hashes of fixed-size text chunks (the same
idea as the KV cache's block hashes): the prompts sharing a prefix share the chain, so the set of
chains is a prefix tree, and a match is the number of leading chunks whose chain hash is there."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

CHUNK_CHARS = 32


def chunk_hashes(text: str, chunk: int = CHUNK_CHARS) -> list[int]:
    out, h = [], None
    for i in range(0, len(text) - len(text) % chunk, chunk):
        h = hash((h, text[i:i + chunk]))
        out.append(h)
    return out


@dataclass(slots=True)
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0                                  # requests the router has open on it
    queue: int = 0                                      # running + waiting, as the replica last reported
    prefixes: OrderedDict = field(default_factory=OrderedDict)   # chain hash -> None, LRU order
    sent: int = 0
    slow_checks: int = 0                                # health checks in a row that timed out

    @property
    def load(self) -> int:
        """The router's own count, or the replica's if higher (clients that bypass the router)."""
        return max(self.in_flight, self.queue)

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            n += 1
        return n

    def remember(self, hashes: list[int], limit: int) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > limit:
            self.prefixes.popitem(last=False)


class RoutingPolicy:
    """`cache_aware` (default) or `round_robin` (the baseline it is measured against)."""

    def __init__(self, urls: list[str], policy: str = "cache_aware", cache_threshold: float = 0.5,
                 balance_abs: int = 8, balance_rel: float = 1.5, max_prefixes: int = 200_000):
        if policy not in ("cache_aware", "round_robin"):
            raise ValueError(f"policy must be cache_aware or round_robin, got {policy!r}")
        if not urls:
            raise ValueError("at least one --backend is needed")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.policy = policy
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.max_prefixes = max_prefixes
        self._rr = itertools.count()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def choose(self, text: str, exclude: set[str] = frozenset()) -> tuple[Replica | None, str]:
        """(replica, why): the replica to try, or None when none is healthy."""
        live = [r for r in self.healthy() if r.url not in exclude]
        if not live:
            return None, "no healthy replica"
        if self.policy == "round_robin":
            return live[next(self._rr) % len(live)], "round robin"
        hashes = chunk_hashes(text)
        least = min(live, key=lambda r: (r.load, r.sent))
        best = max(live, key=lambda r: (r.match(hashes), -r.load))
        matched = best.match(hashes)
        busy = best.load > least.load + self.balance_abs and best.load > self.balance_rel * least.load
        if hashes and matched / len(hashes) >= self.cache_threshold and not busy:
            return best, f"prefix match {matched}/{len(hashes)} chunks"
        return least, "least loaded" + (" (the prefix holder is busy)" if matched and busy else "")

    def sent_to(self, replica: Replica, text: str) -> None:
        replica.in_flight += 1
        replica.sent += 1
        if self.policy == "cache_aware":
            replica.remember(chunk_hashes(text), self.max_prefixes)

    def done(self, replica: Replica) -> None:
        replica.in_flight -= 1
