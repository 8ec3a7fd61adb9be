"""RSS against requests, per serving path: bench/soak.py once per path (a fresh `pagedserve serve`
each), the server's RSS (every rank's, with tensor parallelism) recorded every --rss-every requests,
drawn in one PNG and summarised as the rise of the RSS floor after warm-up (--warmup or a third of
the path's requests, whichever is less; soak.py's rss_growth).

Usage: python bench/soak_rss.py [--requests 5000] [--paths float32,bfloat16,gguf,int8-kv,tp2:1000]
       [--warmup 500] [--out bench/results/soak_rss.png] [--json bench/results/soak_rss.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PATHS = {       # name -> `pagedserve serve` flags
    "default": "",
    "float32": "--dtype float32",
    "bfloat16": "--dtype bfloat16",
    "gguf": "--quantization gguf",
    "int8-kv": "--kv-cache-dtype int8",
    "tp2": "--tensor-parallel-size 2 --dtype float32",
    "ngram": """--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'""",
    # a draft model drafting on every step: the bundled model drafting for itself ({bundled}: its path)
    "draft": """--speculative-config '{"model": "{bundled}", "num_speculative_tokens": 4, "adaptive": false}'""",
    # soak.py's priorities -1 / 0 / 1 pick the three bands (as in BENCHMARKS.md's traffic-class soak)
    "traffic-classes": """--traffic-classes '[{"name": "urgent", "priority": -1, "itl_p99_ms": 100, "ttft_p99_ms": 2000, "max_running": 6}, {"name": "normal", "priority": 0, "max_budget_share": 0.7, "preemption_mode": "swap"}, {"name": "low", "priority": 1, "max_budget_share": 0.3, "max_waiting": 20}]'""",
}
# the default model's 9 attention heads do not split in two: TP=2 runs a random Llama of the same depth
# and width class (30 layers, hidden 512, 8 heads, 4 KV heads) with the default model's tokenizer
TP_MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True)


HELPER_MB = 64       # a process of the server's tree below this at the start holds no model


def random_tp_model(d: str) -> str:
    import torch
    import transformers
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=len(tok), **TP_MODEL)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def bundled_model() -> str:
    from pagedserve.model.loader import resolve_model
    return resolve_model(None).path


def run_path(name: str, requests: int, warmup: int, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "soak.json")
        flags = PATHS[name]
        flags = (flags.replace("{bundled}", bundled_model()) if "{bundled}" in flags else flags).split()
        kv = []
        if "--kv-cache-dtype" in flags:           # soak.py owns this flag
            i = flags.index("--kv-cache-dtype")
            kv, flags = flags[i:i + 2], flags[:i] + flags[i + 2:]
        cmd = [sys.executable, os.path.join(HERE, "soak.py"), "--requests", str(requests), "--rss-every",
               str(a.rss_every), "--warmup", str(warmup), "--seed", str(a.seed), "--json", out,
               "--serve-args", " ".join(flags), *kv]
        if "--tensor-parallel-size" in flags:
            cmd += ["--model", random_tp_model(os.path.join(d, "model"))]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if not os.path.exists(out):
            return {"path": name, "error": (p.stdout + p.stderr)[-2000:]}
        with open(out) as f:
            s = json.load(f)
    s["path"], s["exit"], s["warmup"] = name, p.returncode, warmup
    return s


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pagedserve.host import describe
    fig, ax = plt.subplots(figsize=(9, 5))
    for s in results:
        if "rss_mb" not in s:
            continue
        # processes of the tree that hold a model (multiprocessing's resource tracker and such are left out)
        procs = sorted(k for k, v in s["rss_mb"][0][1].items() if v >= HELPER_MB)
        for k in procs:
            xs = [n for n, r in s["rss_mb"] if k in r]
            ys = [r[k] for _, r in s["rss_mb"] if k in r]
            label = s["path"] if len(procs) == 1 else f"{s['path']} ({'server, rank 0' if k == 'server' else k})"
            ax.plot(xs, ys, marker=".", label=label)
    for w in sorted({s["warmup"] for s in results if "warmup" in s}):
        ax.axvline(w, color="grey", linestyle=":", label=f"warm-up ({w})")
    ax.set_xlabel("requests finished")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"pagedserve serve RSS per path\n{describe()[:110]}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--paths", default=",".join(PATHS), help="names from PATHS, each optionally NAME:REQUESTS")
    ap.add_argument("--rss-every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "soak_rss.png"))
    ap.add_argument("--json", default=os.path.join(HERE, "results", "soak_rss.json"))
    a = ap.parse_args(argv)
    results = []
    for item in a.paths.split(","):
        name, _, n = item.partition(":")
        n = int(n or a.requests)
        s = run_path(name, n, min(a.warmup, n // 3), a)
        results.append(s)
        print(json.dumps({k: s.get(k) for k in ("path", "exit", "requests", "lost", "wall_s", "output_tokens",
                                                 "rss_growth_after_warmup_mb", "error")}), flush=True)
        with open(a.json, "w") as f:          # after every path: a long run leaves what it measured
            json.dump(results, f, indent=1)
        plot(results, a.out)
    return 0 if all(s.get("exit") == 0 for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
