"""The server's routes, one module-level function each. A request is validated (400 naming the
field), submitted to the AsyncLLMEngine, and answered from its RequestStream: whole, or as SSE
chunks. A request the engine failed is answered as a failure (a 5xx / 408 in OpenAI's error JSON,
or an SSE `error` event before `[DONE]`), never as a finished completion."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from pagedserve.engine.async_engine import RequestStream
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, message_text,
                                             to_sampling_params)
from pagedserve.entrypoints.server import RequestError, ServerState, error_body, error_response
from pagedserve.errors import EngineDeadError
from pagedserve.tokenizer import apply_chat_template

router = APIRouter()

# how each kind of engine failure is answered: (HTTP status, OpenAI error type)
FAILURE_STATUS = {"internal_error": (500, "server_error"), "engine_dead": (500, "engine_dead"),
                  "timeout": (408, "timeout_error"), "shutdown": (503, "server_shutting_down")}


def _state(http: Request) -> ServerState:
    return http.app.state.server


# ---------------------------------------------------------------- service routes
@router.get("/health")
async def health(http: Request):
    st = _state(http)
    if st.aengine.dead is not None:
        return error_response(503, f"the engine is dead: {st.aengine.dead}", type_="engine_dead")
    if st.draining:
        return error_response(503, "the server is shutting down", type_="server_shutting_down",
                              headers={"Retry-After": "5"})
    return {"status": "ok"}


@router.get("/v1/models")
async def models(http: Request):
    st = _state(http)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "pagedserve",
                                        "max_model_len": st.engine.max_model_len}]}


@router.get("/metrics")
async def prometheus(http: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    st = _state(http)
    st.metrics.refresh(st.engine)
    return PlainTextResponse(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/debug/scheduler")
async def debug_scheduler(http: Request):
    eng = _state(http).engine
    sch, kv = eng.scheduler, eng.kv
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


# ---------------------------------------------------------------- /v1/completions
@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request):
    st = _state(http)
    if body.echo:
        raise RequestError("echo", "echo is not supported")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise RequestError("prompt", "prompt: only one prompt per request is supported")
        prompt = prompt[0]
    params = _sampling_params(st, body, body.max_tokens, body.logprobs)
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    else:   # tokenize here, in a worker thread, not in the engine's step loop
        ids = await asyncio.to_thread(lambda: list(st.engine.tokenizer(prompt)["input_ids"]))
        prompt = {"prompt_token_ids": ids, "prompt": prompt}
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = await st.aengine.add_request(rid, prompt, params, body.priority, stream=body.stream)
    created = int(time.time())
    if body.stream:
        return _sse(_completion_chunks(st, rid, created, stream, body), stream)
    out = await _collect(http, stream)
    return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
            "choices": [{"index": o.index, "text": o.text, "logprobs": _completion_logprobs(st, o),
                         "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in out.outputs],
            "usage": _usage(out)}


def _completion_chunks(st: ServerState, rid: str, created: int, stream: RequestStream, body: CompletionRequest):
    def wrap(choices):
        return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                "choices": choices}

    def choice(o):
        return {"index": o.index, "text": o.text, "logprobs": _completion_logprobs(st, o),
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
    return _deltas(stream, body, wrap, choice)


# ---------------------------------------------------------------- /v1/chat/completions
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request):
    st = _state(http)
    top = body.top_logprobs
    params = _sampling_params(st, body, body.max_completion_tokens or body.max_tokens,
                              (top or 0) if body.logprobs else None)
    try:
        msgs = [message_text(m) for m in body.messages]
        ids = await asyncio.to_thread(apply_chat_template, st.engine.tokenizer, msgs, body.add_generation_prompt)
    except ValueError as e:
        raise RequestError("messages", str(e)) from None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await st.aengine.add_request(rid, {"prompt_token_ids": ids}, params, body.priority, stream=body.stream)
    created = int(time.time())
    if body.stream:
        return _sse(_chat_chunks(st, rid, created, stream, body, top or 0), stream)
    out = await _collect(http, stream)
    return {"id": rid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                         "logprobs": _chat_logprobs(st, o, top or 0), "finish_reason": o.finish_reason,
                         "stop_reason": o.stop_reason} for o in out.outputs],
            "usage": _usage(out)}


async def _chat_chunks(st: ServerState, rid: str, created: int, stream: RequestStream, body, top: int):
    def wrap(choices):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "choices": choices}

    def choice(o):
        return {"index": o.index, "delta": {"content": o.text},
                "logprobs": _chat_logprobs(st, o, top), "finish_reason": o.finish_reason}

    for i in range(body.n):
        yield wrap([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}])
    async for c in _deltas(stream, body, wrap, choice):
        yield c


# ---------------------------------------------------------------- shared
def _sampling_params(st: ServerState, body, max_tokens, logprobs):
    limit = st.engine.scheduler.cfg.max_num_seqs
    if body.n > limit:
        raise RequestError("n", f"n ({body.n}) exceeds max_num_seqs ({limit}): each sample is a running sequence")
    return to_sampling_params(body, max_tokens, logprobs)     # ParamError names the field: 400


def _failure(out: RequestOutput) -> RequestError | None:
    """The error a finished output stands for: the engine failed it, or it was aborted."""
    if out.error is not None:
        status, type_ = FAILURE_STATUS.get(out.error.kind, (500, "server_error"))
        return RequestError(None, out.error.message, status, type_)
    if any(o.finish_reason == "abort" for o in out.outputs):
        return RequestError(None, "the request was aborted (client disconnected)", 499, "aborted")
    return None


async def _collect(http: Request, stream: RequestStream) -> RequestOutput:
    """The final output of a non-streaming request. A client that goes away aborts it."""
    async def client_gone():
        while (await http.receive())["type"] != "http.disconnect":
            pass
        stream.abort()

    watcher = asyncio.ensure_future(client_gone())
    out = None
    try:
        async for out in stream:
            pass
    finally:
        watcher.cancel()
    err = _failure(out)
    if err is not None:
        raise err
    return out


async def _deltas(stream: RequestStream, body, wrap, choice):
    """The engine hands a stream only what is new; each sequence whose delta has text (or that just
    finished) becomes one chunk, as it is. Then the usage chunk; a failure ends the stream with an
    `error` event instead."""
    done: set[int] = set()
    held: dict[int, CompletionOutput] = {}      # tokens whose text is still empty (a partial character)
    num_prompt, num_completion, num_cached = 0, 0, 0
    try:
        async for out in stream:
            if out.finished and (err := _failure(out)) is not None:
                yield error_body(err.status, err.message, err.param, err.type)
                return
            num_prompt, num_cached = len(out.prompt_token_ids), out.num_cached_tokens
            for o in out.outputs:
                num_completion += len(o.token_ids)
                if o.index in done:
                    continue
                if o.index in held:                 # carry earlier textless tokens into this chunk
                    h = held.pop(o.index)
                    o = replace(o, token_ids=h.token_ids + o.token_ids,
                                logprobs=None if o.logprobs is None else h.logprobs + o.logprobs)
                if not o.text and o.finish_reason is None:
                    if o.token_ids:
                        held[o.index] = o
                    continue
                if o.finish_reason is not None:
                    done.add(o.index)
                yield wrap([choice(o)])
    except EngineDeadError as e:
        yield error_body(500, f"the engine is dead: {e}", None, "engine_dead")
        return
    if body.stream_options and body.stream_options.include_usage:
        yield wrap([]) | {"usage": _usage_counts(num_prompt, num_completion, num_cached)}


class _EngineStreamResponse(StreamingResponse):
    """SSE over a RequestStream. However the response ends (done, client gone before or during the
    body), the request is aborted if it is still running: a no-op once it finished."""

    def __init__(self, body, stream: RequestStream):
        super().__init__(body, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


def _sse(chunks, stream: RequestStream) -> StreamingResponse:
    async def body():
        async for obj in chunks:
            yield f"data: {json.dumps(obj)}\n\n"
        yield "data: [DONE]\n\n"
    return _EngineStreamResponse(body(), stream)


def _usage(out: RequestOutput) -> dict:
    return _usage_counts(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs), out.num_cached_tokens)


def _usage_counts(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_logprobs(st: ServerState, o) -> dict | None:
    if o.logprobs is None:
        return None
    tok = st.engine.tokenizer
    toks, lps = o.token_ids, o.logprobs
    return {"tokens": [tok.decode([t]) for t in toks],
            "token_logprobs": [lp[t].logprob for t, lp in zip(toks, lps)],
            "top_logprobs": [{tok.decode([k]): v.logprob for k, v in lp.items()} for lp in lps],
            "text_offset": []}


def _chat_logprobs(st: ServerState, o, top: int) -> dict | None:
    if o.logprobs is None:
        return None
    tok = st.engine.tokenizer
    content = []
    for t, lp in zip(o.token_ids, o.logprobs):
        s = tok.decode([t])
        tops = sorted(lp.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({"token": s, "logprob": lp[t].logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": tok.decode([k]), "logprob": v.logprob,
                                          "bytes": list(tok.decode([k]).encode())} for k, v in tops]})
    return {"content": content}
