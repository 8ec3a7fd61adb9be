"""What the OpenAI routes share: admitting a request (`admit`: one order of checks, tokenizing and
compiling off the event loop, one engine request per prompt), collecting
their outputs or streaming their deltas (several prompts' streams merged), failures answered as
failures (a 5xx / 408 in OpenAI's error JSON, or an SSE `error` event before `[DONE]`, never a
finished completion), usage, and the logprobs shapes of both APIs."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.async_engine import RequestStream
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.entrypoints.http_errors import RequestError, error_body
from pagedserve.entrypoints.server_state import ServerState
from pagedserve.errors import EngineDeadError, ParamError
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import PoolingParams

# how each kind of engine failure is answered: (HTTP status, OpenAI error type)
FAILURE_STATUS = {"internal_error": (500, "server_error"), "engine_dead": (500, "engine_dead"),
                  "timeout": (408, "timeout_error"), "shutdown": (503, "server_shutting_down")}


def state(http: Request) -> ServerState:
    return http.app.state.server


def check_n(st: ServerState, n: int) -> None:
    limit = st.engine.info.max_num_seqs
    if n > limit:
        raise RequestError("n", f"n ({n}) exceeds max_num_seqs ({limit}): each sample is a running sequence")


def traffic_class(http: Request, body) -> str | None:
    """The traffic class a request names: its body's `traffic_class`, else the X-Traffic-Class header
    (ignored when the server runs without classes: a proxy may set it for every backend)."""
    if body.traffic_class is not None:
        return body.traffic_class
    named = http.headers.get("x-traffic-class")
    return named if named and state(http).engine.info.traffic_classes is not None else None


def check_model(st: ServerState, model: str | None) -> None:
    """A request's `model`: a served name (--served-model-name, aliases included) or, with --enable-lora,
    a loaded adapter's; else a 404 model_not_found listing the served names, before anything is admitted.
    Omitted or empty is the served model (OpenAI requires the field; pagedserve, as vLLM, never has)."""
    if not model or model in st.served_model_names:
        return
    if model in st.engine.lora_names():
        return          # (whether it is still loaded when submitted is decided in the engine thread)
    raise model_not_found(st, model)


def model_not_found(st: ServerState, model: str) -> RequestError:
    """OpenAI's 404 for an unknown model (type invalid_request_error, code model_not_found, param model);
    on /v1/messages it is answered in Anthropic's shape (not_found_error)."""
    names = list(st.served_model_names) + sorted(st.engine.lora_names())
    return RequestError("model", f"The model `{model}` does not exist. The models served: "
                                 f"{', '.join(names)} (GET /v1/models lists them).", 404,
                        code="model_not_found")


