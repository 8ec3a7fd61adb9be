"""`pagedserve serve --data-parallel-size N`: N `pagedserve serve` replicas (child processes on
loopback ports after --port) behind the cache-aware router on --host:--port. Each replica gets the
same engine flags and cores / N threads; children die with this process (no orphans) and get
SIGTERM (a graceful drain) when the router stops."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

log = logging.getLogger("pagedserve")
_OWN_FLAGS = ("--data-parallel-size", "--port", "--host")     # the router's; replicas get their own


def replica_argv(argv: list[str], port: int, threads: int | None) -> list[str]:
    """The `serve` command line of one replica: the same flags, its own loopback port."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _OWN_FLAGS:
            skip = True
            continue
        if a.startswith(tuple(f + "=" for f in _OWN_FLAGS)):
            continue
        out.append(a)
    out += ["--host", "127.0.0.1", "--port", str(port)]
    if threads and not any(a == "--num-threads" or a.startswith("--num-threads=") for a in argv):
        out += ["--num-threads", str(threads)]
    return out


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_data_parallel(ns, argv: list[str]) -> int:
    import uvicorn
    from pagedserve.router.app import build_router
    n = ns.data_parallel_size
    threads = max(1, (os.cpu_count() or 1) // n)
    ports = [ns.port + 1 + i for i in range(n)]
    if n < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {n}")
    procs = [subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve",
                               *replica_argv(argv, p, threads)], preexec_fn=_die_with_parent) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        _wait_ready(procs, urls, timeout_s=600)
        log.info("data parallel: %d replicas ready (%s); routing on http://%s:%d", n, ", ".join(urls),
                 ns.host, ns.port)
        server = uvicorn.Server(uvicorn.Config(build_router(urls, "cache_aware"), host=ns.host, port=ns.port,
                                               log_level="warning"))

        def on_signal(sig, frame):          # stop the router, then drain the replicas (below)
            server.should_exit = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        t = threading.Thread(target=server.run, name="pagedserve-router", daemon=True)
        t.start()
        while t.is_alive():                 # signals are handled on this (the main) thread
            t.join(0.5)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + ns.shutdown_timeout + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


def _wait_ready(procs, urls, timeout_s: float) -> None:
    t0 = time.monotonic()
    pending = set(range(len(urls)))
    while pending:
        for i in list(pending):
            if procs[i].poll() is not None:
                raise ValueError(f"data parallel: replica {i} ({urls[i]}) exited with code {procs[i].returncode} "
                                 "before it was ready")
            try:
                if httpx.get(urls[i] + "/health", timeout=1).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if time.monotonic() - t0 > timeout_s:
            raise ValueError(f"data parallel: replicas {sorted(pending)} not ready after {timeout_s:.0f} s")
        time.sleep(0.2)
