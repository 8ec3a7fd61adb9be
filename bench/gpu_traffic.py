"""bench/gpu_check.py's traffic section (issue 54 item 6): issue 26's aim for traffic classes, on the H200 with the
Llama-3-8B shape. bench/traffic_frontier.py's workload through the engine alone: one interactive client streaming
short chats back to back (closed loop) beside a batch class flooding with a few long prompts at priority 10, each
finished one replaced at once. Four runs, each `warmup_s` and then a measured window of `window_s` (longer, up
to `max_window_s`, until `min_requests` interactive first tokens and a batch token fell in it):
  idle             the interactive stream alone (no classes)
  batch_alone      the batch prompts alone (no classes): the batch class's best throughput
  priorities_only  both, without classes (priority 0 vs 10), for comparison
  classes          both, through an engine whose interactive class targets the aim itself: itl_p99_ms 1.5x and
                   ttft_p99_ms 2x the idle run's p99s, the batch class at priority 10
Per run: the interactive ITL (the gap between a stream's tokens) and TTFT at p50 / p99, and the batch class's
computed (prefill + decode) and sampled tokens per second over the window.
Aim (issue 26, restated in issue 54): with classes, ITL p99 <= 1.5x idle, TTFT p99 <= 2x idle, the batch class
>= 80 % of its throughput alone.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

ITL_AIM, TTFT_AIM, BATCH_AIM = 1.5, 2.0, 0.8


@dataclass(slots=True, frozen=True)
class Scenario:
    batch: int                      # batch prompts in flight
    batch_len: int                  # their length (+-10 %)
    batch_out: int
    inter_len: tuple[int, int]      # an interactive prompt's length, uniform in [lo, hi]
    inter_out: int
    warmup_s: float
    window_s: float
    min_requests: int               # the window runs on (up to max_window_s) until this many interactive first tokens
    max_window_s: float
    max_model_len: int
    max_num_batched_tokens: int


H200 = Scenario(batch=16, batch_len=3000, batch_out=128, inter_len=(24, 80), inter_out=64, warmup_s=3.0,
                window_s=12.0, min_requests=10, max_window_s=30.0, max_model_len=4096, max_num_batched_tokens=2048)
SMOKE = Scenario(batch=2, batch_len=96, batch_out=8, inter_len=(8, 16), inter_out=4, warmup_s=0.3, window_s=1.5,
                 min_requests=2, max_window_s=30.0, max_model_len=256, max_num_batched_tokens=128)


def pct_ms(xs: list[float], p: float) -> float | None:
    """The p-th percentile of seconds, in ms, by bench/serving.py's rule (the served benches' percentile)."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(1e3 * xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))], 2)


def class_targets(idle: dict) -> list[dict]:
    """The classes of the `classes` run: the interactive class's targets are the aim applied to the idle run."""
    return [{"name": "interactive", "priority": 0, "itl_p99_ms": round(ITL_AIM * idle["itl_p99_ms"], 2),
             "ttft_p99_ms": round(TTFT_AIM * idle["ttft_p99_ms"], 2)},
            {"name": "batch", "priority": 10}]


def verdict(idle: dict, alone: dict, mixed: dict) -> dict:
    """The classes run against the idle stream and the batch class alone: each ratio, each part of the aim and
    the whole aim as "met" / "not met"."""
    itl = mixed["itl_p99_ms"] / idle["itl_p99_ms"]
    ttft = mixed["ttft_p99_ms"] / idle["ttft_p99_ms"]
    batch = mixed["batch_computed_tok_s"] / alone["batch_computed_tok_s"]
    parts = {"itl_p99": itl <= ITL_AIM, "ttft_p99": ttft <= TTFT_AIM, "batch_throughput": batch >= BATCH_AIM}
    return dict(aim=f"ITL p99 <= {ITL_AIM}x idle, TTFT p99 <= {TTFT_AIM}x idle, batch >= {BATCH_AIM:.0%} of alone",
                itl_p99_vs_idle=round(itl, 2), ttft_p99_vs_idle=round(ttft, 2), batch_vs_alone=round(batch, 3),
                parts={k: "met" if v else "not met" for k, v in parts.items()},
                aim_met="met" if all(parts.values()) else "not met")


