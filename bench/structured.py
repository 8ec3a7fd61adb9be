"""The cost of structured outputs: mixed64 (../shared/bench/workload.py) offline with 0 %, 25 % and
100 % of its requests constrained by a JSON schema, one run after the other in one process.

The schema's first string must be at least 4000 characters long, so no constrained request can
finish its JSON inside its max_tokens (<= 256): every run generates exactly the same token counts
(ignore_eos, as the other throughput benchmarks) and the difference is the grammar's cost: the mask
of every constrained row computed each step (llguidance, in the scheduler) and applied in the sampler.

Usage: python bench/structured.py [--workload mixed64] [--fractions 0,0.25,1] [--dtype auto]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "status", "tags"],
          "properties": {"title": {"type": "string", "minLength": 4000},
                         "status": {"enum": ["draft", "published"]},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


def run(llm, reqs, fraction: float) -> dict:
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams
    eng = llm.engine
    every = 0 if fraction == 0 else round(1 / fraction)
    steps = []
    t = time.perf_counter()
    for i, r in enumerate(reqs):
        so = StructuredOutputsParams(json=SCHEMA) if every and i % every == 0 else None
        eng.add_request(f"{r['id']}-{fraction}-{time.monotonic_ns()}", {"prompt_token_ids": r["prompt_token_ids"]},
                        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, structured_outputs=so))
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id.rsplit("-", 2)[0]] = len(o.outputs[0].token_ids)
        steps.append(eng.core.last_stats)
    wall = time.perf_counter() - t
    o_tok = sum(got.values())
    other = sum(s.step_s - s.forward_s - s.prepare_s - s.sample_s for s in steps)   # schedule (incl. masks) etc.
    return {"fraction_constrained": fraction, "n_constrained": sum(1 for i in range(len(reqs)) if every and i % every == 0),
            "wall_s": round(wall, 2), "output_tokens": o_tok,
            "all_lengths_equal": all(got[r["id"]] == r["max_tokens"] for r in reqs),
            "output_tok_s": round(o_tok / wall, 2), "steps": len(steps),
            "schedule_and_other_s": round(other, 2), "sample_s": round(sum(s.sample_s for s in steps), 2),
            "forward_s": round(sum(s.forward_s for s in steps), 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mixed64")
    ap.add_argument("--fractions", default="0,0.25,1,0", help="the last 0 shows the drift over the run")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    args = ap.parse_args()
    from bench.throughput import load_workload
    from pagedserve import LLM, SamplingParams
    from pagedserve.host import describe
    print("host:", describe())
    reqs = load_workload(args.workload)
    # no prefix caching: every run recomputes the same prompts (a later run must not find them cached)
    llm = LLM(num_kv_blocks=args.num_kv_blocks, dtype=args.dtype, enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
    run(llm, reqs, 0.0)        # warm-up: the first pass over the workload's shapes is slower (discarded)
    results = []
    for f in [float(x) for x in args.fractions.split(",")]:
        res = run(llm, reqs, f)
        results.append(res)
        print("RESULT", json.dumps(res), flush=True)
    base = results[0]["output_tok_s"]
    for r in results:
        print(f"{r['fraction_constrained'] * 100:5.0f} % constrained: {r['output_tok_s']:8.1f} output tok/s "
              f"({r['output_tok_s'] / base:.3f}x of the first run)")


if __name__ == "__main__":
    main()
