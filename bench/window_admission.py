"""How many requests one fixed KV pool runs at once with and without giving back the blocks behind a
sliding window, same requests, same pool bytes, one after the other, on a random model of either
shape:
  mistral: every layer slides (one block table; the other arm keeps every block);
  gemma3:  Gemma 3's 5 sliding layers to 1 global (block tables per group of layers; the other arm is
           --disable-hybrid-kv-cache-manager: one table for every layer, KV behind the window kept).

Usage: python bench/window_admission.py [--family mistral|gemma3] [--window 256] [--kv-mib 25]
       [--requests 24] [--prompt 1024] [--out 64]
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(family: str, window: int, root: str) -> str:
    import torch
    import transformers
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import load_tokenizer
    d = os.path.join(root, f"{family}-w{window}")
    if not os.path.isfile(os.path.join(d, "config.json")):
        torch.manual_seed(0)
        shape = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2, sliding_window=window, max_position_embeddings=8192)
        if family == "mistral":
            model = transformers.MistralForCausalLM(transformers.MistralConfig(num_hidden_layers=4, **shape))
        else:        # 12 layers: every 6th global, as Gemma 3 (its own RoPE bases, head dim 64)
            model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
                num_hidden_layers=12, head_dim=64, query_pre_attn_scalar=64, **shape))
        model.save_pretrained(d)
        load_tokenizer(resolve_model(None)).save_pretrained(d)
    return d


def run(folder: str, a, freeing: bool) -> dict:
    from pagedserve import LLM, SamplingParams
    hybrid_off = a.family == "gemma3" and not freeing
    llm = LLM(folder, dtype="float32", kv_cache_memory=f"{a.kv_mib}MiB", block_size=16, max_num_seqs=64,
              disable_hybrid_kv_cache_manager=hybrid_off)
    eng = llm.engine
    if a.family == "mistral" and not freeing:     # the other arm: the same manager keeping every block
        eng.core.kv.windows = (0,) * len(eng.core.kv.windows)
    for i in range(a.requests):
        eng.add_request(f"r{i}", {"prompt_token_ids": [(i * 131 + j) % 40000 + 100 for j in range(a.prompt)]},
                        SamplingParams(max_tokens=a.out, ignore_eos=True))
    peak, steps, t = 0, 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        peak = max(peak, len(eng.core.scheduler.running))
    wall = time.perf_counter() - t
    res = {"freeing": freeing, "layout": eng.core.kv_layout.describe(), "pool_blocks": eng.core.kv.pool.num_usable_blocks,
           "pool_mib": round(eng.core.kv_cache_bytes / 2**20, 1), "peak_running": peak, "steps": steps,
           "preemptions": eng.core.scheduler.num_preemptions, "wall_s": round(wall, 2),
           "output_tok_s": round(a.requests * a.out / wall, 1)}
    llm.shutdown()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=("mistral", "gemma3"), default="mistral")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--kv-mib", type=float, default=25.0, help="the KV pool of both arms, in MiB")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--out", type=int, default=64)
    a = ap.parse_args()
    folder = build(a.family, a.window, os.path.join(tempfile.gettempdir(), "pagedserve-window-bench"))
    print(json.dumps(vars(a)))
    for freeing in (False, True):
        print("RESULT " + json.dumps(run(folder, a, freeing)), flush=True)


if __name__ == "__main__":
    main()
