"""Start-up of two source trees, A/B, alternating in one run: on a shared host the load drifts, and
alternating puts the drift on both alike. Per tree and run: `serve` exec -> /health 200 and `generate`
exec -> exit (bench/startup.py's measures, warm: each tree has its own cache folder, filled by an untimed
generate first), the engine's phases from its "ready in" line, each process's CPU seconds (user + sys:
what a loaded host disturbs least), the tokenizer's load alone in a fresh process (wall and CPU), and
`python -X importtime` of a generate: the process's top-level imports by cumulative time (the 8 largest,
and whether transformers is among them).

  python bench/startup_ab.py --tree A=/path/to/old --tree B=/path/to/new [--runs 5] [--python PY]
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from server_proc import free_port, stop, wait_healthy
from startup import GEN_WRAPPER, PROMPT, phases_of

IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")
TOKENIZER_LOAD = ("import resource, time; t0 = time.perf_counter()\n"
                  "from pagedserve.model.loader import resolve_model\n"
                  "from pagedserve.tokenizer import load_tokenizer\n"
                  "tok = load_tokenizer(resolve_model(None))\n"
                  "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
                  "r = resource.getrusage(resource.RUSAGE_SELF)\n"
                  "print(time.perf_counter() - t0, r.ru_utime + r.ru_stime)\n")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def tokenizer_once(py: str, tree: str, env: dict) -> dict:
    """import + load + one chat template in a fresh process: (wall, CPU) seconds."""
    r = subprocess.run([py, "-c", TOKENIZER_LOAD], env=env, cwd=tree, capture_output=True, text=True, timeout=300)
    wall, cpu = map(float, r.stdout.split())
    return {"s": wall, "cpu_s": cpu, "phases": {}}


def serve_once(py: str, tree: str, env: dict) -> dict:
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    cpu0, t0 = children_cpu_s(), time.perf_counter()
    proc = subprocess.Popen([py, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port), "--log-level",
                             "info"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    try:
        _, ready = wait_healthy(proc, f"http://127.0.0.1:{port}/health", t0, 300)
    finally:
        stop(proc, signal.SIGTERM, 60)
    log.seek(0)
    return {"s": ready, "cpu_s": children_cpu_s() - cpu0, "phases": phases_of(log.read())}


def generate_once(py: str, tree: str, env: dict) -> dict:
    cpu0, t0 = children_cpu_s(), time.perf_counter()
    r = subprocess.run([py, "-c", GEN_WRAPPER, "generate", PROMPT, "--log-level", "info"], env=env, cwd=tree,
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return {"s": time.perf_counter() - t0, "cpu_s": children_cpu_s() - cpu0, "phases": phases_of(r.stderr)}


def import_times(py: str, tree: str, env: dict) -> dict[str, float]:
    """Top-level imports of one generate, cumulative seconds."""
    r = subprocess.run([py, "-X", "importtime", "-m", "pagedserve.entrypoints.cli", "generate", PROMPT,
                        "--max-tokens", "4"], env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    out: dict[str, float] = {}
    for m in IMPORT_LINE.finditer(r.stderr):
        if not m.group(3):                       # no indent: imported by the program itself
            out[m.group(4)] = out.get(m.group(4), 0.0) + int(m.group(2)) / 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH (a source tree), twice or more")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ns = ap.parse_args()
    trees = dict(t.split("=", 1) for t in ns.tree)
    work = tempfile.mkdtemp(prefix="pagedserve-startup-ab-")
    envs = {n: os.environ | {"PYTHONPATH": p, "PAGEDSERVE_CACHE": os.path.join(work, n)} for n, p in trees.items()}
    for n, p in trees.items():                   # fill each tree's cache (untimed)
        generate_once(ns.python, p, envs[n])
    rows: dict[str, dict[str, list]] = {n: {"serve": [], "generate": [], "tokenizer": [], "imports": []} for n in trees}
    for i in range(ns.runs):
        for n, p in trees.items():
            rows[n]["serve"].append(serve_once(ns.python, p, envs[n]))
            rows[n]["generate"].append(generate_once(ns.python, p, envs[n]))
            rows[n]["tokenizer"].append(tokenizer_once(ns.python, p, envs[n]))
            rows[n]["imports"].append(import_times(ns.python, p, envs[n]))
            print(f"run {i + 1} {n}: serve {rows[n]['serve'][-1]['s']:.2f} s, generate "
                  f"{rows[n]['generate'][-1]['s']:.2f} s", file=sys.stderr, flush=True)
    med = statistics.median
    print(f"\n{ns.runs} runs each, alternating; medians, s; load average {os.getloadavg()[0]:.1f} at the end\n")
    for what in ("serve", "generate", "tokenizer"):
        names = list(dict.fromkeys(k for n in trees for r in rows[n][what] for k in r["phases"]))
        print(f"{what:24}" + "".join(f"{n:>12}" for n in trees))
        label = {"serve": "exec -> /health 200", "generate": "exec -> exit", "tokenizer": "import+load+template"}
        print(f"{'  ' + label[what]:24}" + "".join(f"{med(r['s'] for r in rows[n][what]):12.2f}" for n in trees))
        print(f"{'  CPU s (user+sys)':24}" + "".join(f"{med(r['cpu_s'] for r in rows[n][what]):12.2f}"
                                                   for n in trees))
        for k in names:
            print(f"  {k[:22]:22}" + "".join(f"{med(r['phases'].get(k, 0.0) for r in rows[n][what]):12.2f}"
                                           for n in trees))
    print("\ntop-level imports of a generate (-X importtime, cumulative):")
    for n in trees:
        mods = list(dict.fromkeys(k for r in rows[n]["imports"] for k in r))
        by = {k: med(r.get(k, 0.0) for r in rows[n]["imports"]) for k in mods}
        top = sorted(by.items(), key=lambda kv: -kv[1])[:8]
        print(f"  {n}: all {med(sum(r.values()) for r in rows[n]['imports']):.2f} s; "
              + ", ".join(f"{k} {v:.2f}" for k, v in top)
              + f"; transformers {'imported' if 'transformers' in by else 'not imported'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
