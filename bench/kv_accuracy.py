"""Greedy generation with a smaller KV cache (or bf16 weights) against float32, compared the way vLLM compares
backends (`check_logprobs_close`): the token lists are equal, or at the first position where they
differ each engine's token is among the other's top-5 logprobs (the rest is not compared).
Reports, per KV dtype, the first-difference position of each prompt and the mean absolute
difference of the chosen tokens' logprobs over the positions before it.

Usage: python bench/kv_accuracy.py [--tokens 64] [--kv-dtypes bfloat16,int8] [--dtype bfloat16]
       (--dtype: the weights' dtype of the compared runs; the reference is float32 weights and KV)
"""
import argparse
import json

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "What is 17 times 23? Show your steps.",
    "Translate 'good morning, my friend' into Spanish.",
    "Give me a short story about a robot who learns to paint.",
    "Why is the sky blue?",
]


def generate(kv_cache_dtype: str, tokens: int, dtype: str = "float32"):
    from pagedserve import LLM, SamplingParams
    llm = LLM(num_kv_blocks=1024, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=5), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def compare(ref, other) -> dict:
    """check_logprobs_close for one prompt: (ok, first difference or None, mean |logprob diff| before it)."""
    (ta, la), (tb, lb) = ref, other
    first, diffs = None, []
    for i, (a, b) in enumerate(zip(ta, tb)):
        if a != b:
            first = i
            ok = a in lb[i] and b in la[i]
            break
        diffs.append(abs(la[i][a].logprob - lb[i][b].logprob))
    else:
        ok = len(ta) == len(tb)
    return {"ok": ok, "first_difference": first, "mean_abs_logprob_diff": sum(diffs) / max(1, len(diffs))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-dtypes", default="bfloat16,int8")
    ap.add_argument("--dtype", default="float32", help="weights of the compared runs")
    a = ap.parse_args()
    ref = generate("float32", a.tokens)
    for kd in a.kv_dtypes.split(","):
        rows = [compare(r, o) for r, o in zip(ref, generate(kd, a.tokens, a.dtype))]
        print("RESULT " + json.dumps({
            "dtype": a.dtype, "kv_cache_dtype": kd, "prompts": len(rows), "tokens": a.tokens, "all_close": all(r["ok"] for r in rows),
            "identical": sum(r["first_difference"] is None for r in rows),
            "first_differences": [r["first_difference"] for r in rows],
            "mean_abs_logprob_diff": round(sum(r["mean_abs_logprob_diff"] for r in rows) / len(rows), 5)}))


if __name__ == "__main__":
    main()
