"""`pagedserve serve` (or another server) in a child process on a free loopback port, for the benchmarks:
start it, wait for its /health, stop it."""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int | None:
    """The status /health answers with (503 while loading), None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def wait_healthy(proc: subprocess.Popen, url: str, t0: float, timeout_s: float = 300.0,
                 why=lambda: "") -> tuple[float | None, float]:
    """Poll `url` until it answers 200: (seconds from t0 to its first answer of any status, to its 200).
    The process exiting first, or no 200 in timeout_s, raises (`why()`: what to add, e.g. its log)."""
    first = None
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}:\n{why()}")
        code = health(url)
        if code is not None and first is None:
            first = time.perf_counter() - t0
        if code == 200:
            return first, time.perf_counter() - t0
        time.sleep(0.02)
    raise RuntimeError(f"{url}: not 200 in {timeout_s} s")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
    """Signal the server, wait for it, kill it if it does not exit in time."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve(args_list: list[str], env: dict | None = None, ready_s: float = 180.0):
    """Start the server; return (process, base URL) once /health answers."""
    import httpx
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


def process_tree(pid: int) -> list[int]:
    """The server and every process under it (its engine core, tensor-parallel ranks, data-parallel replicas)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out
