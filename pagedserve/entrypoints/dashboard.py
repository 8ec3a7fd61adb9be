"""The live view of the cache and the schedule: `GET /debug/state` (one JSON snapshot, built in the
engine thread between two steps, so it is consistent and costs the steps nothing when nobody
asks), `GET /debug/state/stream` (the same as SSE, a few frames per second) and `GET /dashboard`
(the page that draws it, shipped in the package: no CDN). `pagedserve top` reads the same snapshot.

The recorder keeps what a snapshot cannot read off the engine: the last few hundred steps (the
timeline) and recent latencies (the histograms). It runs in the engine thread after each step and
costs one small tuple per step."""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, StreamingResponse


router = APIRouter()
STEPS_KEPT = 300
LATENCIES_KEPT = 2000


class StateRecorder:
    def __init__(self):
        self.steps: deque[dict] = deque(maxlen=STEPS_KEPT)
        self.ttft_s: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.itl_s: deque[float] = deque(maxlen=LATENCIES_KEPT)       # gaps between a stream's outputs
        self.tpot_s: deque[float] = deque(maxlen=LATENCIES_KEPT)      # a finished request's mean per token
        self._last_step = 0

    def on_step(self, engine, outputs, samples) -> None:
        """Engine thread, after each step (and after aborts, which add no step record). `samples`:
        the step's latencies as /metrics observed them (metrics.LatencySamples), kept as they are."""
        stats = samples.stats or engine.stats()
        c, s = stats.counters, stats.step
        now = time.monotonic()
        if c.steps != self._last_step:
            self._last_step = c.steps
            self.steps.append({"step": c.steps, "t": round(now, 3), "prefill": s.num_prefill_tokens,
                               "decode": s.num_decode_tokens, "step_ms": round(1e3 * s.step_s, 2),
                               "preempted": s.num_preemptions, "admitted": s.num_admitted,
                               "running": s.num_running, "waiting": s.num_waiting,
                               "kv_usage": round(s.kv_usage, 4), "prefix_queries": c.prefix_queries,
                               "prefix_hits": c.prefix_hits, "generated": c.generation_tokens,
                               "draft": s.num_draft_tokens})
        self.ttft_s.extend(samples.ttft)
        self.itl_s.extend(samples.itl)
        self.tpot_s.extend(samples.tpot)


def snapshot(engine, recorder: StateRecorder) -> dict:
    """Everything the dashboard draws: the engine's cache view and stats (call it in the engine thread,
    between steps), with the recorder's steps and latencies."""
    stats, info = engine.stats(), engine.info
    c = stats.counters
    return {
        "time": round(time.monotonic(), 3), "step": c.steps, "model": info.model_name,
        "startup": engine.startup.as_dict() if engine.startup is not None else None,
        **engine.cache_view(),
        "steps": list(recorder.steps),
        "health": {"prefix_queries": c.prefix_queries, "prefix_hits": c.prefix_hits,
                   "prefix_hit_rate": round(c.prefix_hits / c.prefix_queries, 4) if c.prefix_queries else None,
                   "ttft_s": _dist(recorder.ttft_s), "itl_s": _dist(recorder.itl_s), "tpot_s": _dist(recorder.tpot_s),
                   "generation_tokens": c.generation_tokens, "prompt_tokens": c.prompt_tokens,
                   "preemptions": c.preemptions, "finished": dict(c.finished), "spec_decode": _spec(info, stats),
                   "traffic_classes": None if stats.classes is None else list(stats.classes)},
    }


def _spec(info, stats) -> dict | None:
    """Speculative decoding's totals (None when it is off): vLLM's spec_decode counters."""
    spec, sp = info.speculative, stats.spec
    if spec is None:
        return None
    return {"method": spec.method, "draft_model": spec.model, "num_speculative_tokens": spec.num_speculative_tokens,
            "adaptive": spec.adaptive, "num_drafts": sp.num_drafts, "num_draft_tokens": sp.num_draft_tokens,
            "num_accepted_tokens": sp.num_accepted_tokens, "accepted_per_pos": list(sp.accepted_per_pos),
            "acceptance_rate": round(sp.num_accepted_tokens / sp.num_draft_tokens, 4) if sp.num_draft_tokens else None}


def _dist(xs) -> dict:
    """p50 / p99 and a log-spaced histogram (ms) of recent samples."""
    v = sorted(xs)
    if not v:
        return {"n": 0, "p50": None, "p99": None, "hist": []}
    edges = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 60000]
    hist = [0] * (len(edges) + 1)
    for x in v:
        ms = 1e3 * x
        hist[next((i for i, e in enumerate(edges) if ms <= e), len(edges))] += 1
    return {"n": len(v), "p50": v[len(v) // 2], "p99": v[min(len(v) - 1, int(0.99 * len(v)))],
            "edges_ms": edges, "hist": hist}


# ---------------------------------------------------------------- routes
def _server(http: Request):
    return http.app.state.server


@router.get("/debug/state", summary="One snapshot of the KV cache, the queues, recent steps and latencies")
async def debug_state(http: Request) -> dict:
    """Block states (0 null, 1 free, 2 used, 3 cached and evictable) with refcounts, prefix hashes and
    owners ([request index, first token, end token]); running / waiting / swapped requests with
    their block tables and, when waiting, the scheduler's reason; the last steps (prefill and decode
    tokens, step time, preemptions, admissions); prefix-cache hit rate, TTFT and inter-token latency."""
    st = _server(http)
    return await st.aengine.call(lambda: snapshot(st.engine, st.recorder))


@router.get("/debug/state/stream", include_in_schema=False)     # endless: kept out of the fuzzed schema
async def debug_state_stream(http: Request, fps: float = Query(4.0, gt=0, le=20)):
    """/debug/state as server-sent events, `fps` frames per second."""
    st = _server(http)

    async def frames():
        while not await http.is_disconnected():
            snap = await st.aengine.call(lambda: snapshot(st.engine, st.recorder))
            yield f"data: {json.dumps(snap)}\n\n"
            await asyncio.sleep(1.0 / fps)
    return StreamingResponse(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    with open(os.path.join(os.path.dirname(__file__), "static", "dashboard.html")) as f:
        return HTMLResponse(f.read())
