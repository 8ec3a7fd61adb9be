"""`pagedserve serve` in a child process on a free loopback port, for the benchmarks."""
import os
import socket
import subprocess
import sys
import time

import httpx


def serve(args_list: list[str], env: dict | None = None, ready_s: float = 180.0):
    """Start the server; return (process, base URL) once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port), *args_list],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env or os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < ready_s:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return srv, base
