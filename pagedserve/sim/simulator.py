"""The simulator: the real Scheduler and KVCacheManager, on simulated time. Each step is
scheduled exactly as the engine would schedule it; a cost model says how long it took; every
sequence that samples gets a token (EOS never comes: requests run to their output length).
Plain Python: no torch, no model."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from pagedserve.config import EngineArgs
from pagedserve.core.request import Request
from pagedserve.core.scheduler import build_kv_cache, build_scheduler
from pagedserve.core.traffic import TrafficClasses
from pagedserve.errors import ParamError, QueueFullError
from pagedserve.sampling_params import SamplingParams
from pagedserve.sim.cost_model import ModelShape, row_features, step_features

FILLER_TOKEN = 1000          # what every simulated sample "generates"; never a stop token


@dataclass(slots=True, frozen=True)
class SimRequest:
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    n: int = 1
    priority: int = 0
    traffic_class: str | None = None


def poisson_workload(rate: float, num_requests: int, seed: int = 0, input_len=(5.0, 1.0, 4, 1024),
                     output_len=(5.0, 0.8, 4, 1024)) -> list[SimRequest]:
    """Poisson arrivals at `rate` req/s; lengths lognormal (mu, sigma) clipped to [lo, hi]. The
    defaults are a ShareGPT-like mix (median ~150 tokens in, ~150 out): a fit, not the data set."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num_requests):
        n_in = _lognormal(rng, *input_len)
        n_out = _lognormal(rng, *output_len)
        out.append(SimRequest(t, tuple(rng.randrange(17, 30000) for _ in range(n_in)), n_out))
        t += rng.expovariate(rate)
    return out


def _lognormal(rng: random.Random, mu: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.gauss(mu, sigma))))))


def with_arrivals(reqs: list[SimRequest], rate: float | None, seed: int = 0) -> list[SimRequest]:
    """The same requests arriving as a Poisson process (rate None: all at time 0), drawn as
    bench/serving.py draws them (random.Random(seed).expovariate after each request)."""
    if rate is None:
        return [SimRequest(0.0, r.prompt_token_ids, r.output_len, r.n, r.priority, r.traffic_class) for r in reqs]
    rng, t, out = random.Random(seed), 0.0, []
    for r in reqs:
        out.append(SimRequest(t, r.prompt_token_ids, r.output_len, r.n, r.priority, r.traffic_class))
        t += rng.expovariate(rate)
    return out


