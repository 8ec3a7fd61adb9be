"""Tensor parallelism on this CPU: what the all-reduces cost, side by side in one run.

(1) One all-reduce of a (rows, hidden) float32 tensor between 2 ranks on this host: gloo over
    loopback vs the shared-memory path (pagedserve.distributed.shm), median of --reps calls.
(2) The engine on the same requests (the shared mixed16 workload's prompt lengths, capped; greedy,
    ignore_eos) at TP=1 and TP=2 with each all-reduce path: wall time, output tokens/s, mean step.
    Model: a random Llama shaped like SmolLM2-135M but with 8 query / 2 KV heads so it splits in 2
    (hidden 512, 30 layers, MLP 1536, vocab 49152), float32. Same tokens at TP=1 and TP=2 is checked.
Each rank gets cores / TP threads: on 2 cores, TP=2 runs two 1-thread halves of every matmul
instead of one 2-thread matmul, and adds 61 all-reduces per step. It is not a speed-up here.

Usage: python bench/tp_bench.py [--requests 16] [--max-prompt 256] [--max-tokens 64]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)          # bench/workload.py: the shared generator's copy


def allreduce_costs(reps: int) -> list[dict]:
    """Median seconds per all-reduce, rank 0's view, gloo vs shared memory."""
    import torch
    import torch.multiprocessing as mp
    from pagedserve.distributed.group import TPGroup
    results = []
    rows_list = (1, 16, 256, 1024)
    for kind in ("gloo", "shm"):
        os.environ["PAGEDSERVE_TP_ALLREDUCE"] = "gloo" if kind == "gloo" else "shm"
        rdv, store = TPGroup.host_store(2)
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_peer, args=(rdv, rows_list, reps))
        p.start()
        torch.set_num_threads(1)
        g = TPGroup.join(0, rdv, "cpu", store, same_host=True)
        for rows in rows_list:
            x = torch.randn(rows, 576)
            for _ in range(10):
                g.all_reduce(x)
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                g.all_reduce(x)
                ts.append(time.perf_counter() - t)
            results.append({"allreduce": g.allreduce_kind, "rows_x_576_fp32": rows,
                            "median_us": round(1e6 * statistics.median(ts), 1)})
        p.join(30)
        g.close()
    os.environ.pop("PAGEDSERVE_TP_ALLREDUCE", None)
    torch.set_num_threads(os.cpu_count() or 1)
    return results


def _peer(rdv, rows_list, reps):
    import torch
    from pagedserve.distributed.group import TPGroup
    torch.set_num_threads(1)
    g = TPGroup.join(1, rdv, "cpu", same_host=True)
    for rows in rows_list:
        x = torch.randn(rows, 576)
        for _ in range(10 + reps):
            g.all_reduce(x)
    g.close()


def make_model(d: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)


def run_engine(model: str, tp: int, kind: str, reqs, max_tokens: int) -> tuple[dict, list]:
    from pagedserve import LLM, SamplingParams
    os.environ["PAGEDSERVE_TP_ALLREDUCE"] = kind
    with LLM(model, dtype="float32", tensor_parallel_size=tp, num_kv_blocks=2048) as llm:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": reqs[0]}], SamplingParams(max_tokens=4), use_tqdm=False)   # warm
        steps0 = llm.engine.core.counters.steps
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r} for r in reqs], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        steps = llm.engine.core.counters.steps - steps0
        kind_used = llm.engine.core.executor.tp.allreduce_kind
    os.environ.pop("PAGEDSERVE_TP_ALLREDUCE", None)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return ({"tp": tp, "allreduce": kind_used, "wall_s": round(wall, 2), "output_tok_s": round(n_out / wall, 1),
             "steps": steps, "mean_step_ms": round(1e3 * wall / steps, 2)},
            [o.outputs[0].token_ids for o in outs])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    from pagedserve.host import describe
    from workload import make
    print("host:", describe())
    for r in allreduce_costs(args.reps):
        print("RESULT", json.dumps(r), flush=True)
    reqs = [w["prompt_token_ids"][:args.max_prompt] for w in make("mixed16")[:args.requests]]
    with tempfile.TemporaryDirectory() as d:
        make_model(d)
        base, base_tokens = run_engine(d, 1, "shm", reqs, args.max_tokens)
        print("RESULT", json.dumps(base), flush=True)
        for kind in ("gloo", "shm"):
            res, tokens = run_engine(d, 2, kind, reqs, args.max_tokens)
            res["speed_vs_tp1"] = round(base["wall_s"] / res["wall_s"], 3)
            res["same_tokens_as_tp1"] = tokens == base_tokens
            print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
