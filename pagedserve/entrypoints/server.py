"""The OpenAI-compatible HTTP server: FastAPI + uvicorn over AsyncLLMEngine.

This module builds the app and owns its life: CORS, the request guard (body size, API key, draining),
the mapping of every error to OpenAI's error JSON (Anthropic's on /v1/messages), graceful shutdown
on SIGTERM and exit on a dead engine. The routes themselves are module-level functions in `routes.py`."""
from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import signal
import uuid
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pagedserve.config import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.http_errors import RequestError, error_body, error_response  # noqa: F401 (the app's vocabulary)
from pagedserve.entrypoints.front import Front, StopLoading
from pagedserve.entrypoints.metrics import ServerMetrics
from pagedserve.entrypoints.routes import router
from pagedserve.entrypoints.server_state import ServerState, served_names, system_fingerprint
from pagedserve.errors import EngineDeadError, ParamError, QueueFullError

log = logging.getLogger("pagedserve")


@dataclass(slots=True, frozen=True)
class CORSConfig:
    """vLLM's CORS flags (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials), served
    by Starlette's CORSMiddleware outside the Guard: a browser's preflight (OPTIONS, which carries no key) is
    answered before the API key is asked for; the request that follows still needs it."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class Guard:
    """Plain ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the handlers):
    the API key on /v1 and /debug (401, compared in constant time), 503 while draining, and the
    body-size limit (413) counted on the bytes received, so a chunked body without Content-Length
    is cut off at the limit instead of being read whole."""

    PROTECTED = ("/v1", "/debug")

    def __init__(self, app, state: ServerState, api_key: str | None, max_body_bytes: int):
        self.app, self.state, self.max_body_bytes = app, state, max_body_bytes
        self.key = None if api_key is None else api_key.encode()

    def _authorized(self, headers: dict) -> bool:
        """OpenAI's `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`."""
        return hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + self.key) or \
            hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope.get("headers") or [])
        if self.key is not None and path.startswith(self.PROTECTED) and not self._authorized(headers):
            resp = error_response(401, "missing or invalid API key (Authorization: Bearer ..., or x-api-key)",
                                  type_="authentication_error", path=path)
            return await resp(scope, receive, send)
        if self.state.draining and path.startswith("/v1/") and scope["method"] == "POST":
            resp = error_response(503, "the server is shutting down; retry on another replica",
                                  type_="server_shutting_down", headers={"Retry-After": "5"}, path=path)
            return await resp(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive)
            if body is None:
                resp = error_response(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                                      path=path)
                return await resp(scope, receive, send)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _read_body(self, receive) -> bytes | None:
        size = 0
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive):
    """The body once, then the real receive (which reports the client's disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _union_member(loc: str) -> bool:
    """A union type adds the member's type name to an error's location (not a field: left out of `param`).
    Whole names only: a field may begin like one (`stream_options`, `integer_field`)."""
    return loc in ("str", "int", "float", "bool") or loc.startswith(("list[", "dict[", "function-", "literal[",
                                                                      "tagged-union[", "nullable["))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(http: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {err.get('msg', '')}", path=http.url.path)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(x for x in loc if not _union_member(x)) or None
        if err.get("type") == "extra_forbidden":
            return error_response(400, f"{field}: unknown field (pagedserve does not support it; the README lists "
                                       f"the fields it accepts and ignores)", field, path=http.url.path)
        return error_response(400, f"{field or 'body'}: {err.get('msg', 'invalid value')}", field,
                              path=http.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(http: Request, exc: StarletteHTTPException):
        status = exc.status_code if 400 <= exc.status_code < 500 else 400
        return error_response(status, str(exc.detail), headers=getattr(exc, "headers", None), path=http.url.path)

    @app.exception_handler(RequestError)
    async def _request_error(http: Request, exc: RequestError):
        return error_response(exc.status, exc.message, exc.param, exc.type, code=exc.code, path=http.url.path)

    @app.exception_handler(ParamError)
    async def _param(http: Request, exc: ParamError):
        return error_response(400, str(exc), exc.param, code=exc.code, path=http.url.path)

    @app.exception_handler(QueueFullError)
    async def _full(http: Request, exc: QueueFullError):
        return error_response(503, str(exc), type_="server_overloaded", headers={"Retry-After": "1"},
                              path=http.url.path)

    @app.exception_handler(EngineDeadError)
    async def _dead(http: Request, exc: EngineDeadError):
        return error_response(500, f"the engine is dead: {exc}", type_="engine_dead", path=http.url.path)

    @app.exception_handler(Exception)
    async def _internal(http: Request, exc: Exception):
        """Not a client error (those are ParamError / RequestError, 4xx naming the field): a bug in this
        request's path. A 500 with an error id that the logged traceback carries too."""
        error_id = f"err-{uuid.uuid4().hex[:12]}"
        log.error("unhandled error in %s %s (error id %s)", http.method, http.url.path, error_id,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return error_response(500, f"internal error (error id {error_id}): {type(exc).__name__}", type_="server_error",
                              path=http.url.path)


def build_app(engine: LLMEngine, api_key: str | None = None, served_model_name: str | list[str] | None = None,
              max_body_bytes: int = 4 * 2**20, request_timeout_s: float | None = None,
              engine_thread: bool = True, chat_template: str | None = None,
              tool_call_parser: str | None = None, dashboard: bool = True,
              reasoning_parser: str | None = None, cors: CORSConfig = CORSConfig()) -> FastAPI:
    """engine_thread=False: the caller runs `app.state.aengine.run()` (run_server does, on the main thread).
    `served_model_name`: the name requests give as `model`, or a list of them (aliases: the first is the
    one responses report); None: the model's own name. Any other `model` is a 404 model_not_found."""
    names = served_names(served_model_name, engine.info.model_name)
    app = FastAPI(title="pagedserve", description="An OpenAI-compatible server over a paged KV cache.")
    aengine = AsyncLLMEngine(engine, request_timeout_s, start_thread=engine_thread)
    metrics = ServerMetrics(engine)
    state = ServerState(engine, aengine, metrics, names[0], served_model_names=names, chat_template=chat_template,
                        tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, system_fingerprint=system_fingerprint(engine))
    if dashboard:
        from pagedserve.entrypoints.dashboard import StateRecorder
        state.recorder = recorder = StateRecorder()

        def on_step(eng, outs):
            recorder.on_step(eng, outs, metrics.on_step(eng, outs))
        aengine.on_step = on_step
    else:
        aengine.on_step = metrics.on_step
    app.state.server = state
    app.state.engine, app.state.aengine, app.state.metrics = engine, aengine, metrics
    app.add_middleware(Guard, state=state, api_key=api_key, max_body_bytes=max_body_bytes)
    # added last, so outermost: a preflight never reaches the Guard, and its 401s carry the CORS headers too
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)
    _install_error_handlers(app)
    app.include_router(router)
    if dashboard:
        from pagedserve.entrypoints.dashboard import router as dashboard_router
        app.include_router(dashboard_router)
    return app


