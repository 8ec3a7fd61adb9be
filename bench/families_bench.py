"""Other families' throughput next to HF transformers' continuous batching, on the same random weights
saved by transformers (a Qwen3-0.6B-shaped dense model, a small Qwen3-MoE-shaped model), the same
shared workload, the same dtype, run one after the other in this one invocation (2 threads each).

Usage: python bench/families_bench.py [--models qwen3-0.6b,qwen3-moe] [--workload mixed64] [--dtype float32]
       python bench/families_bench.py --requests 16 ...   (the first N requests of the workload)
Prints one RESULT line per engine and model, then the ratios.
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# config fields over each family's transformers defaults; the MoE is scaled down (Qwen3-30B-A3B does not
# fit this machine) but keeps its shape: many small experts, top-8 of 128 -> here top-4 of 32
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True)),
}


def build(name: str, root: str) -> str:
    import torch
    import transformers
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import load_tokenizer
    d = os.path.join(root, name)
    if os.path.isfile(os.path.join(d, "config.json")):
        return d
    cfg_cls, model_cls, fields = SHAPES[name]
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**fields)).save_pretrained(d)
    load_tokenizer(resolve_model(None)).save_pretrained(d)       # any tokenizer: the workload is token ids
    return d


def run_ours(folder: str, reqs: list[dict], dtype: str) -> dict:
    from pagedserve import LLM, SamplingParams
    llm = LLM(folder, dtype=dtype, num_kv_blocks=2048, max_num_seqs=64)
    llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
    eng, got = llm.engine, {}
    t = time.perf_counter()
    for r in reqs:
        eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t
    return _result("pagedserve", reqs, wall, all(got.get(r["id"]) == r["max_tokens"] for r in reqs))


def run_hf(folder: str, reqs: list[dict], dtype: str, device: str = "cpu") -> dict:
    """HF transformers' continuous batching on the same requests (bench/gpu_check.py runs it on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    if device == "cpu":
        torch.set_num_threads(2)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    except TypeError:                       # transformers 4 (a GPU image's): torch_dtype
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=getattr(torch, dtype),
                                                     attn_implementation="sdpa")
    model = model.to(device).eval()
    pages = sum(-(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // 256) for r in reqs) + 2
    # the config's field names moved between transformers releases (5.17, the H200 image's: block_size and no
    # auto_switch_to_flash; 5.24: page_size): name the ones this release has
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw = {"page_size" if "page_size" in fields else "block_size": 256, "num_blocks": pages}
    if "auto_switch_to_flash" in fields:
        kw["auto_switch_to_flash"] = False
    cbc = ContinuousBatchingConfig(**kw)
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r["max_tokens"] for r in reqs), eos_token_id=-1,
                          pad_token_id=0)
    results = {}
    # no inference_mode around it: 5.17 makes its static buffers here and updates them in place on its own
    # thread, outside the mode (a RuntimeError); the manager runs the model without gradients itself
    with model.continuous_batching_context_manager(
            generation_config=gc, continuous_batching_config=cbc, block=True, timeout=30, warmup=True) as manager:
        t = time.perf_counter()
        for r in reqs:
            manager.add_request(r["prompt_token_ids"], request_id=r["id"], max_new_tokens=r["max_tokens"],
                                eos_token_id=-1)
        while len(results) < len(reqs):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                break
        wall = time.perf_counter() - t
    ok = all(len(results[r["id"]].generated_tokens) == r["max_tokens"] for r in reqs if r["id"] in results)
    return _result("hf_cb", reqs, wall, ok and len(results) == len(reqs))


def _result(engine: str, reqs, wall: float, ok: bool) -> dict:
    out = sum(r["max_tokens"] for r in reqs)
    return {"engine": engine, "wall_s": round(wall, 2), "output_tok_s": round(out / wall, 2),
            "total_tok_s": round((out + sum(len(r["prompt_token_ids"]) for r in reqs)) / wall, 2),
            "token_counts_ok": ok}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-moe")
    ap.add_argument("--workload", default="mixed64")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "pagedserve-families-bench"))
    ap.add_argument("--side", choices=["ours", "hf"], help=argparse.SUPPRESS)      # one child's work
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, HERE)          # bench/workload.py: the shared generator's copy
    import workload
    reqs = workload.make(a.workload)[:a.requests]
    if a.side:
        res = (run_ours if a.side == "ours" else run_hf)(a.folder, reqs, a.dtype)
        print("RESULT " + json.dumps(res), flush=True)
        return
    for name in a.models.split(","):
        folder = build(name, a.root)
        got = {}
        for side in ("ours", "hf"):     # separate processes, one after the other (never at once: 2 cores)
            cmd = [sys.executable, __file__, "--side", side, "--folder", folder, "--workload", a.workload,
                   "--dtype", a.dtype] + (["--requests", str(a.requests)] if a.requests else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got[side] = json.loads(out.split("RESULT ", 1)[1])
            print(json.dumps({"model": name, "workload": a.workload, "dtype": a.dtype, **got[side]}), flush=True)
        print(f"{name}: pagedserve / HF CB = {got['ours']['output_tok_s'] / got['hf']['output_tok_s']:.2f}x "
              f"output tok/s ({a.workload}, {len(reqs)} requests, {a.dtype})", flush=True)


if __name__ == "__main__":
    main()