def lora_of(st: ServerState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's `model` names (with --enable-lora): None for the served model. Whether
    an adapter of that name is loaded is decided in the engine thread, where adapters are loaded and
    unloaded (an unknown name is a 404 naming `model`)."""
    if not st.engine.info.enable_lora or not model or model in st.served_model_names:
        return None
    return LoRARequest(model)


def model_name(st: ServerState, model: str | None) -> str:
    """The `model` a response names: the LoRA adapter the request ran with, else the first served name
    (whichever alias the request gave, as vLLM documents --served-model-name)."""
    return st.model_name if lora_of(st, model) is None else model


async def admit(st: ServerState, http: Request, body, prefix: str, params,
                prompts: Callable[[], list[dict]], prompt_field: str = "prompt"
                ) -> tuple[str, list[dict], list[RequestStream]]:
    """The admission every generating route shares, in one order: `n` against max_num_seqs; the
    prompts (`prompts()`: tokenizing or a chat template, raising a RequestError naming its field) and
    the constraint's compilation in one worker thread, never the engine's; then one engine request
    per prompt (`submit`). The engine's errors about the prompt (its length: context_length_exceeded)
    name the route's `prompt_field` (chat's `messages`, embeddings' `input`). Returns the request id
    (`prefix` + a uuid), the prompts and their streams. (Each route has checked `model` before.)"""
    if not st.engine.info.generates and not isinstance(params, PoolingParams):    # an encoder: embeddings only
        raise RequestError("model", f"model: {model_name(st, getattr(body, 'model', None))} is an embedding model "
                                    "(an encoder); it only serves /v1/embeddings")
    check_n(st, getattr(body, "n", 1))

    def prepare() -> list[dict]:
        ps = prompts()
        st.engine.precompile(params)          # a bad schema is a 400 before anything runs
        return ps
    ps = await asyncio.to_thread(prepare)
    rid = f"{prefix}{uuid.uuid4().hex}"
    try:
        streams = await submit(st, rid, ps, params, body.priority, stream=getattr(body, "stream", False),
                               klass=traffic_class(http, body), model=body.model)
    except ParamError as e:
        if e.param != "prompt":
            raise
        raise RequestError(prompt_field, str(e), code=e.code) from None
    return rid, ps, streams


async def submit(st: ServerState, rid: str, prompts: list[dict], params, priority: int,
                 stream: bool, klass: str | None = None, model: str | None = None) -> list[RequestStream]:
    """One engine request per prompt (ids rid, or rid-0, rid-1, ...), all handed to the engine at once
    so they join the same step; if one is refused, the others are aborted and its error goes to the
    client. `klass`: the traffic class it names; `model`: the body's (a LoRA adapter's name picks it)."""
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    lora = lora_of(st, model)
    got = await asyncio.gather(*(st.aengine.add_request(i, p, params, priority, stream=stream, traffic_class=klass,
                                                        lora_request=lora)
                                 for i, p in zip(ids, prompts)), return_exceptions=True)
    errors = [g for g in got if isinstance(g, BaseException)]
    if errors:
        for g in got:
            if not isinstance(g, BaseException):
                g.abort()
        e = errors[0]
        if isinstance(e, ParamError) and e.param == "lora_request":
            raise model_not_found(st, model) from None
        raise e
    return got


def failure(out: RequestOutput) -> RequestError | None:
    """The error a finished output stands for: the engine failed it, or it was aborted."""
    if out.error is not None:
        status, type_ = FAILURE_STATUS.get(out.error.kind, (500, "server_error"))
        return RequestError(None, out.error.message, status, type_)
    if any(o.finish_reason == "abort" for o in out.outputs):
        return RequestError(None, "the request was aborted (client disconnected)", 499, "aborted")
    return None


async def collect(http: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (non-streaming requests). A client that goes away aborts them
    all; one failed prompt fails the request (the others are aborted)."""
    async def client_gone():
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for s in streams:
            s.abort()

    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    watcher = asyncio.ensure_future(client_gone())
    try:
        outs = await asyncio.gather(*(last(s) for s in streams))
    finally:
        watcher.cancel()
    for out in outs:
        if (err := failure(out)) is not None:
            for s in streams:
                s.abort()
            raise err
    return outs


@dataclass(slots=True)
class Usage:
    prompt: dict[int, int] = field(default_factory=dict)      # per prompt index
    cached: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def body(self, count_completion: bool = True) -> dict:
        return usage_counts(sum(self.prompt.values()), self.completion if count_completion else 0,
                            sum(self.cached.values()))


