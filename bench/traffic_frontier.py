"""Issue 54's workload through the engine alone (no HTTP, no client on the cores): one interactive client
streaming short chats back to back (closed loop: 24-80-token prompts, --inter-out tokens out, ITL target
--itl-ms, TTFT target --ttft-ms) beside --batch concurrent ~1.5k-token batch prompts (256 out, priority 10;
each finished one is replaced at once). Every step is recorded: its measured time (the whole engine step:
schedule, run, apply) against the step-time model's prediction of its rows, what it carries (interactive
decodes and prefill, batch decodes and prefill tokens, preemptions, swaps) and whether the live model refitted
in it. Printed: interactive ITL / TTFT p50 and p99, the steps over the target (count, and the slowest with
their rows), and the batch class's computed tokens per second over the window. --no-classes: priorities only.

Usage: cd bench; python traffic_frontier.py [--itl-ms 150] [--ttft-ms 1000] [--batch 24] [--duration 60]
           [--warmup 0] [--no-classes] [--max-model-len 2048] [--out FILE]
"""
import argparse
import json
import random
import time

from serving import pct as percentile

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.host import describe
from pagedserve.sampling_params import SamplingParams
from pagedserve.sim.cost_model import row_features


def pct(xs, p):
    return None if not xs else round(1e3 * percentile(xs, p), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--itl-ms", type=float, default=150.0)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--batch-len", type=int, default=1500)
    ap.add_argument("--inter-out", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=0.0, help="seconds before the window that is measured")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--no-classes", action="store_true")
    ap.add_argument("--engine-args", default="{}", help="JSON of more EngineArgs (e.g. max_num_batched_tokens)")
    ap.add_argument("--out", default=None, help="write every step's record here (JSON lines)")
    a = ap.parse_args()
    print(f"host: {describe()}")
    classes = [{"name": "interactive", "priority": 0, "itl_p99_ms": a.itl_ms, "ttft_p99_ms": a.ttft_ms},
               {"name": "batch", "priority": 10}]
    eng = LLMEngine(max_model_len=a.max_model_len, **json.loads(a.engine_args),
                    **({} if a.no_classes else {"traffic_classes": json.dumps(classes)}))
    core, rng = eng.core, random.Random(1)
    sch, cost = core.scheduler, core.step_cost
    steps = []

    def prompt(n):
        return {"prompt_token_ids": [rng.randrange(200, 40000) for _ in range(n)]}
    bp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0)
    ip = SamplingParams(max_tokens=a.inter_out, ignore_eos=True, temperature=0.0)
    klass = {"priority": 0} if a.no_classes else {"traffic_class": "interactive"}
    nb = ni = 0

    def add_batch():
        nonlocal nb
        eng.add_request(f"b{nb}", prompt(rng.randint(int(a.batch_len * 0.9), int(a.batch_len * 1.1))), bp,
                        priority=10)
        nb += 1
    for _ in range(a.batch):
        add_batch()
    t0 = time.perf_counter()
    window, end = t0 + a.warmup, t0 + a.warmup + a.duration
    sent, last, gaps, ttft, cur = {}, {}, [], [], None
    while time.perf_counter() < end:
        if cur is None:
            cur = f"i{ni}"
            eng.add_request(cur, prompt(rng.randint(24, 80)), ip, stream=True, **klass)
            sent[cur], ni = time.perf_counter(), ni + 1
        fits = cost.count if cost is not None else 0
        pre_fit = cost.model if cost is not None else None
        prior_scale = getattr(cost, "prior_scale", 1.0)
        ts = time.perf_counter()
        outs = eng.step()
        te = time.perf_counter()
        so, st = core.last_schedule, core.last_stats
        rows = [(s.request_id[0], s.start, s.num_tokens, s.sampling.num_samples if s.sampling else 0) for s in so.seqs]
        rec = {"t": te - t0, "step_s": te - ts, "run_s": st.step_s if st else None, "pred_s": None,
               "refit": cost is not None and cost.model is not pre_fit, "fits_seen": fits,
               "i_dec": sum(1 for r in rows if r[0] == "i" and r[2] == 1),
               "i_pre": sum(r[2] for r in rows if r[0] == "i" and r[2] > 1),
               "b_dec": sum(1 for r in rows if r[0] == "b" and r[2] == 1 and r[3]),
               "b_pre": sum(r[2] for r in rows if r[0] == "b" and not (r[2] == 1 and r[3])),
               "b_pre_rows": [(r[1], r[2]) for r in rows if r[0] == "b" and not (r[2] == 1 and r[3])],
               "preempted": len(so.preempted), "swaps": len(so.block_ops.swap_out) + len(so.block_ops.swap_in),
               "running": len(sch.running), "waiting": len(sch.waiting), "limits": dict(sch.last_limits)}
        # the prediction the scheduler planned with (the model in force before this step's observe; before
        # the first fit its prior, when the engine has one)
        planned = pre_fit if pre_fit is not None else getattr(cost, "prior", None) if cost is not None else None
        if planned is not None:
            rec["pred_s"] = planned.step_time(row_features(cost.shape, [r[1:] for r in rows])) * (
                prior_scale if pre_fit is None else 1.0)
        steps.append(rec)
        for o in outs:
            rid, t = o.request_id, time.perf_counter()
            if rid[0] == "i" and o.outputs:
                if t >= window:
                    (gaps if rid in last else ttft).append(t - last.get(rid, sent[rid]))
                last[rid] = t
                if o.finished:
                    cur = None
            if o.finished and rid[0] == "b":
                add_batch()
    target = a.itl_ms / 1e3
    ws = [s for s in steps if s["t"] >= a.warmup]
    over = [s for s in ws if s["i_dec"] and s["step_s"] > target]
    res = {"classes": not a.no_classes, "itl_target_ms": a.itl_ms, "ttft_target_ms": a.ttft_ms, "batch": a.batch,
           "interactive_requests": ni, "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99),
           "itl_max_ms": pct(gaps, 100), "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
           "steps": len(ws), "steps_with_interactive_decode": sum(1 for s in ws if s["i_dec"]),
           "of_those_over_target": len(over), "preemptions": sum(s["preempted"] for s in ws),
           "refits": sum(s["refit"] for s in ws),
           "steps_before_first_fit": sum(1 for s in ws if s["fits_seen"] < 16),
           "their_time_max_ms": pct([s["step_s"] for s in ws if s["fits_seen"] < 16], 100),
           "interactive_steps_predicted_over_plan": sum(1 for s in ws if s["i_dec"] and s["pred_s"] is not None
                                                        and s["pred_s"] > 0.8 * target),
           "batch_computed_tok_s": round(sum(s["b_dec"] + s["b_pre"] for s in ws) / (time.perf_counter() - window), 1)}
    for s in sorted(over, key=lambda s: -s["step_s"])[:8]:
        pred = "none (0 s: nothing cut)" if s["pred_s"] is None else f"{s['pred_s'] * 1e3:.1f}"
        print(f"  over: step {s['step_s'] * 1e3:6.1f} ms at t={s['t']:.1f}s (predicted {pred}; "
              f"{s['fits_seen']} steps observed{', refit here' if s['refit'] else ''}): interactive {s['i_dec']} decode + "
              f"{s['i_pre']} prefill, batch {s['b_dec']} decodes + prefill {s['b_pre_rows']}, "
              f"{s['preempted']} preempted")
    if a.out:
        with open(a.out, "w") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
