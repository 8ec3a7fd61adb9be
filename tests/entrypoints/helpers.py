"""Start a server on a loopback port in a thread (tests) or in a child process (signals, exit codes)."""
from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port(run: int = 1) -> int:
    """A loopback port, the first of `run` consecutive free ones. A run is taken below the kernel's
    ephemeral range (where the suite's client sockets get their source ports, which could take a
    run's later ports between this check and the server binding them)."""
    if run == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        first = random.randrange(20000, 32000 - run)
        try:
            with contextlib.ExitStack() as stack:
                for p in range(first, first + run):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {run} consecutive free loopback ports")


@contextlib.contextmanager
def serve_in_thread(app):
    """Yields the base URL of uvicorn serving `app`; stops it and the engine thread afterwards."""
    import uvicorn
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    for _ in range(400):
        if srv.started:
            break
        time.sleep(0.025)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        aengine = getattr(app.state, "aengine", None)      # none for the router's app
        if aengine is not None:
            aengine.shutdown()


@contextlib.contextmanager
def serve_in_process(args: list[str], code: str | None = None, ready_timeout: float = 120.0, ports: int = 1):
    """`pagedserve serve ARGS` in a child process (or `python -c CODE` given the port as argv[1]).
    Yields (base URL, Popen); kills it if the test leaves it running. `ports`: how many consecutive
    ports from the base one it listens on (--data-parallel-size N: the router and N replicas)."""
    port = free_port(ports)
    if code is None:
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port), *args]
    else:
        cmd = [sys.executable, "-c", code, str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while time.time() - t0 < ready_timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early ({proc.returncode}):\n{proc.stdout.read()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)             # (not listening yet, or 503 while the model loads)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