# ---------------------------------------------------------------- running it
async def drain(state: ServerState, timeout_s: float) -> None:
    """Graceful shutdown: stop admitting (503 + Retry-After), let requests in flight finish for up
    to `timeout_s`, then end the rest with a clear error."""
    state.draining = True
    log.info("shutting down: %d requests in flight, waiting up to %.0f s", state.aengine.num_unfinished(), timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while state.aengine.num_unfinished() and loop.time() < deadline and state.aengine.dead is None:
        await asyncio.sleep(0.05)
    if state.aengine.num_unfinished():
        log.warning("shutdown timeout: failing %d unfinished requests", state.aengine.num_unfinished())
        state.aengine.fail_all("shutdown", f"the server shut down before the request finished "
                                           f"(--shutdown-timeout {timeout_s:g} s)")
        while state.aengine.num_unfinished() and state.aengine.dead is None:
            await asyncio.sleep(0.02)


def run_server(args: EngineArgs, ns, front: Front) -> int:
    """Serve on `front` (its port bound and answering /health 503 with the phase since before the imports,
    pagedserve.entrypoints.front) while the engine builds, then serve until SIGTERM (graceful: exit 0) or
    SIGINT; exit 1 if the engine dies or cannot load (its reason in one line on stderr). The engine steps
    on the main thread; uvicorn serves HTTP from a second thread."""
    import sys

    template = None
    if ns.chat_template:
        with open(ns.chat_template) as f:
            template = f.read()
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    timer, server, loop = front.app.startup, front.server, front.loop
    exit_code = 0
    state: ServerState | None = None

    async def shutdown():
        await drain(state, ns.shutdown_timeout)
        await asyncio.sleep(0.2)          # let the last responses flush
        server.should_exit = True

    def on_signal(sig, frame):
        if state is None:                 # still loading: stop now (the load ends where it is)
            server.should_exit = True
            raise StopLoading(sig)
        if sig == signal.SIGTERM and not state.draining:
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(shutdown()))
        else:                             # SIGINT, or a second signal: stop now
            server.should_exit = server.force_exit = state.draining = True
            loop.call_soon_threadsafe(state.aengine.fail_all, "shutdown", "the server was interrupted")

    def engine_died(err):
        nonlocal exit_code
        exit_code = 1
        log.critical("the engine died; exiting in %.0f s so a supervisor restarts the server", ns.dead_engine_grace)
        loop.call_soon_threadsafe(loop.call_later, ns.dead_engine_grace, setattr, server, "should_exit", True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    front.on_exit = lambda: state is not None and state.aengine.shutdown()   # ends run() on the main thread
    try:
        client = None
        if getattr(ns, "core_spawn", None) is not None:     # the core's process, started before the imports
            from pagedserve.engine.core_proc import ProcClient
            client = ProcClient(args, ns.core_spawn, timer)
        engine = LLMEngine(args, startup=timer, warm_at_load=False, client=client)   # GEMM shapes: after ready
        timer.current = "server"
    except StopLoading:
        front.stop()
        return 0
    except Exception as e:                # the reason, in one line; no server left behind
        front.stop()
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: the model could not be loaded: {type(e).__name__}: {reason}", file=sys.stderr)
        return 1
    try:
        app = build_app(engine, ns.api_key, ns.served_model_name, ns.max_body_bytes, ns.request_timeout,
                        engine_thread=False, chat_template=template,
                        tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
                        dashboard=ns.dashboard, reasoning_parser=ns.reasoning_parser,
                        cors=CORSConfig(tuple(ns.allowed_origins), tuple(ns.allowed_methods),
                                        tuple(ns.allowed_headers), ns.allow_credentials))
    except StopLoading:
        front.stop()
        engine.shutdown()
        return 0
    state = app.state.server
    state.aengine.on_dead = engine_died
    if ns.step_trace:
        from pagedserve.sim.calibrate import StepTrace
        state.aengine.on_stepped = StepTrace(ns.step_trace).record
    log.info("serving %s on http://%s:%d (loaded in %.1f s)", engine.info.model_name, ns.host, ns.port,
             engine.info.load_s)
    if ns.dashboard:
        log.info("dashboard: http://%s:%d/dashboard%s", ns.host, ns.port, "#key=<api key>" if ns.api_key else "")
    # the start-up heap (torch, the model: ~230 k objects) out of the collector's sight, as vLLM does: a
    # full collection scans it in ~175 ms (2 cores), a stall of every stream whenever one runs. No collection
    # first: it found 6-8 unreachable objects of 234 k here and cost 0.1-0.2 s before /health answered 200
    gc.freeze()
    front.app.inner = app                 # from here every request reaches the real app
    if front.done.is_set():               # the HTTP thread ended while loading (a signal raced the swap)
        state.aengine.shutdown()
    state.aengine.run()
    front.thread.join()
    loop.close()
    engine.shutdown()                     # tensor-parallel workers leave (nothing with one rank)
    return exit_code
