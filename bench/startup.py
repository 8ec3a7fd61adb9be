"""Start-up time (issue 56: "start like llama.cpp"): how long `pagedserve serve` takes from exec to
/health 200, and `pagedserve generate "What is the capital of France?"` from exec to the first byte of its
streamed answer (the wait the issue's aim is about) and to exit, cold and warm,
with the process's peak and idle RSS and the engine's own phase breakdown (its "ready in" line).

  cold: every run with an empty cache folder of its own (PAGEDSERVE_CACHE: the converted tokenizer, the
        dequantized and packed weights, calibrations: everything pagedserve keeps on disk); the native
        kernels are make setup's installed builds (pagedserve/native_build.py), as a wheel's compiled
        extension is there at first start; --cold-kernels ignores them (a host the install did not see:
        gcc builds them into the empty cache)
  warm: one shared cache folder, filled by an untimed run first

The OS page cache is not dropped (that needs root and slows every other process on the host): "cold" is a
cold pagedserve cache, the model file itself may be in memory. --llama-server PATH adds llama.cpp's server on
the same GGUF file (time to its /health 200, its RSS).

  python bench/startup.py [--model PATH] [--runs 3] [--llama-server PATH] [--skip cold] [--json out.json]
                          [--cold-kernels] [--serve-variant in-process=--no-engine-process ...]

serve's RSS is its process tree's (the engine core runs in a child process by default): the sum of the
processes' RSS, and of their peaks.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from server_proc import free_port, process_tree, stop, wait_healthy

PROMPT = "What is the capital of France?"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mb(pid: int) -> tuple[float, float]:
    """(RSS now, peak RSS) of a live process and its descendants (serve's engine core runs in a child), MiB: the
    sum of their RSS now, and the sum of their peaks (an upper bound of the tree's peak: theirs need not meet)."""
    now = peak = 0.0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        now += int(line.split()[1]) / 1024
                    elif line.startswith("VmHWM:"):
                        peak += int(line.split()[1]) / 1024
        except OSError:                 # (ended meanwhile)
            pass
    return now, peak


def phases_of(log: str) -> dict[str, float]:
    """The engine's 'ready in X s: a 0.1, b 0.2 | RSS ...' line as {phase: seconds} (+ 'total'); serve with its
    core in a process of its own logs two, the core's then its own: the last is taken."""
    found = re.findall(r"ready in ([\d.]+) s: (.*?) \| RSS", log)
    if not found:
        return {}
    total, parts = found[-1]
    out = {"total": float(total)}
    for part in parts.split(", "):
        name, _, secs = part.rpartition(" ")
        out[name] = float(secs)
    return out


def run_serve(cmd: list[str], env: dict, port: int, timeout: float = 300) -> dict:
    """exec -> first answer on the port -> /health 200; then idle RSS (1 s after ready) and peak; SIGTERM."""
    log = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def tail() -> str:
        log.seek(0)
        return log.read()[-2000:]
    try:
        port_s, ready_s = wait_healthy(proc, f"http://127.0.0.1:{port}/health", t0, timeout, why=tail)
        time.sleep(1.0)
        idle, peak = rss_mb(proc.pid)
    finally:
        stop(proc, signal.SIGTERM, 60)
    log.seek(0)
    return {"ready_s": ready_s, "port_s": port_s, "idle_rss_mb": idle, "peak_rss_mb": peak,
            "phases": phases_of(log.read())}


def run_generate(cmd: list[str], env: dict) -> dict:
    """exec -> the answer's first byte on stdout (generate streams it: the wait a user sees) -> exit."""
    err = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, cwd=ROOT)
    first_s, out = float("nan"), b""
    while chunk := os.read(proc.stdout.fileno(), 4096):
        if not out.strip() and chunk.strip():
            first_s = time.perf_counter() - t0
        out += chunk
    proc.wait(timeout=600)
    wall = time.perf_counter() - t0
    err.seek(0)
    log = err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"generate exited {proc.returncode}:\n{log[-2000:]}")
    peak = 0.0
    m = re.search(r"PEAK_RSS_KB=(\d+)", log)
    if m:
        peak = int(m.group(1)) / 1024
    return {"wall_s": wall, "first_answer_s": first_s, "answer": out.decode(errors="replace").strip(),
            "peak_rss_mb": peak, "phases": phases_of(log)}


