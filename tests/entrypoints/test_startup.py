"""Start-up (issue 56): `serve` binds its port before anything heavy loads and answers /health 503
{"status": "loading", "phase": ...} (other routes 503) until the engine is ready, then 200; a load
that fails exits non-zero with its reason in one line; the start-up record has every phase, none
negative, and adds up to its total."""
import logging
import os
import subprocess
import sys
import time

import httpx

from pagedserve.engine.startup import StartupTimer
from pagedserve.entrypoints.front import Front

from tests.entrypoints.helpers import free_port

CORE_PHASES = ("resolve model", "executor", "tokenizer", "plan", "GEMM shapes", "KV pool", "finish")
LOADER_PHASES = ("model read", "model build", "kernel loads")


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"status":"ok"}'})


def test_front_answers_503_with_the_phase_until_the_app_is_swapped_in():
    timer = StartupTimer()
    port = free_port()
    front = Front(timer, "127.0.0.1", port).start()
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                r = httpx.get(base + "/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert r.status_code == 503 and r.json() == {"status": "loading", "phase": "starting"}
        with timer.phase("model read"):
            r = httpx.get(base + "/health", timeout=2)
            assert r.status_code == 503 and r.json()["phase"] == "model read"
            assert r.headers["retry-after"] == "1"
            r = httpx.post(base + "/v1/chat/completions", json={}, timeout=2)
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_loading"
            assert "model read" in r.json()["error"]["message"]
        front.app.inner = _ok
        r = httpx.get(base + "/health", timeout=2)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    finally:
        front.stop()
    assert [p.name for p in timer.phases] == ["model read"] and timer.phases[0].seconds >= 0


# the real `serve`, its load held at the gate (a file) until the test has seen /health 503 with the phase
HELD = """
import os, sys, time
import pagedserve.engine.llm_engine as le
real = le.LLMEngine.__init__
def held(self, *a, **k):
    with k["startup"].phase("held by the test"):     # the record serve passes the engine
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.05)
    real(self, *a, **k)
le.LLMEngine.__init__ = held
from pagedserve.entrypoints.cli import main
sys.exit(main(["serve", "--port", sys.argv[1], "--num-kv-blocks", "64", "--log-level", "warning"]))
"""


def test_serve_answers_health_503_while_loading_then_200(tmp_path):
    gate = tmp_path / "go"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", HELD, str(port), str(gate)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    seen = []
    try:
        t0 = time.time()
        while time.time() - t0 < 180:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(base + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            if r.json().get("phase") == "held by the test" and not gate.exists():
                assert httpx.get(base + "/v1/models", timeout=2).status_code == 503
                gate.touch()
            time.sleep(0.1)
        assert (503, {"status": "loading", "phase": "held by the test"}) in seen
        assert seen[-1][0] == 200
        assert httpx.get(base + "/v1/models", timeout=5).status_code == 200
        state = httpx.get(base + "/debug/state", timeout=10).json()["startup"]
        assert state["ready"] and "held by the test" in [p["phase"] for p in state["phases"]]
        assert 'pagedserve:startup_phase_seconds{phase="imports"}' in httpx.get(base + "/metrics", timeout=5).text
    finally:
        proc.terminate()
        rc = proc.wait(timeout=60)
    assert rc == 0                          # SIGTERM: a graceful exit


def _serve_fails(model: str) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", model, "--port",
                        str(free_port()), "--log-level", "warning"], capture_output=True, text=True, timeout=180)
    return r.returncode, [line for line in r.stderr.splitlines() if line.strip()]


def test_a_load_failure_exits_non_zero_with_its_reason_in_one_line(tmp_path):
    rc, lines = _serve_fails(str(tmp_path / "missing.gguf"))
    assert rc != 0 and len(lines) == 1, lines
    assert lines[0].startswith("error: the model could not be loaded") and "missing.gguf" in lines[0]
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4000))
    rc, lines = _serve_fails(str(bad))
    assert rc != 0 and len(lines) == 1, lines
    assert lines[0].startswith("error: the model could not be loaded") and "corrupt.gguf" in lines[0]


def _check_record(rec: StartupTimer, *names: str) -> None:
    got = [p.name for p in rec.phases]
    for name in names:
        assert name in got, (name, got)
    assert all(p.seconds >= 0 and p.rss_mb >= 0 for p in rec.phases)
    assert abs(sum(p.seconds for p in rec.phases) - rec.total_s) < 1e-9
    assert rec.ready and rec.current == "ready"


def test_the_startup_record_has_every_phase(tmp_path, monkeypatch):
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.host import auto_dtype
    from pagedserve.model import loader, packed_cache
    monkeypatch.setattr(packed_cache, "cache_root", lambda: str(tmp_path))   # an empty packed-weight cache
    loader._LOADED.clear()                  # a load of its own: the loader's phases too
    eng = LLMEngine(num_kv_blocks=64)
    # bf16 hosts copy the 135M model's products (dense_copy_plan); float32 ones (AVX2 only) keep them packed:
    # its copies would be over the plan's size rule
    copies = ("dense copies",) if auto_dtype("cpu")[0] == "bfloat16" else ()
    assert ("dense copies" in eng.startup.seconds()) == bool(copies)
    _check_record(eng.startup, *CORE_PHASES, *LOADER_PHASES, "packed cache read", *copies, "packed cache write")
    loader._LOADED.clear()                  # the next start: the packed weights read from the cache
    eng = LLMEngine(num_kv_blocks=64)
    _check_record(eng.startup, *CORE_PHASES, *LOADER_PHASES, "packed cache read")
    assert "dense copies" not in eng.startup.seconds() and "packed cache write" not in eng.startup.seconds()
    again = LLMEngine(num_kv_blocks=64)     # the model shared with the first engine: one phase for it
    _check_record(again.startup, *CORE_PHASES, "model (shared, loaded before)")
    assert eng.startup.as_dict()["phases"][0]["phase"] == "resolve model"


def test_the_cli_logs_one_ready_line_with_the_imports(caplog, capsys):
    from pagedserve.entrypoints.cli import main
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        assert main(["generate", "Hi", "--max-tokens", "2", "--num-kv-blocks", "64", "--log-level", "info"]) == 0
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in ")]
    assert len(ready) == 1 and "imports " in ready[0] and "| RSS " in ready[0]


# `pagedserve generate` as a process of its own, with an exit handler of the caller's (as bench/startup.py's)
ONE_SHOT = """
import atexit, sys
mark = sys.argv[1]
atexit.register(lambda: open(mark, "w").write("exit handlers ran"))
sys.argv = ["pagedserve", "generate", "Hi", "--max-tokens", "3", "--num-kv-blocks", "64"]
from pagedserve.entrypoints.cli import main
sys.exit(main())
"""


def test_generate_as_a_process_skips_the_teardown_not_the_exit_handlers_or_the_answer(tmp_path):
    """cli.exit_now: the answer printed, the exit handlers run, status 0, without the interpreter's teardown
    (which the test cannot time: it checks what must survive skipping it)."""
    mark = tmp_path / "ran"
    r = subprocess.run([sys.executable, "-c", ONE_SHOT, str(mark)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() and r.stdout.endswith("\n")
    assert mark.read_text() == "exit handlers ran"
    r = subprocess.run([sys.executable, "-c", ONE_SHOT.replace('"64"]', '"64", "--max-tokens", "0"]'), str(mark)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "max_tokens" in r.stderr     # a refused request: its status, not exit_now's 0