@dataclass(slots=True)
class SimResult:
    num_requests: int
    duration_s: float
    output_tokens: int
    prompt_tokens: int
    preemptions: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    kv_usage: list[tuple[float, float]] = field(default_factory=list)     # (time s, fraction of blocks used)
    steps: int = 0
    rejected: int = 0
    classes: TrafficClasses | None = None
    # with traffic classes, per class: ttft_s, itl_s (every gap) and worst_itl_s (each request's longest gap)
    by_class: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # every finished request (n = 1 and each parent of n > 1): (its index in the workload, priority, class name
    # or None, TTFT s, longest inter-token gap s, finish time s)
    finished: list[tuple[int, int, str | None, float, float, float]] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def attainment(self, ttft_ms: float, itl_ms: float, which=None) -> float:
        """The share of finished requests (those whose workload index is in `which`, or all) whose TTFT and
        longest inter-token gap both met the targets: goodput's per-request test, with or without classes."""
        rows = [r for r in self.finished if which is None or r[0] in which]
        return sum(t * 1e3 <= ttft_ms and g * 1e3 <= itl_ms for *_, t, g, _ in rows) / len(rows) if rows else math.nan

    def pct(self, name: str, q: float) -> float:
        return _pct(sorted(getattr(self, name)), q)

    def summary(self) -> dict:
        out = {"requests": self.num_requests, "rejected": self.rejected, "duration_s": round(self.duration_s, 3), "steps": self.steps,
               "output_tokens": self.output_tokens, "output_tok_s": round(self.output_tok_s, 2),
               "preemptions": self.preemptions,
               "kv_usage_max": round(max((u for _, u in self.kv_usage), default=0.0), 3)}
        for name in ("ttft_s", "itl_s", "e2e_s"):
            for q in (50, 90, 99):
                out[f"{name[:-2]}_p{q}_ms"] = round(1000 * self.pct(name, q), 2)
        if self.classes is not None:
            out["classes"] = {c.name: self.class_summary(c) for c in self.classes}
        return out

    def class_summary(self, c) -> dict:
        """One class's latency percentiles and SLO attainment (the share of its requests whose first
        token, and whose longest inter-token gap, met its p99 targets)."""
        d = self.by_class.get(c.name, {})
        ttft, itl, worst = (sorted(d.get(k, [])) for k in ("ttft_s", "itl_s", "worst_itl_s"))
        out = {"requests": len(ttft), "output_tokens": len(itl) + len(ttft)}
        for name, xs in (("ttft", ttft), ("itl", itl)):
            for q in (50, 99):
                out[f"{name}_p{q}_ms"] = round(1000 * _pct(xs, q), 2)
        if c.ttft_p99_ms is not None and ttft:
            out["ttft_slo_met"] = round(sum(x * 1e3 <= c.ttft_p99_ms for x in ttft) / len(ttft), 4)
        if c.itl_p99_ms is not None and worst:
            out["itl_slo_met"] = round(sum(x * 1e3 <= c.itl_p99_ms for x in worst) / len(worst), 4)
        return out


def _pct(xs: list[float], q: float) -> float:
    """The q-th percentile of sorted xs (nearest rank), NaN when empty."""
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else math.nan


def simulate(reqs: list[SimRequest], shape: ModelShape, cost, args: EngineArgs, num_blocks: int,
             max_model_len: int = 8192, watch: frozenset[int] | None = None) -> SimResult:
    """Run the workload through the real scheduler; `cost.step_time(features)` advances the clock. `watch`:
    the workload indexes the run is for; it stops once they have all finished (a flood's backlog left running)."""
    clock = [0.0]
    kv = build_kv_cache(args, max_model_len, num_blocks, shape.kv_bytes_per_token * args.block_size)
    # the scheduler predicts steps (traffic classes' ITL targets) with the model that times them
    sch = build_scheduler(args, max_model_len, kv, clock=lambda: clock[0],
                          step_cost=lambda rows: cost.step_time(row_features(shape, rows)))
    classes = sch.classes
    klass: dict[str, str] = {}       # request id -> its class's name
    worst: dict[str, float] = {}     # request id -> its longest inter-token gap so far
    pending = sorted(enumerate(reqs), key=lambda x: (x[1].arrival_s, x[0]), reverse=True)
    arrival, last_token, first, meta = {}, {}, {}, {}
    res = SimResult(len(reqs), 0.0, 0, sum(len(r.prompt_token_ids) for r in reqs), 0, classes=classes)
    left = None if watch is None else set(watch)
    while (pending or sch.has_unfinished()) and left != set():
        while pending and pending[-1][1].arrival_s <= clock[0]:
            i, r = pending.pop()
            sp = SamplingParams(n=r.n, max_tokens=r.output_len, ignore_eos=True)
            rid = str(i)
            req = Request(rid, list(r.prompt_token_ids), sp, r.output_len, priority=r.priority,
                          arrival_time=r.arrival_s, num_samples=r.n)
            try:
                if classes is not None:
                    req.traffic_class = classes.resolve(r.priority, r.traffic_class)
                    klass[rid] = classes[req.traffic_class].name
                sch.add_request(req)
            except (ParamError, QueueFullError):    # could never run here, or its queue is full
                res.rejected += 1
                continue
            arrival[rid] = r.arrival_s
            meta[rid] = (i, r.priority, klass.get(rid))
        if not sch.has_unfinished():
            clock[0] = pending[-1][1].arrival_s
            continue
        so = sch.schedule()
        dt = cost.step_time(step_features(shape, so.seqs))
        clock[0] += dt
        sch.observe_step_time(dt)
        res.steps += 1
        res.preemptions += len(so.preempted)
        sampled = {s.request_id: [FILLER_TOKEN] * s.sampling.num_samples for s in so.seqs if s.sampling}
        for u in sch.update_from_output(so, sampled):
            rid, now = u.request.request_id, clock[0]
            res.output_tokens += 1
            owner = u.request.parent_id or rid
            per = res.by_class.setdefault(klass[owner], {"ttft_s": [], "itl_s": [], "worst_itl_s": []}) \
                if classes is not None else None
            if rid in last_token:
                res.itl_s.append(now - last_token[rid])
                worst[rid] = max(worst.get(rid, 0.0), res.itl_s[-1])
                if per is not None:
                    per["itl_s"].append(res.itl_s[-1])
            elif not u.forked:
                res.ttft_s.append(now - arrival[owner])
                first.setdefault(owner, res.ttft_s[-1])
                if per is not None:
                    per["ttft_s"].append(res.ttft_s[-1])
            last_token[rid] = now
            if u.finished:
                res.e2e_s.append(now - arrival[owner])
                gap = worst.pop(rid, 0.0)
                if rid == owner:
                    res.finished.append((*meta[rid], first.pop(rid, now - arrival[rid]), gap, now))
                    if left is not None:
                        left.discard(meta[rid][0])
                    if per is not None:
                        per["worst_itl_s"].append(gap)
        res.kv_usage.append((clock[0], kv.usage()))
    res.duration_s = clock[0] - (min(r.arrival_s for r in reqs) if reqs else 0.0)
    return res


