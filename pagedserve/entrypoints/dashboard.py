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

from pagedserve.core.request import RequestStatus

router = APIRouter()
STEPS_KEPT = 300
LATENCIES_KEPT = 2000
# block states, as the page colours them
NULL, FREE, USED, CACHED = 0, 1, 2, 3
STATE_NAMES = ["null", "free", "used", "cached"]


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
        c, s = engine.counters, engine.last_stats
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
    """Everything the dashboard draws, read in the engine thread (call it between steps)."""
    sch, kv = engine.scheduler, engine.kv
    pool, bs, now = kv.pool, kv.block_size, time.monotonic()
    owners: dict[int, list[list]] = {}          # block id -> [[request index, first token, last token + 1]]
    reqs, index = [], {}
    queue = [("running", r) for r in sch.running] + [("waiting", r) for _, r in sorted(sch.waiting, key=lambda x: x[0])]
    for where, r in queue:
        index[r.request_id] = len(reqs)
        tables = kv.block_tables(r.request_id)      # one per group of layers (one for most models)
        for table in tables:
            for i, b in enumerate(table):
                lo = i * bs
                owners.setdefault(b, []).append([len(reqs), lo, min(lo + bs, max(r.num_computed_tokens, lo))])
        table = list(tables[0])
        entry = {"id": r.request_id, "queue": "swapped" if r.status is RequestStatus.SWAPPED else where,
                 "status": r.status.value, "priority": r.priority, "traffic_class": sch.class_name(r),
                 "num_computed_tokens": r.num_computed_tokens,
                 "num_tokens": r.num_tokens, "num_prompt_tokens": r.num_prompt_tokens,
                 "num_output_tokens": r.num_output_tokens, "blocks": table,
                 "host_blocks": [h for hs in kv.swapped.get(r.request_id, ()) for h in hs if h is not None], "num_preemptions": r.num_preemptions,
                 "age_s": round(now - r.arrival_time, 2), "parent": r.parent_id}
        if where == "waiting":
            entry["reason"] = sch.waiting_reason(r)
            entry["blocks_needed"] = kv.new_blocks_needed(r.num_tokens - r.num_computed_tokens)
        reqs.append(entry)
    # O(used + cached blocks), not O(pool): most of a large pool is free and needs no visit
    n = pool.num_blocks
    state, ref, hashes = [FREE] * n, [0] * n, [None] * n
    state[0] = NULL
    for groups in kv.req_blocks.values():
        for b in (b for blocks in groups for b in blocks):
            if b is not pool.null_block:      # (behind a sliding window: given back)
                state[b.block_id], ref[b.block_id] = USED, b.ref_cnt
    for h, b in pool.cached.items():
        hashes[b.block_id] = f"{h & 0xFFFFFFFF:08x}"
        if b.ref_cnt == 0:
            state[b.block_id] = CACHED
    c, cfg = engine.counters, sch.cfg
    return {
        "time": round(now, 3), "step": c.steps, "model": engine.source.name,
        "startup": startup.as_dict() if (startup := getattr(engine, "startup", None)) is not None else None,
        "config": {"num_blocks": pool.num_blocks, "block_size": bs, "num_host_blocks": kv.num_host_blocks,
                   "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                   "max_model_len": cfg.max_model_len, "prefix_caching": kv.enable_caching},
        "blocks": {"state": state, "ref": ref, "hash": hashes,
                   "owners": {str(b): o for b, o in owners.items()}, "state_names": STATE_NAMES},
        "summary": {"free": state.count(FREE), "used": state.count(USED), "cached": state.count(CACHED),
                    "shared": sum(1 for r in ref if r > 1), "num_free_blocks": kv.num_free_blocks,
                    "num_cached_blocks": pool.num_cached_blocks(), "kv_usage": round(kv.usage(), 4),
                    "running": len(sch.running), "waiting": len(sch.waiting),
                    "swapped": sum(1 for _, r in sch.waiting if r.status is RequestStatus.SWAPPED),
                    "host_blocks_used": sum(h is not None for v in kv.swapped.values() for hs in v for h in hs)},
        "requests": reqs,
        "steps": list(recorder.steps),
        "health": {"prefix_queries": c.prefix_queries, "prefix_hits": c.prefix_hits,
                   "prefix_hit_rate": round(c.prefix_hits / c.prefix_queries, 4) if c.prefix_queries else None,
                   "ttft_s": _dist(recorder.ttft_s), "itl_s": _dist(recorder.itl_s), "tpot_s": _dist(recorder.tpot_s),
                   "generation_tokens": c.generation_tokens, "prompt_tokens": c.prompt_tokens,
                   "preemptions": c.preemptions, "finished": dict(c.finished), "spec_decode": _spec(sch),
                   "traffic_classes": sch.class_summary()},
    }


def _spec(sch) -> dict | None:
    """Speculative decoding's totals (None when it is off): vLLM's spec_decode counters."""
    if sch.spec is None:
        return None
    sp = sch.spec_stats
    return {"method": sch.spec.method, "draft_model": sch.spec.model, "num_speculative_tokens": sch.spec.num_speculative_tokens,
            "adaptive": sch.spec.adaptive, "num_drafts": sp.num_drafts, "num_draft_tokens": sp.num_draft_tokens,
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
