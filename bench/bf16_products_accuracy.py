"""bf16 prefill products (kernels.bf16_dots) against float32, on long chat prompts: the default model in float32,
in bf16 with the products on, and in bf16 with them off (the float32-product kernel), greedy; per prompt the
first token where each bf16 run leaves the float32 output, and the closeness rule (equal tokens, or at the first
difference each token in the other's top-5).

Usage: python bench/bf16_products_accuracy.py [--tokens 64]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import CHAT_PROMPTS  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.host import describe  # noqa: E402
from pagedserve.model.loader import resolve_model  # noqa: E402
from pagedserve.tokenizer import apply_chat_template, load_tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    print(f"host: {describe()}")
    tok = load_tokenizer(resolve_model(None))
    ctx = " ".join(CHAT_PROMPTS)           # ~235-token prompts: the attention has context to read
    prompts = [apply_chat_template(tok, [{"role": "user", "content": f"Here are some questions people asked: {ctx}"
                                                                     f"\n\nNow answer this one: {p}"}])
               for p in CHAT_PROMPTS]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, logprobs=5)
    outs = {}
    for name in ("float32", "bf16 products", "float32 products"):
        llm = LLM(num_kv_blocks=2048, dtype="float32" if name == "float32" else "bfloat16", enable_prefix_caching=False)
        runner = llm.engine.core.executor.runner
        if name == "float32 products":
            runner.bf16_dots = False
        print(f"{name}: dtype {runner.dtype}, bf16 products {runner.bf16_dots}")
        outs[name] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    res = {}
    for name in ("bf16 products", "float32 products"):
        first, close = [], 0
        for x, y in zip(outs[name], outs["float32"]):
            n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), None)
            first.append(n)
            close += n is None or (y.token_ids[n] in x.logprobs[n] and x.token_ids[n] in y.logprobs[n])
        res[name] = {"first_difference": first, "closeness_rule": f"{close}/{len(prompts)}"}
        print(f"bf16, {name}: first difference from float32 {first}; closeness rule {close}/{len(prompts)}")
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