# generate runs under a tiny wrapper that reports the child's peak RSS (ru_maxrss) on stderr, from an exit
# handler (generate ends its process with cli.exit_now: the handlers run, the interpreter's teardown not)
GEN_WRAPPER = ("import atexit, resource, runpy, sys; sys.argv = ['pagedserve'] + sys.argv[1:]\n"
               "atexit.register(lambda: print(f'PEAK_RSS_KB={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', "
               "file=sys.stderr))\n"
               "runpy.run_module('pagedserve.entrypoints.cli', run_name='__main__')\n")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", choices=("cold", "warm"), action="append", default=[])
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: timed on the same file")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    ap.add_argument("--cold-kernels", action="store_true",
                    help="ignore make setup's installed kernel builds (PAGEDSERVE_INSTALLED_KERNELS=0)")
    ap.add_argument("--claims", action="store_true", help="update BENCHMARKS.md's start-up row (bench/claims.py)")
    ap.add_argument("--serve-variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="serve also with these flags, its rows named NAME (e.g. in-process=--no-engine-process); "
                         "repeatable; the plain serve rows are kept")
    ns = ap.parse_args()
    model = ns.model
    if model is None:
        sys.path.insert(0, ROOT)
        from pagedserve.model.loader import default_model_path
        model = default_model_path()
    base_env = os.environ | {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if ns.cold_kernels:
        base_env["PAGEDSERVE_INSTALLED_KERNELS"] = "0"
    serve_cmd = lambda port: [ns.python, "-m", "pagedserve.entrypoints.cli", "serve", model, "--port", str(port),  # noqa: E731
                              "--log-level", "info"]
    gen_cmd = [ns.python, "-c", GEN_WRAPPER, "generate", model, PROMPT, "--log-level", "info"]
    results: dict[str, list[dict]] = {}
    work = tempfile.mkdtemp(prefix="pagedserve-startup-")
    try:
        warm_cache = os.path.join(work, "warm")
        for mode in ("cold", "warm"):
            if mode in ns.skip:
                continue
            if mode == "warm":          # fill the shared cache (untimed)
                run_generate(gen_cmd, base_env | {"PAGEDSERVE_CACHE": warm_cache})
            variants = [("serve", [])] + [(f"serve {v.partition('=')[0]}", v.partition("=")[2].split())
                                          for v in ns.serve_variant]
            for what, flags in variants + [("generate", [])]:
                rows = results.setdefault(f"{mode} {what}", [])
                for i in range(ns.runs):
                    cache = os.path.join(work, f"cold-{what}-{i}".replace(" ", "-")) if mode == "cold" else warm_cache
                    env = base_env | {"PAGEDSERVE_CACHE": cache}
                    r = run_serve(serve_cmd(p := free_port()) + flags, env, p) if what.startswith("serve") \
                        else run_generate(gen_cmd, env)
                    rows.append(r)
                    print(f"  {mode} {what} run {i + 1}: "
                          + (f"ready {r['ready_s']:.2f} s (port {r['port_s']:.2f} s)" if what.startswith("serve")
                             else f"first answer {r['first_answer_s']:.2f} s, exit {r['wall_s']:.2f} s, answer "
                                  f"{r['answer'][:40]!r}"), file=sys.stderr, flush=True)
        if ns.llama_server:
            rows = results.setdefault("llama-server", [])
            for i in range(ns.runs):
                p = free_port()
                rows.append(run_serve([ns.llama_server, "-m", model, "--port", str(p), "--host", "127.0.0.1"],
                                      dict(os.environ), p))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nmodel {model}; {ns.runs} runs each, medians (a shared host: noisy)\n")
    print("ready: serve's /health 200, generate's first byte of its answer (exit: generate's whole answer)\n")
    print(f"{'':28} {'ready s':>8} {'port s':>8} {'exit s':>8} {'peak RSS MB':>12} {'idle RSS MB':>12}")
    nan = float("nan")
    for name, rows in results.items():
        t = med([r.get("ready_s", r.get("first_answer_s")) for r in rows])
        port = med([r["port_s"] for r in rows]) if "port_s" in rows[0] else nan
        wall = med([r["wall_s"] for r in rows]) if "wall_s" in rows[0] else nan
        idle = med([r["idle_rss_mb"] for r in rows]) if "idle_rss_mb" in rows[0] else nan
        print(f"{name:28} {t:8.2f} {port:8.2f} {wall:8.2f} {med([r['peak_rss_mb'] for r in rows]):12.0f} {idle:12.0f}")
    phase_rows = {name: rows for name, rows in results.items() if rows and rows[0].get("phases")}
    if phase_rows:
        names = list(dict.fromkeys(k for rows in phase_rows.values() for r in rows for k in r["phases"]))
        print("\nthe engine's phases (s, medians):\n")
        print(f"{'':16}" + "".join(f"{n[:14]:>16}" for n in phase_rows))
        for n in names:
            print(f"{n[:16]:16}" + "".join(f"{med([r['phases'].get(n, 0.0) for r in rows]):16.2f}"
                                          for rows in phase_rows.values()))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"model": model, "runs": results}, f, indent=1)
    if ns.claims and "warm serve" in results and "warm generate" in results:
        record_claim(results, ns)
    return 0


def record_claim(results: dict, ns) -> None:
    import claims
    serve, gen = results["warm serve"], results["warm generate"]
    ready, port = med([r["ready_s"] for r in serve]), med([r["port_s"] for r in serve])
    first, wall = med([r["first_answer_s"] for r in gen]), med([r["wall_s"] for r in gen])
    idle = med([r["idle_rss_mb"] for r in serve])
    llama = results.get("llama-server")
    ref = (f"llama-server ready {med([r['ready_s'] for r in llama]):.2f} s, idle RSS "
           f"{med([r['idle_rss_mb'] for r in llama]):.0f} MB (same file)") if llama else "-"
    met = lambda ok: "met" if ok else "**not met**"   # noqa: E731
    claims.update("startup-warm", command="`python bench/startup.py " + " ".join(sys.argv[1:]) + "`",
                  claim=f"Start-up, {'default model' if ns.model is None else os.path.basename(ns.model)}, warm "
                        f"(median of {ns.runs})",
                  ours=f"serve ready {ready:.2f} s (port answering 503 at {port:.2f} s); generate's first answer byte {first:.2f} s "
                       f"(its whole answer, exit: {wall:.2f} s); "
                       f"serve idle RSS {idle:.0f} MB",
                  reference=ref, ratio=f"aim ready <= 3 s {met(ready <= 3)}, generate answering <= 4 s {met(first <= 4)}, "
                                       f"idle RSS <= 1 GB {met(idle <= 1024)}")


if __name__ == "__main__":
    sys.exit(main())
