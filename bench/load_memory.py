"""The model load alone, as default flags make it (issue 51 item 3, issue 56): its time by start-up phase,
its RSS high-water mark and the RSS after it, one fresh process per load, trees compared alternately.

Each run loads FILE in a child process with `load_model` and the settings the engine's defaults choose on
this host (--quantization auto, --dtype auto), so a tree's loader is timed without the pool, the tokenizer
or a warm-up. The packed cache (PAGEDSERVE_CACHE) is filled by an untimed run of each tree first: the runs
are warm; --miss: each run misses it instead (a fresh cache folder, the native builds linked in from the
default one so no run compiles). Trees alternate run by run (the host may be shared: a busy minute hits both alike); peak RSS is a
high-water mark and does not depend on the load of the host.

  python bench/load_memory.py FILE [--tree OLD_TREE --tree NEW_TREE] [--runs 3] [--miss]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, resource, sys, time
import torch
from pagedserve.engine import startup
from pagedserve.model.loader import load_model, resolve_model
from pagedserve.model.quant import choose_quantization, int8_activations
from pagedserve.host import cpu_info
flags = cpu_info()[1]
dtype = torch.bfloat16 if {"amx_bf16", "avx512_bf16"} & flags else torch.float32
quant, dense_copy, _ = choose_quantization("auto", "gguf", "auto", "cpu", 1)
int8_act, _ = int8_activations("auto", quant)
timer = startup.StartupTimer()
t0 = time.perf_counter()
with startup.activate(timer):
    load_model(resolve_model(sys.argv[1]), dtype, "cpu", quant, None, int8_act, dense_copy)
with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
print(json.dumps({"load_s": time.perf_counter() - t0, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "after_mb": rss, "phases": timer.seconds()}))
"""


def run(tree: str, model: str, miss: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    if miss:
        env["PAGEDSERVE_CACHE"] = cache = tempfile.mkdtemp(prefix="pagedserve-load-")
        builds = os.path.join(os.environ.get("PAGEDSERVE_CACHE", os.path.expanduser("~/.cache/pagedserve")), "kernels")
        os.symlink(builds, os.path.join(cache, "kernels"))
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, cwd=tree, capture_output=True, text=True)
    finally:
        if miss:                        # the entry it wrote: hundreds of MB
            shutil.rmtree(cache, ignore_errors=True)
    if out.returncode:
        raise SystemExit(f"{tree}: the load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tree", action="append", help="a pagedserve checkout (repeat to compare; default: this one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--miss", action="store_true", help="every run misses the packed cache (a fresh folder)")
    args = ap.parse_args()
    trees = args.tree or [ROOT]
    for tree in [] if args.miss else trees:     # fills the packed cache: the timed runs are warm
        run(tree, args.model)
    rows: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(args.runs):
        for tree in trees:
            rows[tree].append(run(tree, args.model, args.miss))
    print(f"{os.path.basename(args.model)}, {args.runs} {'missing' if args.miss else 'warm'} runs each, alternating "
          "(median):")
    for tree, rs in rows.items():
        med = lambda k: statistics.median(r[k] for r in rs)                       # noqa: E731
        read = statistics.median(r["phases"].get("model read", 0.0) for r in rs)
        print(f"  {tree}: load {med('load_s'):.2f} s (model read {read:.2f} s), peak RSS {med('peak_mb'):.0f} MB, "
              f"after load {med('after_mb'):.0f} MB")
        print("    phases (s, median): " + json.dumps({k: round(statistics.median(r["phases"].get(k, 0.0) for r in rs), 3)
                                                       for k in rs[0]["phases"]}))


if __name__ == "__main__":
    main()
