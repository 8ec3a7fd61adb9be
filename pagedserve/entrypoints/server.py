"""The OpenAI-compatible HTTP server: FastAPI + uvicorn over AsyncLLMEngine."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pagedserve.config import EngineArgs
from pagedserve.core.scheduler import QueueFullError
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.entrypoints.metrics import ServerMetrics
from pagedserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, message_text,
                                             to_sampling_params)
from pagedserve.tokenizer import apply_chat_template

log = logging.getLogger("pagedserve")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


class Guard:
    """Plain ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the handlers):
    body-size limit (413) and the optional API key on /v1 routes (401)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            size = headers.get(b"content-length", b"").decode()
            if size.isdigit() and int(size) > self.max_body_bytes:
                resp = _error(413, f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes")
                return await resp(scope, receive, send)
            if self.api_key is not None and scope["path"].startswith("/v1") and \
                    headers.get(b"authorization", b"").decode() != f"Bearer {self.api_key}":
                resp = _error(401, "missing or invalid API key (Authorization: Bearer ...)", type_="authentication_error")
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, api_key: str | None = None, served_model_name: str | None = None,
              max_body_bytes: int = 4 * 2**20) -> FastAPI:
    app = FastAPI(title="pagedserve")
    aengine = AsyncLLMEngine(engine)
    metrics = ServerMetrics(engine)
    aengine.on_step = metrics.on_step
    model_name = served_model_name or engine.source.name
    app.state.engine, app.state.aengine, app.state.metrics = engine, aengine, metrics

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {err.get('msg', '')}")
        field = ".".join(loc) or None
        return _error(400, f"{field or 'body'}: {err.get('msg', 'invalid value')}", field)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.type)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "pagedserve",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        metrics.refresh(engine)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/scheduler")
    async def debug_scheduler():
        sch, kv = engine.scheduler, engine.kv
        waiting = sorted(list(sch.waiting), key=lambda x: x[0])
        return {
            "running": [{"request_id": r.request_id, "priority": r.priority, "num_computed_tokens": r.num_computed_tokens,
                         "num_tokens": r.num_tokens, "blocks": len(kv.block_ids(r.request_id))} for r in list(sch.running)],
            "waiting": [{"request_id": r.request_id, "priority": r.priority, "status": r.status.value,
                         "num_tokens": r.num_tokens, "reason": sch.waiting_reason(r)} for _, r in waiting],
            "kv": {"blocks_total": kv.pool.num_usable_blocks, "blocks_free": kv.num_free_blocks,
                   "blocks_cached": kv.pool.num_cached_blocks(), "usage": kv.usage(), "block_size": kv.block_size},
            "limits": {"max_num_seqs": sch.cfg.max_num_seqs, "max_num_batched_tokens": sch.cfg.max_num_batched_tokens,
                       "max_model_len": sch.cfg.max_model_len},
        }

    def _params(req, max_tokens, logprobs):
        try:
            return to_sampling_params(req, max_tokens, logprobs)
        except ValueError as e:
            raise APIError(400, str(e), str(e).split()[0]) from None

    async def _results(rid: str, prompt, params, priority: int):
        """The engine stream for one request, with engine errors mapped to HTTP errors."""
        gen = aengine.generate(rid, prompt, params, priority)
        try:
            first = await gen.__anext__()
        except QueueFullError as e:
            raise APIError(503, str(e), type_="server_overloaded") from None
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, msg.split()[0].rstrip(":")) from None
        return first, gen

    async def _collect(http: Request, first: RequestOutput, gen) -> RequestOutput:
        """Wait for the final output; a client that goes away aborts the request."""
        out = first

        async def drain():
            nonlocal out
            async for o in gen:
                out = o

        if first.finished:
            return first
        task = asyncio.ensure_future(drain())
        while not task.done():
            await asyncio.wait({task}, timeout=0.2)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                await gen.aclose()
                raise APIError(499, "client disconnected")
        task.result()
        return out

    def usage(out: RequestOutput) -> dict:
        comp = sum(len(o.token_ids) for o in out.outputs)
        return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": comp,
                "total_tokens": len(out.prompt_token_ids) + comp,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def completion_logprobs(o, start: int = 0) -> dict | None:
        if o.logprobs is None:
            return None
        tok = engine.tokenizer
        toks = o.token_ids[start:]
        lps = o.logprobs[start:]
        return {"tokens": [tok.decode([t]) for t in toks],
                "token_logprobs": [lp[t].logprob for t, lp in zip(toks, lps)],
                "top_logprobs": [{tok.decode([k]): v.logprob for k, v in lp.items()} for lp in lps],
                "text_offset": []}

    def chat_logprobs(o, start: int, top: int) -> dict | None:
        if o.logprobs is None:
            return None
        tok = engine.tokenizer
        content = []
        for t, lp in zip(o.token_ids[start:], o.logprobs[start:]):
            s = tok.decode([t])
            tops = sorted(((k, v) for k, v in lp.items()), key=lambda kv: kv[1].rank)[:top]
            content.append({"token": s, "logprob": lp[t].logprob, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": tok.decode([k]), "logprob": v.logprob,
                                              "bytes": list(tok.decode([k]).encode())} for k, v in tops]})
        return {"content": content}

    # ------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "prompt: only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        else:   # tokenize here, in a worker thread, not in the engine's step loop
            ids = await asyncio.to_thread(lambda: list(engine.tokenizer(prompt)["input_ids"]))
            prompt = {"prompt_token_ids": ids, "prompt": prompt}
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {body.logprobs}", "logprobs")
        params = _params(body, body.max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        first, gen = await _results(rid, prompt, params, body.priority)
        created = int(time.time())
        if body.stream:
            return _sse(_completion_stream(rid, created, first, gen, body))
        out = await _collect(http, first, gen)
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": o.index, "text": o.text, "logprobs": completion_logprobs(o),
                             "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in out.outputs],
                "usage": usage(out)}

    async def _stream_deltas(first, gen, body, wrap, choice):
        """One chunk per sequence whose text grew (or that just finished), then the usage chunk."""
        sent: dict[int, tuple[int, int, bool]] = {}

        async def outputs():
            yield first
            if not first.finished:
                async for o in gen:
                    yield o

        out = first
        async for out in outputs():
            for o in out.outputs:
                n_text, n_tok, done = sent.get(o.index, (0, 0, False))
                if done or (len(o.text) == n_text and o.finish_reason is None):
                    continue
                sent[o.index] = (len(o.text), len(o.token_ids), o.finish_reason is not None)
                yield wrap([choice(o, n_text, n_tok)])
        if body.stream_options and body.stream_options.include_usage:
            yield wrap([]) | {"usage": usage(out)}

    def _completion_stream(rid, created, first, gen, body):
        def wrap(choices):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices}

        def choice(o, n_text, n_tok):
            return {"index": o.index, "text": o.text[n_text:], "logprobs": completion_logprobs(o, n_tok),
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        return _stream_deltas(first, gen, body, wrap, choice)

    # ------------------------------------------------------------ /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        try:
            msgs = [message_text(m) for m in body.messages]
            ids = await asyncio.to_thread(apply_chat_template, engine.tokenizer, msgs, body.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        top = body.top_logprobs
        if top is not None and not 0 <= top <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {top}", "top_logprobs")
        lp = (top or 0) if body.logprobs else None
        params = _params(body, body.max_completion_tokens or body.max_tokens, lp)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        first, gen = await _results(rid, {"prompt_token_ids": ids}, params, body.priority)
        created = int(time.time())
        if body.stream:
            return _sse(_chat_stream(rid, created, first, gen, body, top or 0))
        out = await _collect(http, first, gen)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                             "logprobs": chat_logprobs(o, 0, top or 0), "finish_reason": o.finish_reason,
                             "stop_reason": o.stop_reason} for o in out.outputs],
                "usage": usage(out)}

    async def _chat_stream(rid, created, first, gen, body, top):
        def wrap(choices):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": choices}

        def choice(o, n_text, n_tok):
            return {"index": o.index, "delta": {"content": o.text[n_text:]},
                    "logprobs": chat_logprobs(o, n_tok, top), "finish_reason": o.finish_reason}

        for i in range(body.n):
            yield wrap([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}])
        async for c in _stream_deltas(first, gen, body, wrap, choice):
            yield c

    return app


def _sse(agen) -> StreamingResponse:
    async def body():
        try:
            async for obj in agen:
                yield f"data: {json.dumps(obj)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await agen.aclose()     # client gone: closes the engine stream, which aborts the request
    return StreamingResponse(body(), media_type="text/event-stream")


def run_server(args: EngineArgs, ns) -> None:
    import uvicorn
    engine = LLMEngine(args)
    app = build_app(engine, ns.api_key, ns.served_model_name, ns.max_body_bytes)
    log.info("serving %s on http://%s:%d (loaded in %.1f s)", engine.source.name, ns.host, ns.port, engine.load_s)
    try:
        uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    finally:
        app.state.aengine.shutdown()