async def deltas(streams: list[RequestStream], usage: Usage) -> AsyncIterator[tuple[int, object]]:
    """The streams' outputs merged as they come, as (prompt index, item): each RequestOutput itself
    (its prompt logprobs and counts), then each sequence's delta worth a chunk (text, or finished),
    or a RequestError that ends that prompt's stream. Textless tokens (a partial character) are carried
    into the next chunk of the same sequence."""
    if len(streams) == 1:               # one prompt (nearly every request): no pump task, no second queue
        async for item in _stream_deltas(0, streams[0], usage):
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    class Raised:                       # an exception out of a pump (a RequestError is yielded, not raised)
        def __init__(self, e: BaseException):
            self.e = e

    async def pump(i: int, stream: RequestStream):
        try:
            async for item in _stream_deltas(i, stream, usage):
                await queue.put((i, item))
        except BaseException as e:      # EngineDeadError, or cancelled: re-raised by the consumer
            await queue.put((i, Raised(e)))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Raised):
                raise item.e
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream_deltas(i: int, stream: RequestStream, usage: Usage):
    done: set[int] = set()
    held: dict[int, CompletionOutput] = {}
    async for out in stream:
        if out.finished and (err := failure(out)) is not None:
            yield err
            return
        usage.prompt[i], usage.cached[i] = len(out.prompt_token_ids), out.num_cached_tokens
        yield out
        for o in out.outputs:
            usage.completion += len(o.token_ids)
            if o.index in done:
                continue
            if o.index in held:
                o = o.after(held.pop(o.index))
            if not o.text and o.finish_reason is None:
                if o.token_ids:
                    held[o.index] = o
                continue
            if o.finish_reason is not None:
                done.add(o.index)
            yield o


class EngineStreamResponse(StreamingResponse):
    """SSE over RequestStreams. However the response ends (done, client gone before or during the
    body), the requests are aborted if still running: a no-op once they finished."""

    def __init__(self, body, streams: list[RequestStream]):
        super().__init__(body, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.abort()


def sse(chunks: AsyncIterator[dict], streams: list[RequestStream], event_lines: bool = False) -> StreamingResponse:
    """`chunks` may end with a RequestError (it becomes the `error` event); an engine that dies
    mid-stream does the same. event_lines: each event also names its `type` in an `event:` line (the
    Responses API's stream)."""
    async def body():
        try:
            async for obj in chunks:
                if isinstance(obj, RequestError):
                    yield f"data: {json.dumps(error_body(obj.status, obj.message, obj.param, obj.type, obj.code))}\n\n"
                    break
                yield (f"event: {obj['type']}\n" if event_lines else "") + f"data: {json.dumps(obj)}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(500, f'the engine is dead: {e}', None, 'engine_dead'))}\n\n"
        yield "data: [DONE]\n\n"
    return EngineStreamResponse(body(), streams)


def usage_of(outs: list[RequestOutput], count_completion: bool = True) -> dict:
    """The usage of finished outputs (several prompts' add up); without the completion tokens when
    none were returned (echo with max_tokens 0)."""
    completion = sum(len(o.token_ids) for out in outs for o in out.outputs) if count_completion else 0
    return usage_counts(sum(len(o.prompt_token_ids) for o in outs), completion, sum(o.num_cached_tokens for o in outs))


def usage_counts(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---------------------------------------------------------------- logprobs, as each API shapes them
def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list, text_offset0: int = 0) -> dict:
    """/v1/completions' shape. `logprobs` entries may be None (the first prompt token: nothing predicts
    it). text_offset: where each token's text starts in the choice's text."""
    toks = [tokenizer.decode([t]) for t in token_ids]
    offsets, pos = [], text_offset0
    for s in toks:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": toks,
            "token_logprobs": [None if lp is None else lp[t].logprob for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [None if lp is None else {tokenizer.decode([k]): v.logprob for k, v in lp.items()}
                             for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(tokenizer, o: CompletionOutput, top: int) -> dict | None:
    if o.logprobs is None:
        return None
    content = []
    for t, lp in zip(o.token_ids, o.logprobs):
        s = tokenizer.decode([t])
        tops = sorted(lp.items(), key=lambda kv: kv[1].rank)[:top]
        content.append({"token": s, "logprob": lp[t].logprob, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": tokenizer.decode([k]), "logprob": v.logprob,
                                          "bytes": list(tokenizer.decode([k]).encode())} for k, v in tops]})
    return {"content": content, "refusal": None}     # refusal: required (null) by OpenAI's spec
