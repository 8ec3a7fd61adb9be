"""Prometheus metrics, named in vLLM's style under our own prefix. They answer the seed's two
operator questions: "free memory but requests wait" (KV blocks free/used/cached, max_num_seqs,
max_num_batched_tokens, bytes for weights/KV/workspace) and "p99 inter-token latency spikes when a
long prompt arrives" (prefill vs decode tokens per step, inter-token latency histogram)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.engine.info import CoreStats

P = "pagedserve:"
_LAT = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOK = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(slots=True)
class LatencySamples:
    """One step's latency observations, made once (here) for /metrics and the dashboard alike.
    ttft: arrival to the first token; itl: the gap between two outputs of one stream (inter-token
    latency; several tokens may come in one output); tpot: a finished request's mean time per output
    token after the first (time per output token)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    stats: CoreStats | None = None          # the engine's state after the step, read once for both


class ServerMetrics:
    """Fed by the engine's values only: its EngineInfo here, its CoreStats after each step (on_step) and at
    scrape time (refresh)."""

    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        g = lambda n, d, *lab: Gauge(P + n, d, lab, registry=r)                      # noqa: E731
        c = lambda n, d, *lab: Counter(P + n, d, lab, registry=r)                    # noqa: E731
        h = lambda n, d, b, *lab: Histogram(P + n, d, lab, buckets=b, registry=r)    # noqa: E731
        self.running = g("num_requests_running", "Requests in the running batch")
        self.waiting = g("num_requests_waiting", "Requests in the waiting queue")
        self.preempted = g("num_requests_preempted", "Waiting requests that were preempted (recompute or swap)")
        self.blocks_total = g("kv_blocks_total", "Usable KV blocks in the pool")
        self.blocks_free = g("kv_blocks_free", "Free KV blocks (including evictable prefix-cache blocks)")
        self.blocks_cached = g("kv_blocks_cached", "KV blocks registered in the prefix cache")
        self.kv_usage = g("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        self.shared = g("kv_blocks_saved_by_sharing", "Blocks that sharing (n > 1, prefix hits) saved")
        info = engine.info
        g("weights_bytes", "Bytes of model weights").set(info.weights_bytes)
        g("kv_cache_bytes", "Bytes of the preallocated KV pool").set(info.kv_cache_bytes)
        g("workspace_bytes", "Estimated bytes of activations/workspace at the step budget").set(info.workspace_bytes)
        g("block_size", "Tokens per KV block").set(info.block_size)
        g("max_num_seqs", "Configured max_num_seqs").set(info.max_num_seqs)
        g("max_num_batched_tokens", "Configured token budget per step").set(info.max_num_batched_tokens)
        startup = getattr(engine, "startup", None)
        if startup is not None:                 # the start-up record (pagedserve/engine/startup.py), a gauge per phase
            phases = g("startup_phase_seconds", "Seconds each start-up phase took", "phase")
            for name, secs in startup.seconds().items():
                phases.labels(name).set(secs)
            g("startup_seconds", "Seconds from the process's start (or the engine's) to ready").set(startup.total_s)
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = c("num_preemptions", "Preemptions")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = c("generation_tokens", "Tokens generated")
        self.success = c("request_success", "Finished requests", "finished_reason")
        self.ttft = h("time_to_first_token_seconds", "Time to first token", _LAT)
        self.itl = h("inter_token_latency_seconds", "Time between two output tokens of a request", _LAT)
        self.tpot = h("time_per_output_token_seconds", "Mean time per output token after the first, per request", _LAT)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to finish", _LAT)
        self.queue = h("request_queue_time_seconds", "Arrival to first scheduled", _LAT)
        self.step_prefill = h("iteration_prefill_tokens", "Prefill tokens per step", _TOK)
        self.step_decode = h("iteration_decode_tokens", "Decode tokens per step", _TOK)
        self.step_time = h("iteration_seconds", "Wall time of one engine step", _LAT)
        self.spec_drafts = c("spec_decode_num_drafts", "Speculative decoding: sequence-steps that verified drafts")
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified")
        self.spec_accepted = c("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted")
        self.spec_per_pos = c("spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: accepted draft "
                              "tokens by their position in the draft (0 = first)", "position")
        if info.has_encoder_cache:                        # a vision-language model's encoder cache
            self.encoder_hits = c("encoder_cache_hits", "Images read from the encoder cache (no encoder run)")
            self.encoder_runs = c("encoder_cache_misses", "Images encoded (not in the encoder cache)")
            self.encoder_tokens = g("encoder_cache_tokens", "Image tokens of encoder outputs held")
        # traffic classes: label values are the configured class names (bounded by --traffic-classes)
        self.classes = info.traffic_classes
        if self.classes is not None:
            k = "traffic_class"
            self.class_running = g("class_num_requests_running", "Running requests per traffic class", k)
            self.class_waiting = g("class_num_requests_waiting", "Waiting requests per traffic class", k)
            self.class_ttft = h("class_time_to_first_token_seconds", "Time to first token per traffic class", _LAT, k)
            self.class_itl = h("class_inter_token_latency_seconds", "Time between two output tokens per traffic "
                               "class", _LAT, k)
            self.class_floor = g("class_itl_floor_seconds", "The least itl_p99_ms target the host can hold now for "
                                 "a class with one (its decodes beside the other classes' least work, by the "
                                 "step-time model, over the 0.8 headroom); 0 until the model is fitted", k)
            self.class_success = c("class_request_success", "Finished requests per traffic class", k)
            self.class_slo = c("class_slo_met", "Requests of a class whose first token (slo=ttft) or every "
                               "inter-token gap (slo=itl) met its class's p99 target", k, "slo")
            for klass in self.classes:
                for m in (self.class_running, self.class_waiting, self.class_ttft, self.class_itl, self.class_success):
                    m.labels(traffic_class=klass.name)
                if klass.itl_p99_ms is not None:
                    self.class_floor.labels(traffic_class=klass.name).set(
                        (info.startup_itl_floor_ms or 0.0) / 1e3)
        self._worst_itl: dict[str, float] = {}   # per stream: its longest gap so far (ITL SLO), with classes
        self._last: dict = {}                    # the engine's running total each counter was last advanced to
        self._tok_seen: dict[str, tuple[int, float]] = {}
        self.blocks_total.set(info.num_kv_blocks)
        self.blocks_free.set(engine.stats().num_free_blocks)

    def on_step(self, engine, outputs) -> LatencySamples:
        """Runs in the engine thread after each step; returns the latencies it observed (the dashboard
        keeps the same samples: one place computes them)."""
        stats = engine.stats()
        samples = LatencySamples(stats=stats)
        s, c, sp = stats.step, stats.counters, stats.spec
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.preempted.set(s.num_preempted_waiting)
        self.blocks_free.set(s.num_free_blocks)
        self.blocks_cached.set(s.num_cached_blocks)
        self.kv_usage.set(s.kv_usage)
        totals = [(self.prefix_queries, c.prefix_queries), (self.prefix_hits, c.prefix_hits),
                  (self.preemptions, c.preemptions), (self.prompt_tokens, c.prompt_tokens),
                  (self.generation_tokens, c.generation_tokens)]
        if sp is not None:
            totals += [(self.spec_drafts, sp.num_drafts), (self.spec_draft_tokens, sp.num_draft_tokens),
                       (self.spec_accepted, sp.num_accepted_tokens)]
            totals += [(self.spec_per_pos.labels(position=str(i)), n) for i, n in enumerate(sp.accepted_per_pos)]
        if (enc := stats.encoder_cache) is not None:
            totals += [(self.encoder_hits, enc.hits), (self.encoder_runs, enc.misses)]
            self.encoder_tokens.set(enc.size_tokens)
        for counter, value in totals:            # prometheus counters advance by the engine totals' deltas
            if value > self._last.get(counter, 0):
                counter.inc(value - self._last.get(counter, 0))
                self._last[counter] = value
        if s.num_prefill_tokens:
            self.step_prefill.observe(s.num_prefill_tokens)
        if s.num_decode_tokens:
            self.step_decode.observe(s.num_decode_tokens)
        self.step_time.observe(s.step_s)
        now = time.monotonic()
        classes = self.classes
        if classes is not None:
            self._class_gauges(stats.classes)
        for out in outputs:
            # a stream's outputs are deltas (every step), any other request's one output at its end: so
            # each choice's tokens are counted as they arrive (an entry from its first token on), and a gap
            # is timed whenever a choice grows
            counts = self._tok_seen.get(out.request_id)
            m = out.metrics
            klass = classes[m.traffic_class] if classes is not None and m is not None else None
            if counts is None and any(o.token_ids for o in out.outputs):
                counts = self._tok_seen[out.request_id] = [(0, None)] * len(out.outputs)
                if m is not None and m.first_token_time is not None:
                    samples.ttft.append(m.first_token_time - m.arrival_time)
                    self.ttft.observe(samples.ttft[-1])
                    if klass is not None:
                        self.class_ttft.labels(traffic_class=klass.name).observe(samples.ttft[-1])
                    if m.first_scheduled_time is not None:
                        self.queue.observe(m.first_scheduled_time - m.arrival_time)
            for o in out.outputs if counts is not None else ():
                if not o.token_ids:
                    continue
                n, last = counts[o.index]
                if last is not None:
                    samples.itl.append(now - last)
                    self.itl.observe(samples.itl[-1])
                    if klass is not None:
                        self.class_itl.labels(traffic_class=klass.name).observe(samples.itl[-1])
                        self._worst_itl[out.request_id] = max(self._worst_itl.get(out.request_id, 0.0),
                                                              samples.itl[-1])
                counts[o.index] = (n + len(o.token_ids), now)
            if out.finished:
                self._tok_seen.pop(out.request_id, None)
                worst = self._worst_itl.pop(out.request_id, 0.0)
                if klass is not None:
                    self._class_finish(klass, m, worst)
                samples.tpot += self.finish(out, None if counts is None else [c for c, _ in counts])
        return samples

    def _class_gauges(self, summary) -> None:
        for c in summary:
            self.class_running.labels(traffic_class=c["name"]).set(c["running"])
            self.class_waiting.labels(traffic_class=c["name"]).set(c["waiting"])
            if c["itl_floor_ms"] is not None:
                self.class_floor.labels(traffic_class=c["name"]).set(c["itl_floor_ms"] / 1e3)

    def _class_finish(self, klass, m, worst_itl: float) -> None:
        self.class_success.labels(traffic_class=klass.name).inc()
        if klass.ttft_p99_ms is not None and m.first_token_time is not None and \
                m.first_token_time - m.arrival_time <= klass.ttft_p99_ms / 1e3:
            self.class_slo.labels(traffic_class=klass.name, slo="ttft").inc()
        if klass.itl_p99_ms is not None and m.first_token_time is not None and worst_itl <= klass.itl_p99_ms / 1e3:
            self.class_slo.labels(traffic_class=klass.name, slo="itl").inc()

    def held(self) -> dict[str, int]:
        """Per-request entries (streams whose last token time is kept for the inter-token histogram, and
        their longest gap with classes); metric labels are bounded by the finish reasons and the classes."""
        return {"metrics.tok_seen": len(self._tok_seen), "metrics.worst_itl": len(self._worst_itl)}

    def finish(self, out, num_tokens: list[int] | None = None) -> list[float]:
        """Counts a finished request; the TPOT (mean seconds per output token after the first) of each of
        its choices that has one. num_tokens: each choice's tokens (a stream's outputs were deltas); by
        default the output's own."""
        m = out.metrics
        for o in out.outputs:
            self.success.labels(finished_reason=o.finish_reason or "abort").inc()
        if m is None or m.first_token_time is None:
            return []
        self.e2e.observe((m.finished_time or time.monotonic()) - m.arrival_time)
        tpots = []
        for n in num_tokens if num_tokens is not None else [len(o.token_ids) for o in out.outputs]:
            if n > 1 and m.last_token_time is not None:
                tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
                self.tpot.observe(tpots[-1])
        return tpots

    def refresh(self, engine) -> None:
        """The gauges read at scrape time (idle engines do not step); engine thread."""
        stats = engine.stats(shared=True)
        self.shared.set(stats.num_shared_savings)
        self.blocks_free.set(stats.num_free_blocks)
        self.kv_usage.set(stats.kv_usage)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        if self.classes is not None:
            self._class_gauges(stats.classes)
