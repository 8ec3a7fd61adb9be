"""Model load time and single-sequence greedy decode tokens/s: pagedserve next to HF transformers'
`generate` on the same prompt, in the same run (ratios, since the machine is shared).

Usage: python bench/single_decode.py [--tokens 128] [--repeats 3]
"""
import argparse
import json
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from pagedserve import LLM, SamplingParams
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import apply_chat_template

    t0 = time.perf_counter()
    llm = LLM(num_kv_blocks=256)
    load_s = time.perf_counter() - t0
    ids = apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": "Tell me a long story about a dragon."}])
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=8), use_tqdm=False)   # warm-up
    ours = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        ours.append(a.tokens / (time.perf_counter() - t))

    from transformers import AutoModelForCausalLM
    src = resolve_model(None)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                              dtype=torch.float32).eval()
    hf_load_s = time.perf_counter() - t0
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(x, max_new_tokens=8, **kw)
        theirs = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            hf.generate(x, max_new_tokens=a.tokens, min_new_tokens=a.tokens, **kw)
            theirs.append(a.tokens / (time.perf_counter() - t))
    res = {"prompt_tokens": len(ids), "new_tokens": a.tokens, "pagedserve_load_s": round(load_s, 2),
           "hf_load_s": round(hf_load_s, 2), "pagedserve_tok_s": round(max(ours), 2), "hf_tok_s": round(max(theirs), 2),
           "ratio": round(max(ours) / max(theirs), 2), "threads": torch.get_num_threads()}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