def num_blocks_for(kv_bytes: float, shape: ModelShape, block_size: int) -> int:
    return int(kv_bytes // (shape.kv_bytes_per_token * block_size))


def max_rate_meeting(slo: dict[str, float], run, lo: float = 0.05, hi: float = 8.0, iters: int = 12,
                     cap: float = 4096.0) -> tuple[float, dict]:
    """Bisection on the arrival rate for the highest one whose result meets every SLO term
    (e.g. {"ttft_p99_ms": 2000, "itl_p99_ms": 100}). `run(rate)` returns a SimResult summary.
    `hi` doubles until it fails the SLO (up to `cap`), then the bracket is bisected."""
    def ok(s):
        return all(s[k] <= v for k, v in slo.items())
    s = run(lo)
    if not ok(s):
        return 0.0, s
    best = (lo, s)
    while ok(s := run(hi)):
        lo, best = hi, (hi, s)
        if hi >= cap:
            return best
        hi *= 2
    for _ in range(iters):
        mid = math.sqrt(lo * hi)            # rates span decades: bisect in log space
        s = run(mid)
        if ok(s):
            lo, best = mid, (mid, s)
        else:
            hi = mid
    return best


def parse_slo(text: str) -> dict[str, float]:
    """"ttft_p99<2s,itl_p99<100ms" -> {"ttft_p99_ms": 2000.0, "itl_p99_ms": 100.0}."""
    out = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "<" not in term:
            raise ValueError(f"--slo term {term!r} must look like ttft_p99<2s")
        name, value = (x.strip() for x in term.split("<", 1))
        if name not in {f"{m}_p{q}" for m in ("ttft", "itl", "e2e") for q in (50, 90, 99)}:
            raise ValueError(f"--slo: unknown metric {name!r} (ttft|itl|e2e _p50|_p90|_p99)")
        scale = 1.0 if value.endswith("ms") else 1000.0
        try:
            out[f"{name}_ms"] = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"--slo: bad value {value!r} in {term!r} (e.g. 2s or 100ms)") from None
    if not out:
        raise ValueError("--slo is empty")
    return out