def drive(eng, sc: Scenario, tag: str, interactive: bool, batch: bool, classes: bool, seed: int = 1) -> dict:
    """One run on `eng`: the interactive client and / or the batch flood for warmup_s and the window (see
    Scenario), then every request left aborted (the engine empty for the next run)."""
    from pagedserve.sampling_params import SamplingParams
    rng = random.Random(seed)
    bp = SamplingParams(max_tokens=sc.batch_out, ignore_eos=True, temperature=0.0)
    ip = SamplingParams(max_tokens=sc.inter_out, ignore_eos=True, temperature=0.0)
    klass = {"traffic_class": "interactive"} if classes else {"priority": 0}
    batch_ids, open_ids, n = set(), set(), [0]

    def add(kind: str, length: int, params, **kw) -> str:
        rid = f"{tag}-{kind}{n[0]}"
        n[0] += 1
        eng.add_request(rid, {"prompt_token_ids": [rng.randrange(200, 40000) for _ in range(length)]}, params, **kw)
        open_ids.add(rid)
        return rid

    def add_batch() -> None:
        batch_ids.add(add("b", rng.randint(int(sc.batch_len * 0.9), int(sc.batch_len * 1.1)), bp, priority=10))
    for _ in range(sc.batch if batch else 0):
        add_batch()
    t0 = time.perf_counter()
    window, end = t0 + sc.warmup_s, t0 + sc.warmup_s + sc.window_s
    last_end = window + sc.max_window_s
    sent, last, gaps, ttft, cur, computed, sampled, steps = {}, {}, [], [], None, 0, 0, 0

    def measured() -> bool:                 # enough in the window for its percentiles and throughput
        return (not interactive or len(ttft) >= sc.min_requests) and (not batch or sampled > 0)
    while (t := time.perf_counter()) < end or (t < last_end and not measured()):
        if interactive and cur is None:
            cur = add("i", rng.randint(*sc.inter_len), ip, stream=True, **klass)
            sent[cur] = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        if now >= window:
            steps += 1
            for s in eng.core.last_schedule.seqs:
                if s.request_id in batch_ids:
                    computed += s.num_tokens
                    sampled += s.sampling.num_samples if s.sampling is not None else 0
        for o in outs:
            rid = o.request_id
            if o.finished:
                open_ids.discard(rid)
            if rid == cur and o.outputs:
                if now >= window:
                    (gaps if rid in last else ttft).append(now - last.get(rid, sent[rid]))
                last[rid] = now
                if o.finished:
                    cur = None
            if o.finished and rid in batch_ids:
                add_batch()
    span = time.perf_counter() - window
    for rid in list(open_ids):
        eng.abort(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return dict(interactive_requests=len(sent), steps=steps, itl_p50_ms=pct_ms(gaps, 50), itl_p99_ms=pct_ms(gaps, 99),
                ttft_p50_ms=pct_ms(ttft, 50), ttft_p99_ms=pct_ms(ttft, 99), itl_samples=len(gaps),
                ttft_samples=len(ttft), batch_computed_tok_s=round(computed / span, 1),
                batch_sampled_tok_s=round(sampled / span, 1))


def run(model_dir: str, device: str, smoke: bool) -> dict:
    """The four runs (two engines, one after the other) and the verdict."""
    import gc
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine
    sc = SMOKE if smoke else H200

    def engine(classes: list[dict] | None):
        return LLMEngine(EngineArgs(model=model_dir, dtype="bfloat16", device=device, max_model_len=sc.max_model_len,
                                    max_num_batched_tokens=sc.max_num_batched_tokens, gpu_memory_utilization=0.85,
                                    traffic_classes=json.dumps(classes) if classes else None))
    eng = engine(None)
    try:
        idle = drive(eng, sc, "idle", interactive=True, batch=False, classes=False)
        alone = drive(eng, sc, "alone", interactive=False, batch=True, classes=False)
        prio = drive(eng, sc, "prio", interactive=True, batch=True, classes=False)
    finally:
        eng.core.shutdown()
    del eng
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()
    classes = class_targets(idle)
    eng = engine(classes)
    try:
        mixed = drive(eng, sc, "classes", interactive=True, batch=True, classes=True)
        floor_ms = eng.core.startup_itl_floor_ms
    finally:
        eng.core.shutdown()
    return dict(scenario=asdict(sc), classes=classes, startup_itl_floor_ms=floor_ms, idle=idle, batch_alone=alone,
                priorities_only=prio, with_classes=mixed, priorities_only_verdict=verdict(idle, alone, prio),
                **verdict(idle, alone, mixed))
