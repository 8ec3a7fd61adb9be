"""The core's side of the door's reads (engine/info.py): its EngineInfo, its CoreStats, and the two views of
its queues and pool that /debug/scheduler and the dashboard draw. Each reads the scheduler and the KV cache
manager and returns values only; call them in the engine thread, between two steps (AsyncLLMEngine.call)."""
from __future__ import annotations

import time
from dataclasses import replace

from pagedserve.core.request import RequestStatus
from pagedserve.engine.info import CoreStats, EncoderCacheTotals, EngineInfo, SpecTotals

# block states, as the dashboard colours them
NULL, FREE, USED, CACHED = 0, 1, 2, 3
STATE_NAMES = ["null", "free", "used", "cached"]


def engine_info(core) -> EngineInfo:
    """What the frontend may know of a built core (EngineCore or EncoderCore)."""
    sch, a, cfg = core.scheduler, core.args, core.model_config
    return EngineInfo(
        model_name=core.source.name, model_path=core.source.path, arch=cfg.arch, generates=core.generates,
        max_model_len=core.max_model_len, max_num_seqs=sch.cfg.max_num_seqs,
        max_num_batched_tokens=sch.cfg.max_num_batched_tokens, block_size=a.block_size,
        num_kv_blocks=core.kv.pool.num_usable_blocks, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        eos_token_ids=tuple(core.eos_token_ids), traffic_classes=sch.classes, speculative=sch.spec,
        enable_lora=core.loras is not None, has_encoder_cache=sch.encoder is not None,
        pooling_types=tuple(core.pooling_types), model_pooling=dict(core.model_pooling),
        weights_bytes=core.weights_bytes, kv_cache_bytes=core.kv_cache_bytes, workspace_bytes=core.workspace_bytes,
        load_s=core.load_s, startup_itl_floor_ms=core.startup_itl_floor_ms)


def core_stats(core, shared: bool = False) -> CoreStats:
    """The core's state now. shared: also the blocks sharing saved (a walk over the pool)."""
    sch, kv, c = core.scheduler, core.kv, core.counters
    sp, enc = sch.spec_stats, sch.encoder
    free = kv.num_free_blocks
    return CoreStats(
        step=core.last_stats, counters=replace(c, finished=dict(c.finished)),
        num_running=len(sch.running), num_waiting=len(sch.waiting), num_free_blocks=free,
        num_used_blocks=kv.pool.num_usable_blocks - free, kv_usage=kv.usage(),
        spec=None if sch.spec is None else SpecTotals(sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens,
                                                      tuple(sp.accepted_per_pos)),
        encoder_cache=None if enc is None else EncoderCacheTotals(enc.hits, enc.misses, enc.size_tokens),
        classes=None if sch.classes is None else tuple(sch.class_summary()),
        num_shared_savings=kv.num_shared_savings() if shared else None)


def scheduler_view(core) -> dict:
    """/debug/scheduler's queues, classes, pool and limits."""
    sch, kv = core.scheduler, core.kv
    waiting = sorted(sch.waiting, key=lambda x: x[0])
    return {
        "step": core.counters.steps,
        "running": [{"request_id": r.request_id, "priority": r.priority, "traffic_class": sch.class_name(r),
                     "num_computed_tokens": r.num_computed_tokens,
                     "num_tokens": r.num_tokens, "blocks": kv.num_live_blocks(r.request_id)} for r in sch.running],
        "waiting": [{"request_id": r.request_id, "priority": r.priority, "traffic_class": sch.class_name(r),
                     "status": r.status.value, "num_tokens": r.num_tokens, "reason": sch.waiting_reason(r)}
                    for _, r in waiting],
        "traffic_classes": sch.class_summary(),
        "kv": {"blocks_total": kv.pool.num_usable_blocks, "blocks_free": kv.num_free_blocks,
               "blocks_cached": kv.pool.num_cached_blocks(), "usage": kv.usage(), "block_size": kv.block_size},
        "limits": {"max_num_seqs": sch.cfg.max_num_seqs, "max_num_batched_tokens": sch.cfg.max_num_batched_tokens,
                   "max_model_len": sch.cfg.max_model_len,
                   "itl_floor_ms_at_startup": None if core.startup_itl_floor_ms is None
                   else round(core.startup_itl_floor_ms, 1),
                   # the share of an ITL target (of a TTFT target's step share) steps are planned under now
                   # (traffic.StepHeadroom), and of the steps such a target bound, [how many ran past it, all];
                   # the share of a TTFT target a step may take (traffic.TtftShare) and [late first tokens, all]
                   **({} if sch.classes is None or sch.step_cost is None else {
                       "itl_headroom": round(sch.headroom.value, 3),
                       "itl_steps_past_target": [sch.headroom.misses, sch.headroom.steps],
                       "ttft_headroom": round(sch.ttft_headroom.value, 3),
                       "ttft_steps_past_target": [sch.ttft_headroom.misses, sch.ttft_headroom.steps],
                       "ttft_step_share": round(sch.ttft_share.value, 3),
                       "first_tokens_past_ttft_target": [sch.ttft_share.misses, sch.ttft_share.steps]})},
    }


def cache_view(core) -> dict:
    """The dashboard's picture of the pool and the queues: every block's state, refcount, prefix hash and
    owners; each running and waiting request with its block table (and, waiting, the scheduler's reason)."""
    sch, kv = core.scheduler, core.kv
    pool, bs, now = kv.pool, kv.block_size, time.monotonic()
    owners: dict[int, list[list]] = {}          # block id -> [[request index, first token, last token + 1]]
    reqs = []
    queue = [("running", r) for r in sch.running] + [("waiting", r) for _, r in sorted(sch.waiting, key=lambda x: x[0])]
    for where, r in queue:
        tables = kv.block_tables(r.request_id)      # one per group of layers (one for most models)
        for table in tables:
            for i, b in enumerate(table):
                lo = i * bs
                owners.setdefault(b, []).append([len(reqs), lo, min(lo + bs, max(r.num_computed_tokens, lo))])
        entry = {"id": r.request_id, "queue": "swapped" if r.status is RequestStatus.SWAPPED else where,
                 "status": r.status.value, "priority": r.priority, "traffic_class": sch.class_name(r),
                 "num_computed_tokens": r.num_computed_tokens,
                 "num_tokens": r.num_tokens, "num_prompt_tokens": r.num_prompt_tokens,
                 "num_output_tokens": r.num_output_tokens, "blocks": list(tables[0]),
                 "host_blocks": [h for hs in kv.swapped.get(r.request_id, ()) for h in hs if h is not None],
                 "num_preemptions": r.num_preemptions, "age_s": round(now - r.arrival_time, 2), "parent": r.parent_id}
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
    cfg = sch.cfg
    return {
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
    }
