"""`pagedserve router --backend URL --backend URL ...`: one OpenAI-compatible front over data-parallel
`pagedserve serve` replicas. Each request goes where `RoutingPolicy` says (the replica caching its
prefix, unless it is much busier); bodies and SSE streams are passed through as they come. Replicas
are health-checked every second; one that fails (a refused connection, a failed health check, three
checks in a row timing out) gets no new requests until it answers again. A request whose replica
fails before answering is retried on another; one whose replica dies mid-answer gets a clear error
(a 502, or an SSE `error` event before `[DONE]`), never a hang."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.router.policy import Replica, RoutingPolicy

log = logging.getLogger("pagedserve")
FORWARDED = ("/v1/completions", "/v1/chat/completions")


def _error(status: int, message: str, type_: str = "router_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": None}}


def prompt_text(body: dict) -> str:
    """What the prefix match is computed on: the prompt(s), or the messages as role: content lines."""
    if "messages" in body and isinstance(body["messages"], list):
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in body["messages"] if isinstance(m, dict))
    p = body.get("prompt", "")
    if isinstance(p, list):
        return json.dumps(p[0] if p and isinstance(p[0], (list, str)) else p)
    return str(p)


@dataclass(slots=True)
class RouterState:
    """What the routes share: one per app (app.state.router)."""

    policy: RoutingPolicy
    client: httpx.AsyncClient
    health_interval_s: float


def _state(http: Request) -> RouterState:
    return http.app.state.router


SLOW_CHECKS_DOWN = 3                                  # health checks timing out in a row that take a replica out
CHECK_TIMEOUT_S = 2.0


async def check(st: RouterState, r: Replica) -> None:
    """One health check: /health answers 200; the queue (running + waiting) from /metrics. A refused
    connection or another status takes the replica out at once; a check that times out only when
    SLOW_CHECKS_DOWN do in a row (a replica busy with a long step answers late, it is not down: two
    replicas on a loaded host were both taken out by one late answer each, and every request refused)."""
    try:
        ok = (await st.client.get(r.url + "/health", timeout=CHECK_TIMEOUT_S)).status_code == 200
        if ok:
            r.queue = _queue(await st.client.get(r.url + "/metrics", timeout=CHECK_TIMEOUT_S))
        r.slow_checks = 0
    except httpx.TimeoutException:
        r.slow_checks += 1
        ok = r.healthy and r.slow_checks < SLOW_CHECKS_DOWN
    except httpx.HTTPError:
        ok = False
    if ok != r.healthy:
        log.warning("replica %s is %s", r.url, "back" if ok else "down")
    r.healthy = ok


async def health_loop(st: RouterState) -> None:
    while True:
        await asyncio.gather(*(check(st, r) for r in st.policy.replicas))
        await asyncio.sleep(st.health_interval_s)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    st: RouterState = app.state.router
    task = asyncio.ensure_future(health_loop(st))
    yield
    task.cancel()
    await st.client.aclose()


routes = APIRouter()


@routes.get("/health")
async def health(http: Request):
    live = _state(http).policy.healthy()
    return JSONResponse({"status": "ok" if live else "no healthy replica", "healthy": len(live)},
                        status_code=200 if live else 503)


@routes.get("/router/state")
async def router_state(http: Request):
    pol = _state(http).policy
    return {"policy": pol.policy, "replicas": [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight,
                                                "queue": r.queue, "sent": r.sent, "prefixes": len(r.prefixes)}
                                               for r in pol.replicas]}


@routes.get("/v1/models")
async def models(http: Request):
    st = _state(http)
    for r in st.policy.healthy():
        with contextlib.suppress(httpx.HTTPError):
            resp = await st.client.get(r.url + "/v1/models", headers=_auth(http))
            return Response(resp.content, resp.status_code, media_type="application/json")
    return JSONResponse(_error(503, "no healthy replica"), status_code=503)


async def forward(http: Request):
    """A completion or chat request to the replica the policy picks; one that never reached its replica
    is retried on another, one the replica took and then failed is a 502 (it must not run twice)."""
    st = _state(http)
    pol, client = st.policy, st.client
    raw = await http.body()
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    text = prompt_text(body) if isinstance(body, dict) else ""
    stream = isinstance(body, dict) and body.get("stream") is True
    tried: set[str] = set()
    while True:
        replica, why = pol.choose(text, tried)
        if replica is None:
            return JSONResponse(_error(503, f"no healthy replica to serve the request ({why})"), status_code=503)
        tried.add(replica.url)
        pol.sent_to(replica, text)
        req = client.build_request("POST", replica.url + http.url.path, content=raw,
                                   headers={"content-type": "application/json", **_auth(http)})
        try:
            resp = await client.send(req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:   # it never reached the replica: go elsewhere
            pol.done(replica)
            replica.healthy = False
            log.warning("replica %s unreachable (%s); routing elsewhere", replica.url, type(e).__name__)
            continue
        except httpx.HTTPError as e:          # it took the request, then failed: say so, do not run it twice
            pol.done(replica)
            replica.healthy = False
            return JSONResponse(_error(502, f"the replica {replica.url} failed before answering: "
                                            f"{type(e).__name__}"), status_code=502)
        headers = {"x-pagedserve-replica": replica.url, "x-pagedserve-route": why}
        if stream and resp.status_code == 200:
            return StreamingResponse(_pass_stream(resp, replica, pol), media_type="text/event-stream",
                                     headers=headers)
        try:
            content = await resp.aread()
        except httpx.HTTPError as e:
            replica.healthy = False
            return JSONResponse(_error(502, f"the replica {replica.url} failed mid-answer: "
                                            f"{type(e).__name__}"), status_code=502)
        finally:
            pol.done(replica)
            await resp.aclose()
        return Response(content, resp.status_code, media_type=resp.headers.get("content-type"), headers=headers)


for _path in FORWARDED:
    routes.add_api_route(_path, forward, methods=["POST"])


def build_router(urls: list[str], policy: str = "cache_aware", health_interval_s: float = 1.0,
                 timeout_s: float = 600.0) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                               limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
    app = FastAPI(title="pagedserve router", lifespan=lifespan)
    app.state.router = RouterState(RoutingPolicy(urls, policy), client, health_interval_s)
    app.include_router(routes)
    return app


async def _pass_stream(resp: httpx.Response, replica: Replica, pol: RoutingPolicy):
    """The replica's event stream as it comes; a stream that breaks, or ends without its closing
    `data: [DONE]` (a replica killed between two chunks can close the connection cleanly), ends with
    an SSE error event instead, so the client is told it failed."""
    tail, why = b"", "ended without [DONE]"
    try:
        async for chunk in resp.aiter_raw():
            tail = (tail + chunk)[-32:]
            yield chunk
        if tail.rstrip().endswith(b"data: [DONE]"):
            return
    except httpx.HTTPError as e:
        why = type(e).__name__
    finally:
        pol.done(replica)
        await resp.aclose()
    replica.healthy = False
    err = _error(502, f"the replica {replica.url} failed mid-stream: {why}")
    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


def _queue(resp: httpx.Response) -> int:
    """running + waiting from a replica's /metrics (0 if it does not say)."""
    n = 0
    for line in resp.text.splitlines() if resp.status_code == 200 else ():
        if line.startswith(("pagedserve:num_requests_running ", "pagedserve:num_requests_waiting ")):
            n += int(float(line.split()[-1]))
    return n


def _auth(http: Request) -> dict:
    a = http.headers.get("authorization")
    return {"authorization": a} if a else {}


def run_router(ns) -> int:
    import uvicorn
    app = build_router(ns.backend, ns.policy)
    log.info("routing %d replicas (%s) on http://%s:%d", len(ns.backend), ns.policy, ns.host, ns.port)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0


def add_router_flags(ap) -> None:
    ap.add_argument("--backend", action="append", required=True, help="a replica's base URL (repeat the flag)")
    ap.add_argument("--policy", default="cache_aware", choices=("cache_aware", "round_robin"))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
