"""How many requests one fixed KV pool runs at once with and without giving back the blocks behind a
sliding window, on a random Mistral-shaped model whose every layer slides (the case pagedserve frees
today), same requests, same pool, one after the other.

Usage: python bench/window_admission.py [--window 256] [--blocks 200] [--requests 24] [--prompt 1024] [--out 64]
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(window: int, root: str) -> str:
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import load_tokenizer
    d = os.path.join(root, f"mistral-w{window}")
    if not os.path.isfile(os.path.join(d, "config.json")):
        torch.manual_seed(0)
        MistralForCausalLM(MistralConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                         max_position_embeddings=8192)).save_pretrained(d)
        load_tokenizer(resolve_model(None)).save_pretrained(d)
    return d


def run(folder: str, a, freeing: bool) -> dict:
    from pagedserve import LLM, SamplingParams
    llm = LLM(folder, dtype="float32", num_kv_blocks=a.blocks, block_size=16, max_num_seqs=64)
    eng = llm.engine
    if not freeing:       # the experiment's other arm: the same manager keeping every block
        eng.kv.sliding_window = 0
    for i in range(a.requests):
        eng.add_request(f"r{i}", {"prompt_token_ids": [(i * 131 + j) % 40000 + 100 for j in range(a.prompt)]},
                        SamplingParams(max_tokens=a.out, ignore_eos=True))
    peak, steps, t = 0, 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        peak = max(peak, len(eng.scheduler.running))
    wall = time.perf_counter() - t
    res = {"freeing": freeing, "peak_running": peak, "steps": steps, "preemptions": eng.scheduler.num_preemptions,
           "wall_s": round(wall, 2), "output_tok_s": round(a.requests * a.out / wall, 1)}
    llm.shutdown()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--out", type=int, default=64)
    a = ap.parse_args()
    folder = build(a.window, os.path.join(tempfile.gettempdir(), "pagedserve-window-bench"))
    print(json.dumps(vars(a)))
    for freeing in (False, True):
        print("RESULT " + json.dumps(run(folder, a, freeing)), flush=True)


if __name__ == "__main__":
    main()
