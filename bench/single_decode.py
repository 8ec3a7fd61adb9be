"""Single-request greedy decode tokens/s for every weight path this host runs (--dtype x --quantization),
next to HF transformers' `generate` in float32 and bfloat16 and llama.cpp on the same GGUF file, both
through llama-cpp-python (the bench-only extra, `make bench-llamacpp`) and through llama.cpp's own
`llama-server` (`make bench-llama-server`; one slot, --cache-ram 0, the same prompt ids over
/completion), in one run (ratios: the machine is shared). Each engine runs in its own process so its
RSS is its own.

Usage: python bench/single_decode.py [--tokens 128] [--repeats 3] [--paths auto:auto,float32:none,...]
           (a path may add :VAR=value, set in that engine's process: auto:auto:PAGEDSERVE_FUSED_DECODE=0)
           [--llama-server build/llama.cpp/bin/llama-server] [--no-llamacpp]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

PROMPT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids():
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import apply_chat_template, load_tokenizer
    return apply_chat_template(load_tokenizer(resolve_model(None)), PROMPT)


def timed(fn, tokens: int, repeats: int) -> float:
    fn(8)                                              # warm-up
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        fn(tokens)
        best = max(best, tokens / (time.perf_counter() - t))
    return best


def run_ours(path: str, tokens: int, repeats: int) -> dict:
    from pagedserve import LLM, SamplingParams
    dtype, quant, *env = path.split(":")          # dtype:quantization[:VAR=value] (an A/B knob, e.g.
    for kv in env:                                   # PAGEDSERVE_FUSED_DECODE=0), set before the engine loads
        name, _, value = kv.partition("=")
        os.environ[name] = value
    t0 = time.perf_counter()
    llm = LLM(num_kv_blocks=256, dtype=dtype, quantization=quant)
    load_s = time.perf_counter() - t0
    ids = prompt_ids()

    def gen(n):
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n
    tok_s = timed(gen, tokens, repeats)
    return {"engine": f"pagedserve --dtype {dtype} --quantization {quant}" + "".join(f" {kv}" for kv in env), "weights": llm.engine.core.model.weights_desc,
            "weights_mb": round(llm.engine.core.weights_bytes / 2**20, 1), "tok_s": round(tok_s, 2),
            "load_s": round(load_s, 2), "max_rss_mb": round(rss_mb())}


def run_hf(dtype: str, tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from pagedserve.model.loader import resolve_model
    src = resolve_model(None)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                              dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0
    x = torch.tensor([prompt_ids()])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(n):
        with torch.inference_mode():
            hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
    tok_s = timed(gen, tokens, repeats)
    return {"engine": f"HF generate {dtype}", "tok_s": round(tok_s, 2), "load_s": round(load_s, 2),
            "max_rss_mb": round(rss_mb())}


def run_llamacpp(tokens: int, repeats: int) -> dict:
    from llama_cpp import Llama
    from pagedserve.model.loader import resolve_model
    src = resolve_model(None)
    t0 = time.perf_counter()
    llm = Llama(model_path=src.path, n_ctx=1024, n_threads=os.cpu_count(), n_threads_batch=os.cpu_count(),
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    ids = prompt_ids()

    def gen(n):
        llm.reset()
        out = []
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == n:
                break
    tok_s = timed(gen, tokens, repeats)
    import llama_cpp
    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) on the same GGUF", "tok_s": round(tok_s, 2),
            "load_s": round(load_s, 2), "max_rss_mb": round(rss_mb())}


def run_llama_server(binary: str, tokens: int, repeats: int) -> dict:
    """llama.cpp's own server: one slot, no prompt cache, 2 threads (as ours), the same prompt token ids;
    timed per request from the client (the HTTP round trip is in it, as it would be for a user)."""
    import signal
    import urllib.request
    from server_proc import free_port, stop, wait_healthy
    from pagedserve.model.loader import resolve_model
    src = resolve_model(None)
    port = free_port()
    threads = str(os.cpu_count())
    cmd = [binary, "-m", src.path, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "1024", "-t", threads,
           "-tb", threads, "--cache-ram", "0", "--no-webui"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ids = prompt_ids()
    try:
        load_s = wait_healthy(proc, f"http://127.0.0.1:{port}/health", t0, 600, why=lambda: " ".join(cmd))[1]

        def gen(n):
            body = {"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0, "cache_prompt": False,
                    "return_tokens": True}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
            assert out["tokens_predicted"] == n, out
        tok_s = timed(gen, tokens, repeats)
        with open(f"/proc/{proc.pid}/status") as f:
            hwm = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    finally:
        stop(proc, signal.SIGINT, 30)
    return {"engine": "llama.cpp llama-server (same GGUF, -np 1, --cache-ram 0)", "tok_s": round(tok_s, 2),
            "load_s": round(load_s, 2), "max_rss_mb": round(hwm / 1024)}


def default_paths() -> list[str]:
    from pagedserve.host import bf16_flags
    dtypes = ["float32"] + (["bfloat16"] if bf16_flags() else [])
    return ["auto:auto", "auto:gguf"] + [f"{d}:{q}" for q in ("none", "gguf", "int8") for d in dtypes]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default=None, help="dtype:quantization,... (default: every path this host runs)")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama-cpp-python")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "build/llama.cpp/bin/llama-server"),
                    help="llama.cpp's llama-server binary (skipped when it is not there)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    if a.child:
        kind, _, arg = a.child.partition("=")
        res = {"ours": lambda: run_ours(arg, a.tokens, a.repeats), "hf": lambda: run_hf(arg, a.tokens, a.repeats),
               "llamacpp": lambda: run_llamacpp(a.tokens, a.repeats),
               "llama-server": lambda: run_llama_server(arg, a.tokens, a.repeats)}[kind]()
        print("RESULT " + json.dumps(res), flush=True)
        return
    from pagedserve.host import describe
    print(f"host: {describe()}")
    jobs = [f"ours={p}" for p in (a.paths.split(",") if a.paths else default_paths())]
    jobs += [f"hf={d}" for d in a.hf_dtypes.split(",") if d]
    jobs += [] if a.no_llamacpp else ["llamacpp="]
    if os.path.isfile(a.llama_server):
        jobs.append(f"llama-server={a.llama_server}")
    else:
        print(f"no llama-server at {a.llama_server} (make bench-llama-server): skipped")
    results = []
    for job in jobs:
        p = subprocess.run([sys.executable, __file__, "--child", job, "--tokens", str(a.tokens), "--repeats",
                            str(a.repeats)], capture_output=True, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(f"{job}: failed\n{p.stderr[-2000:]}")
            continue
        results.append(json.loads(line[0][7:]))
        print(line[0], flush=True)
    ref = {r["engine"]: r["tok_s"] for r in results}
    lcpp = max((v for k, v in ref.items() if k.startswith("llama.cpp")), default=None)     # its best
    hf32 = ref.get("HF generate float32")
    print("\n| engine | weights | tok/s | x HF fp32 | x llama.cpp | weights MiB | max RSS MiB |\n|---|---|---|---|---|---|---|")
    for r in results:
        x_hf = f"{r['tok_s'] / hf32:.2f}" if hf32 else "-"
        x_lcpp = f"{r['tok_s'] / lcpp:.2f}" if lcpp else "-"
        print(f"| {r['engine']} | {r.get('weights', '')} | {r['tok_s']} | {x_hf} | {x_lcpp} | "
              f"{r.get('weights_mb', '')} | {r['max_rss_mb']} |")


if __name__ == "__main__":
    main()
