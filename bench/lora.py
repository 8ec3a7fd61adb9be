"""The throughput cost of LoRA rows: one engine (--enable-lora --max-loras 4), the same workload run
with every request on the base model and with the requests spread over 4 adapters and the base model
(request i: adapter i mod 5, 0 being the base), interleaved base / mixed / base / mixed so host drift
falls on both; prefix caching off, so every run computes every prompt. The adapters are random, rank
--rank, on every projection (q, k, v, o, gate, up, down) or on q and v, of every layer, written in
PEFT's file layout for the loaded model's shapes.

    python bench/lora.py --workload mixed16 --rank 16 --reps 2 [--targets all|qv]

--churn N instead loads an adapter, runs one request with it and unloads it, N times (a new name and folder
each time, as a server taking adapters at run time would), and prints the process's RSS every N/10 cycles:
adapter weights and slots must not accumulate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from throughput import load_workload  # noqa: E402


def write_adapter(d: str, cfg, rank: int, seed: int, targets: str = "all") -> str:
    """A random PEFT LoRA folder for a Llama-shaped model (A ~ N(0, 1/in), B ~ N(0, 0.02)); targets "all"
    (every projection) or "qv" (q_proj and v_proj: PEFT's default for Llama)."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    if targets == "qv":
        shapes = {k: v for k, v in shapes.items() if k in ("self_attn.q_proj", "self_attn.v_proj")}
    tensors = {}
    for i in range(cfg.num_layers):
        for mod, (inp, out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    os.makedirs(d, exist_ok=True)
    save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [m.split(".")[1] for m in shapes]}, f)
    return d


def run(llm, reqs, names: list[str | None]) -> dict:
    from pagedserve import LoRARequest, SamplingParams
    eng = llm.engine
    t = time.perf_counter()
    for r, name in zip(reqs, names):
        eng.add_request(r["id"], {"prompt_token_ids": r["prompt_token_ids"]},
                        SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                        lora_request=None if name is None else LoRARequest(name))
    got, steps, lora_rows = {}, 0, 0
    seconds = {"decode": 0.0, "prefill": 0.0}       # decode-only steps, steps with prompt tokens
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        for o in eng.step():
            got[o.request_id] = len(o.outputs[0].token_ids)
        seconds["prefill" if eng.core.last_schedule.num_prefill_tokens else "decode"] += time.perf_counter() - t0
        steps += 1
        lora_rows += sum(s.num_tokens for s in eng.core.last_schedule.seqs if s.lora_id)
    wall = time.perf_counter() - t
    o_tok = sum(r["max_tokens"] for r in reqs)
    return {"wall_s": round(wall, 2), "output_tok_s": round(o_tok / wall, 2), "steps": steps, "lora_rows": lora_rows,
            "decode_steps_s": round(seconds["decode"], 2), "prefill_steps_s": round(seconds["prefill"], 2),
            "token_counts_ok": all(got.get(r["id"]) == r["max_tokens"] for r in reqs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="mixed16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--targets", default="all", choices=("all", "qv"),
                    help="all: q, k, v, o, gate, up, down; qv: q and v (PEFT's default for Llama)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--churn", type=int, default=0, help="load / use / unload cycles instead of the throughput runs")
    a = ap.parse_args()
    from pagedserve import LLM, SamplingParams
    from pagedserve.host import describe
    print(f"host: {describe()}")
    reqs = load_workload(a.workload)
    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=a.rank, dtype=a.dtype, quantization=a.quantization,
              num_kv_blocks=a.num_kv_blocks, enable_prefix_caching=False)   # each run computes every prompt
    eng = llm.engine
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    names = [f"adapter{i}" for i in range(1, 5)]
    for i, n in enumerate(names):
        eng.core.loras.load(n, write_adapter(os.path.join(tmp, n), eng.core.model_config, a.rank, i, a.targets))
    llm.generate([{"prompt_token_ids": list(range(100, 150))}], SamplingParams(max_tokens=4), use_tqdm=False)
    if a.churn:
        return churn(llm, tmp, a)
    mixed = [None if i % 5 == 0 else names[i % 5 - 1] for i in range(len(reqs))]
    results = {"base": [], "mixed": []}
    for rep in range(a.reps):
        for kind in ("base", "mixed"):
            batch = [dict(r, id=f"{kind}{rep}-{r['id']}") for r in reqs]
            r = run(llm, batch, [None] * len(reqs) if kind == "base" else mixed)
            r.update(kind=kind, rep=rep, workload=a.workload, rank=a.rank, targets=a.targets,
                     weights=eng.core.model.weights_desc)
            results[kind].append(r)
            print("RESULT " + json.dumps(r), flush=True)
    b = sum(r["output_tok_s"] for r in results["base"]) / a.reps
    m = sum(r["output_tok_s"] for r in results["mixed"]) / a.reps
    print(f"RATIO mixed (4 adapters of rank {a.rank} on {a.targets} + base) / base alone: {m / b:.3f}x output tok/s "
          f"(cost {100 * (1 - m / b):.1f} %)")
    for k in ("decode", "prefill"):         # where the cost is: seconds in steps of each kind, mixed / base
        sb = sum(r[f"{k}_steps_s"] for r in results["base"])
        sm = sum(r[f"{k}_steps_s"] for r in results["mixed"])
        print(f"  {k} steps: base {sb / a.reps:.2f} s, mixed {sm / a.reps:.2f} s a run ({sm / max(sb, 1e-9):.3f}x)")


def churn(llm, tmp: str, a) -> None:
    """Load, use and unload a fresh adapter `a.churn` times beside the 4 loaded ones; RSS as it goes."""
    from pagedserve import LoRARequest, SamplingParams
    eng = llm.engine
    paths = [write_adapter(os.path.join(tmp, f"churn{i}"), eng.core.model_config, a.rank, 100 + i, a.targets)
             for i in range(2)]                      # two folders, alternated: the registry sees new names
    rss = []
    for i in range(a.churn + 1):
        if i % max(1, a.churn // 10) == 0:
            rss.append((i, round(rss_mib(), 1)))
            print(f"cycle {i}: RSS {rss[-1][1]} MiB, loaded {len(eng.core.loras)}, slots held "
                  f"{len(eng.core.runner.lora.adapters)}", flush=True)
        if i == a.churn:
            break
        name = f"churn-{i}"
        eng.core.loras.load(name, paths[i % 2])
        llm.generate({"prompt_token_ids": list(range(200, 264))}, SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False, lora_request=LoRARequest(name))
        assert eng.core.loras.unload(name)
    print("RESULT " + json.dumps({"churn": a.churn, "rss_mib": rss, "rank": a.rank, "targets": a.targets,
                                  "held": eng.held(), "adapters_in_memory": len(eng.core.runner.lora.adapters)}))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    main()
