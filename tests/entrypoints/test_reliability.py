"""Faults are contained and reported as faults: a failed step answers its requests with a 500 (or
an SSE error event), a dead engine fails every client at once and turns /health to 503 and the
process to exit 1, requests time out with 408, SIGTERM drains and exits 0, a chunked body is cut
at the size limit, the API key guards /v1 and /debug."""
import asyncio
import json
import logging
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.helpers import serve_in_process, serve_in_thread

KEY = "k"
H = {"Authorization": f"Bearer {KEY}"}
POISON = 4242          # a prompt holding this token makes the injected fault fire


@pytest.fixture(scope="module")
def engine():
    from pagedserve import EngineArgs, LLMEngine
    return LLMEngine(EngineArgs(num_kv_blocks=300, max_num_seqs=8))


@pytest.fixture()
def served(engine):
    """A fresh app (and engine thread) over the shared engine, per test."""
    from pagedserve.entrypoints.server import build_app
    apps = []

    @__import__("contextlib").contextmanager
    def make(**kw):
        app = build_app(engine, api_key=KEY, served_model_name="m", **kw)
        apps.append(app)
        with serve_in_thread(app) as base:
            yield base, app
    yield make
    assert not engine.has_unfinished_requests()
    assert all(b.ref_cnt == 0 for b in engine.core.kv.pool.blocks[1:])


def sse_events(r) -> list:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def wait(cond, timeout=10.0):
    t = time.time()
    while time.time() - t < timeout:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_step_fault_is_a_500_and_an_sse_error_and_spares_the_rest(served, engine, monkeypatch):
    real = engine.core.runner.execute

    def execute(so):
        if any(POISON in s.token_ids for s in so.seqs):
            raise RuntimeError("injected kernel fault")
        return real(so)
    monkeypatch.setattr(engine.core.runner, "execute", execute)
    with served() as (base, _):
        r = httpx.post(base + "/v1/completions", headers=H, json={"prompt": [1, 2, POISON], "max_tokens": 4})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected kernel fault" in err["message"]
        with httpx.stream("POST", base + "/v1/completions", headers=H,
                          json={"prompt": [1, 2, POISON], "max_tokens": 4, "stream": True}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and "injected kernel fault" in json.loads(events[-2])["error"]["message"]
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.APIError, match="injected kernel fault"):
            for _ in client.completions.create(model="m", prompt=[1, POISON], max_tokens=3, stream=True):
                pass
        ok = client.completions.create(model="m", prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True})
        assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 5
    assert engine.counters.finished.get("error", 0) >= 3


def test_a_bug_in_one_requests_path_is_a_500_with_an_error_id_for_it_alone(served, monkeypatch, caplog):
    """Only ParamError / RequestError are client errors: a plain ValueError (or any exception) raised in
    a route is a bug, answered 500 with an error id that the logged traceback carries, and the next
    request, or one running beside it, is served as usual."""
    import pagedserve.entrypoints.completions as completions
    real = completions.tokenize_prompts

    def tokenize(st, prompt, field="prompt"):
        if prompt == "trigger the bug":
            raise ValueError("an internal invariant broke")
        return real(st, prompt, field)
    monkeypatch.setattr(completions, "tokenize_prompts", tokenize)
    with served() as (base, _), caplog.at_level(logging.ERROR, logger="pagedserve"):
        beside = threading.Thread(target=lambda: results.append(httpx.post(
            base + "/v1/completions", headers=H, timeout=60,
            json={"prompt": "Hello", "max_tokens": 16, "ignore_eos": True})))
        results: list = []
        beside.start()
        r = httpx.post(base + "/v1/completions", headers=H, json={"prompt": "trigger the bug", "max_tokens": 4})
        beside.join()
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "ValueError" in err["message"]
        error_id = err["message"].split("error id ")[1].split(")")[0]
        assert error_id.startswith("err-")
        logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
        assert logged and logged[0].exc_info and "an internal invariant broke" in str(logged[0].exc_info[1])
        assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 16
        ok = httpx.post(base + "/v1/completions", headers=H, json={"prompt": "Hello", "max_tokens": 3})
        assert ok.status_code == 200


