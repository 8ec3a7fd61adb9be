"""Where a one-row decode step's time goes (issue 23 item 2: the fixed cost outside the weight products):
one greedy sequence on the default model, its decode steps timed whole and in parts — inside the fused
layer call (its own clocks: products, attention, glue), the LM head, the rest of the forward, and the
engine around the forward (scheduling, input preparation, sampling, output processing).

Usage: python bench/step_anatomy.py [--steps 256] [--prompt 40] [--dtype auto] [--quantization auto]
           [--rows 1]   (rows: that many sequences decoding together) [--model FILE]
"""
import argparse
import json
import time

from pagedserve import LLM, SamplingParams
from pagedserve.host import describe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the bundled model)")
    a = ap.parse_args()
    print(f"host: {describe()}")
    blocks = max(512, a.rows * (a.prompt + a.steps + 48) // 16 + a.rows)   # every row decoding at once, none preempted
    llm = LLM(a.model, num_kv_blocks=blocks, dtype=a.dtype, quantization=a.quantization)
    eng, model = llm.engine, llm.engine.core.model
    if model.fused is None:
        raise SystemExit("this path runs decode steps layer by layer: nothing to take apart")
    head = {"s": 0.0}
    logits = model.compute_logits

    def timed_logits(h, *a, **k):
        t = time.perf_counter()
        out = logits(h, *a, **k)
        head["s"] += time.perf_counter() - t
        return out
    model.compute_logits = timed_logits
    sp = SamplingParams(max_tokens=a.steps + 16, ignore_eos=True)
    for i in range(a.rows):
        eng.add_request(f"r{i}", {"prompt_token_ids": [100 + (i + j) % 1000 for j in range(a.prompt)]}, sp)
    while eng.core.last_stats.num_decode_tokens != a.rows or eng.core.last_stats.num_prefill_tokens:
        assert all(o.error is None for o in eng.step())   # prefills, then one decode step before timing
    for _ in range(8):
        eng.step()
    model.fused.profile()
    head["s"] = 0.0
    step = forward = 0.0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        for out in eng.step():
            assert out.error is None, out.error
        forward += eng.core.last_stats.forward_s
    step = time.perf_counter() - t0
    products, attention, glue = (x / a.steps * 1e3 for x in model.fused.seconds)
    n = a.steps
    row = {"rows": a.rows, "step_ms": step / n * 1e3, "forward_ms": forward / n * 1e3,
           "fused_products_ms": products, "fused_attention_ms": attention, "fused_glue_ms": glue,
           "lm_head_ms": head["s"] / n * 1e3}
    row["forward_rest_ms"] = row["forward_ms"] - products - attention - glue - row["lm_head_ms"]
    row["engine_rest_ms"] = row["step_ms"] - row["forward_ms"]
    row["outside_products_ms"] = row["step_ms"] - products - row["lm_head_ms"]
    print("RESULT " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    print(f"\none decode step of {a.rows} row(s), mean of {n}: {row['step_ms']:.2f} ms")
    for k in ("fused_products_ms", "lm_head_ms", "fused_attention_ms", "fused_glue_ms", "forward_rest_ms",
              "engine_rest_ms"):
        print(f"  {k:22s} {row[k]:7.3f} ms")
    print(f"  outside the weight products (step - layer products - LM head): {row['outside_products_ms']:.2f} ms")


if __name__ == "__main__":
    main()
