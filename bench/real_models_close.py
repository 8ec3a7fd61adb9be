"""Default flags against --dtype float32 on a real file: greedy 24 tokens of three chat prompts, by the closeness
rule (equal, or at the first difference each token in the other's top-5). Usage: python bench/real_models_close.py FILE"""
import sys, json
from pagedserve import LLM, SamplingParams
from pagedserve.tokenizer import apply_chat_template
path = sys.argv[1]
qs = ["Write a Python function that reverses a string.", "What is a hash map?", "Explain recursion in one sentence."]
sp = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)
res = {}
for kw in ({}, {"dtype": "float32"}):
    llm = LLM(path, num_kv_blocks=256, **kw)
    ids = [apply_chat_template(llm.engine.tokenizer, [{"role": "user", "content": q}]) for q in qs]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    res[kw.get("dtype", "default")] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    del llm
ok = []
for (ta, la), (tb, lb) in zip(res["float32"], res["default"]):
    j = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
    ok.append("equal" if j is None else f"diverge@{j} " + ("close" if ta[j] in lb[j] and tb[j] in la[j] else "NOT close"))
print(json.dumps(ok))