def test_request_timeout_is_408(served):
    with served(request_timeout_s=0.5) as (base, _):
        t = time.time()
        r = httpx.post(base + "/v1/completions", headers=H,
                       json={"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True})
        assert r.status_code == 408 and time.time() - t < 5
        assert "request-timeout" in r.json()["error"]["message"]
        with httpx.stream("POST", base + "/v1/chat/completions", headers=H, json={
                "messages": [{"role": "user", "content": "Go on and on."}], "max_tokens": 2000, "stream": True,
                "ignore_eos": True}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] is None


def test_finished_requests_leave_nothing_behind(served):
    """Requests that finish, time out or are cut leave no entry in any request-keyed structure
    (/debug/scheduler's `held`), and the deadline heap stays bounded by the requests in flight, not by
    every request of the last --request-timeout seconds."""
    from pagedserve.engine.async_engine import DEADLINES_SLACK
    with served(request_timeout_s=3600) as (base, app):
        aeng = app.state.server.aengine
        for i in range(3 * DEADLINES_SLACK):
            r = httpx.post(base + "/v1/completions", headers=H, json={"prompt": [1, 2, 3 + i], "max_tokens": 1})
            assert r.status_code == 200
        assert len(aeng._deadlines) <= DEADLINES_SLACK + 2
        try:
            httpx.post(base + "/v1/completions", headers=H, timeout=0.3,
                       json={"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True})
        except httpx.TimeoutException:
            pass
        assert wait(lambda: not httpx.get(base + "/debug/scheduler", headers=H).json()["running"])
        held = httpx.get(base + "/debug/scheduler", headers=H).json()["held"]
        assert "engine.states" in held and "metrics.tok_seen" in held and "sampler.req_generators" in held
        assert not any(v for k, v in held.items() if k != "async.deadlines"), held


def test_dead_engine_fails_every_client_at_once(served, engine, monkeypatch):
    with served() as (base, app):
        died = threading.Event()
        app.state.aengine.on_dead = lambda err: died.set()
        stop = threading.Event()
        real = engine.core.scheduler.schedule
        monkeypatch.setattr(engine.core.scheduler, "schedule", lambda: (_ for _ in ()).throw(KeyError("bug")) if
                            stop.is_set() else real())

        async def clients():
            async with httpx.AsyncClient(base_url=base, headers=H, timeout=30) as c:
                body = {"prompt": "Write forever.", "max_tokens": 1500, "ignore_eos": True}
                plain = asyncio.ensure_future(c.post("/v1/completions", json=body))

                async def streamed():
                    async with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
                        return [line async for line in s.aiter_lines() if line.startswith("data: ")]
                st = asyncio.ensure_future(streamed())
                await asyncio.sleep(1.0)
                t = time.time()
                stop.set()
                r, events = await plain, await st
                return r, events, time.time() - t
        r, events, took = asyncio.run(clients())
        assert took < 3 and died.wait(2)
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_dead"
        assert events[-1] == "data: [DONE]" and "engine is dead" in events[-2]
        h = httpx.get(base + "/health")
        assert h.status_code == 503 and h.json()["error"]["type"] == "engine_dead"
        r = httpx.post(base + "/v1/completions", headers=H, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and "engine is dead" in r.json()["error"]["message"]
    # the engine's own state is what died with it: clear it so the shared fixture's check holds
    for rid in list(engine.states):
        engine.abort(rid)
    monkeypatch.undo()
    engine.step()                      # tells the runner which sequences ended


def test_non_stream_disconnect_is_clean(served, engine, caplog):
    caplog.set_level(logging.ERROR)
    with served() as (base, _):
        body = json.dumps({"prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True}).encode()
        port = int(base.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                assert wait(engine.has_unfinished_requests, 5)
            assert wait(lambda: not engine.has_unfinished_requests(), 3)
    assert not [r for r in caplog.records if "aclose" in r.getMessage() or r.levelno >= logging.ERROR]
    assert engine.counters.finished.get("abort", 0) >= 3


def test_chunked_body_is_cut_at_the_limit(served):
    """8 MB sent chunked (no Content-Length): the 413 arrives once the limit is passed, not after
    the whole body was read."""
    import select
    with served(max_body_bytes=100_000) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                      b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            sent = 0
            while sent < 8 * 2**20 and not select.select([s], [], [], 0.01)[0]:
                s.sendall(b"4000\r\n" + b" " * 0x4000 + b"\r\n")
                sent += 0x4000
            s.settimeout(5)
            reply = b""
            while b"}}" not in reply and (chunk := s.recv(65536)):
                reply += chunk
            reply = reply.decode(errors="replace")
        assert reply.startswith("HTTP/1.1 413") and "100000 bytes" in reply
        assert sent < 2**20
        assert httpx.get(base + "/health").status_code == 200


def test_api_key_guards_v1_and_debug_not_health(served):
    with served() as (base, _):
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/debug/scheduler").status_code == 401
        assert httpx.get(base + "/debug/scheduler", headers={"Authorization": "Bearer k2"}).status_code == 401
        assert httpx.get(base + "/debug/scheduler", headers=H).status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 401


@pytest.mark.parametrize("core", ["--no-engine-process", "--engine-process"])
def test_sigterm_drains_then_exits_zero(tmp_path, core):
    trace = tmp_path / "steps.jsonl"
    with serve_in_process([core, "--num-kv-blocks", "256", "--shutdown-timeout", "3", "--step-trace", str(trace)]) \
            as (base, proc):
        async def run():
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                long = asyncio.ensure_future(c.post("/v1/completions", json={
                    "prompt": "An endless story:", "max_tokens": 3000, "ignore_eos": True}))
                short = asyncio.ensure_future(c.post("/v1/completions", json={
                    "prompt": "Hi", "max_tokens": 8, "ignore_eos": True}))
                await asyncio.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                refused = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                health = await c.get("/health")
                return await long, await short, refused, health
        long, short, refused, health = asyncio.run(run())
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 8
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert health.status_code == 503
        assert long.status_code == 503 and "shut down" in long.json()["error"]["message"]
        assert proc.wait(timeout=20) == 0
    steps = [json.loads(line) for line in trace.read_text().splitlines()]    # the step trace, one line a step
    assert len(steps) >= 8 and all(s["step_s"] > 0 and s["seqs"] for s in steps)


DIE_AFTER_FIRST_STEP = """
import sys
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints import cli
real = LLMEngine.step_states                # the step the serving loop takes
def step_states(self):
    if self.stats().counters.steps >= 1:
        raise SystemError("injected: the engine loop itself broke")
    return real(self)
LLMEngine.step_states = step_states
sys.exit(cli.main(["serve", "--port", sys.argv[1], *sys.argv[2:]]))
"""


def test_dead_engine_exits_nonzero():
    with serve_in_process(["--num-kv-blocks", "64", "--dead-engine-grace", "0.5"], code=DIE_AFTER_FIRST_STEP) \
            as (base, proc):
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "ignore_eos": True}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_dead"
        assert proc.wait(timeout=20) == 1


def _core_pid(server_pid: int) -> int:
    """The serve process's engine core child (the one spawned with pagedserve's core_main; not the resource tracker)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    for pid in kids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise AssertionError(f"no engine core child among {kids}")


def test_sigkill_of_the_engine_core_process_fails_every_client_and_exits_nonzero():
    with serve_in_process(["--engine-process", "--num-kv-blocks", "256", "--dead-engine-grace", "0.5"]) \
            as (base, proc):
        async def clients():
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                body = {"prompt": "Write forever.", "max_tokens": 3000, "ignore_eos": True}
                plain = asyncio.ensure_future(c.post("/v1/completions", json=body))

                async def streamed():
                    async with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
                        lines = []
                        async for line in s.aiter_lines():
                            if line.startswith("data: "):
                                lines.append(line)
                                if len(lines) == 3:     # tokens are flowing: kill the core under them
                                    os.kill(_core_pid(proc.pid), signal.SIGKILL)
                        return lines
                events = await streamed()
                return await plain, events
        r, events = asyncio.run(clients())
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_dead"
        assert events[-1] == "data: [DONE]" and "engine core process exited" in events[-2]
        assert proc.wait(timeout=30) == 1
