"""RSS against requests, per serving path: bench/soak.py once per path (a fresh `pagedserve serve`
each), the server's RSS (every rank's, with tensor parallelism) recorded every --rss-every requests,
drawn in one PNG and summarised as the growth after --warmup requests.

Usage: python bench/soak_rss.py [--requests 5000] [--paths float32,bfloat16,gguf,int8-kv,tp2]
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
    "float32": "--dtype float32",
    "bfloat16": "--dtype bfloat16",
    "gguf": "--quantization gguf",
    "int8-kv": "--kv-cache-dtype int8",
    "tp2": "--tensor-parallel-size 2",
}


def run_path(name: str, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "soak.json")
        flags = PATHS[name].split()
        kv = []
        if "--kv-cache-dtype" in flags:           # soak.py owns this flag
            i = flags.index("--kv-cache-dtype")
            kv, flags = flags[i:i + 2], flags[:i] + flags[i + 2:]
        cmd = [sys.executable, os.path.join(HERE, "soak.py"), "--requests", str(a.requests), "--rss-every",
               str(a.rss_every), "--warmup", str(a.warmup), "--seed", str(a.seed), "--json", out,
               "--serve-args", " ".join(flags), *kv]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if not os.path.exists(out):
            return {"path": name, "error": (p.stdout + p.stderr)[-2000:]}
        with open(out) as f:
            s = json.load(f)
    s["path"], s["exit"] = name, p.returncode
    return s


def plot(results: list[dict], warmup: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pagedserve.host import describe
    fig, ax = plt.subplots(figsize=(9, 5))
    for s in results:
        if "rss_mb" not in s:
            continue
        procs = sorted({k for _, r in s["rss_mb"] for k in r})
        for k in procs:
            xs = [n for n, r in s["rss_mb"] if k in r]
            ys = [r[k] for _, r in s["rss_mb"] if k in r]
            label = s["path"] if len(procs) == 1 else f"{s['path']} ({'rank 0' if k == 'server' else k})"
            ax.plot(xs, ys, marker=".", label=label)
    ax.axvline(warmup, color="grey", linestyle=":", label=f"warm-up ({warmup})")
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
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--rss-every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "soak_rss.png"))
    ap.add_argument("--json", default=os.path.join(HERE, "results", "soak_rss.json"))
    a = ap.parse_args(argv)
    results = []
    for name in a.paths.split(","):
        s = run_path(name, a)
        results.append(s)
        print(json.dumps({k: s.get(k) for k in ("path", "exit", "requests", "lost", "wall_s", "output_tokens",
                                                 "rss_growth_after_warmup_mb", "error")}), flush=True)
        with open(a.json, "w") as f:          # after every path: a long run leaves what it measured
            json.dump(results, f, indent=1)
        plot(results, a.warmup, a.out)
    return 0 if all(s.get("exit") == 0 for s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
