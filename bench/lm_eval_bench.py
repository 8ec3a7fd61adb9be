"""lm-evaluation-harness wall time on our multiple-choice task (tests/entrypoints/lm_eval_tasks.py,
made --repeat x 20 distinct questions, 4 choices each): `local-completions` against `pagedserve serve`
(a child process, started before the clock) next to lm-eval's own `hf` backend on the transformers
model loaded from the same GGUF, in one run. Also prints the largest per-choice loglikelihood
difference and both accuracies.

Usage: python bench/lm_eval_bench.py [--repeat 10] [--batch-size 8] [--num-concurrent 1] [--dtype float32]
"""
import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-concurrent", type=int, default=1)
    ap.add_argument("--dtype", default="float32", help="ours and HF's (float32: the exact path)")
    args = ap.parse_args()
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    import tests.entrypoints.lm_eval_tasks as T
    from bench.server_proc import serve
    from pagedserve.host import describe
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import load_tokenizer
    print("host:", describe())
    # distinct questions (a repeated one would be deduplicated by lm-eval's hf backend)
    T.MC = [(f"({k + 1}) {q}" if k else q, c, a) for k in range(args.repeat) for q, c, a in T.MC]
    folder = tempfile.mkdtemp()
    T.write_tasks(folder)
    tm = TaskManager(include_path=folder)
    n_docs = len(T.MC)

    srv, base = serve(["--dtype", args.dtype, "--served-model-name", "smollm2", "--num-kv-blocks", "2048",
                       "--max-num-seqs", "64"])
    try:
        t = time.perf_counter()
        ours = simple_evaluate(model="local-completions", tasks=["pagedserve_mc"], task_manager=tm, log_samples=True,
                               model_args={"base_url": f"{base}/v1/completions", "model": "smollm2",
                                           "tokenizer_backend": "remote", "batch_size": args.batch_size,
                                           "num_concurrent": args.num_concurrent, "max_retries": 1})
        ours_s = time.perf_counter() - t
    finally:
        srv.terminate()
        srv.wait(timeout=60)

    src = resolve_model(None)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                              dtype=dtype).eval()
    lm = HFLM(pretrained=hf, tokenizer=load_tokenizer(src), batch_size=args.batch_size)
    t = time.perf_counter()
    ref = simple_evaluate(model=lm, tasks=["pagedserve_mc"], task_manager=tm, log_samples=True)
    hf_s = time.perf_counter() - t

    def per_choice(res):
        return [[float(r[0][0]) for r in s["resps"]] for s in sorted(res["samples"]["pagedserve_mc"],
                                                                      key=lambda s: s["doc_id"])]
    worst = max(abs(x - y) for a, b in zip(per_choice(ours), per_choice(ref)) for x, y in zip(a, b))
    out = {"docs": n_docs, "requests": 4 * n_docs, "batch_size": args.batch_size, "num_concurrent": args.num_concurrent,
           "dtype": args.dtype, "pagedserve_wall_s": round(ours_s, 2), "hf_wall_s": round(hf_s, 2),
           "ratio_hf_over_ours": round(hf_s / ours_s, 3), "max_loglik_diff": worst,
           "acc_ours": ours["results"]["pagedserve_mc"]["acc,none"], "acc_hf": ref["results"]["pagedserve_mc"]["acc,none"]}
    print("RESULT", json.dumps(out))


if __name__ == "__main__":
    main()
