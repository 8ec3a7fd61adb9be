"""POST /v1/chat/completions: the chat template (with tools and tool results), structured outputs
(`response_format`), tool calls (`tool_calls.py`), logprobs; whole or as SSE chunks."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.entrypoints import tool_calls
from pagedserve.entrypoints.protocol import ChatCompletionRequest, message_dict, to_sampling_params
from pagedserve.entrypoints.responses import (Usage, chat_logprobs, check_n, collect, deltas, sse, state, submit,
                                              usage_of)
from pagedserve.entrypoints.server import RequestError, ServerState
from pagedserve.tokenizer import apply_chat_template

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request):
    st = state(http)
    template = st.chat_template or st.engine.tokenizer.chat_template
    mode = tool_calls.tool_mode(body, st.tool_call_parser, template)
    grammar = tool_calls.constraint(body, mode)
    if grammar is not None and body.response_format is not None and body.response_format.type != "text":
        raise RequestError("response_format", "response_format: not with tool_choice 'required' or a named tool "
                                              "(the output is already the tool call's JSON)")
    check_n(st, body.n)
    top = body.top_logprobs
    params = to_sampling_params(body, body.max_completion_tokens or body.max_tokens,
                                (top or 0) if body.logprobs else None, constraint=grammar)
    try:
        msgs = [message_dict(m) for m in body.messages]
        ids = await asyncio.to_thread(apply_chat_template, st.engine.tokenizer, msgs, body.add_generation_prompt,
                                      tools=tool_calls.template_tools(body, mode), chat_template=st.chat_template,
                                      continue_final_message=body.continue_final_message,
                                      **(body.chat_template_kwargs or {}))
    except (ValueError, TypeError) as e:
        raise RequestError("messages", str(e)) from None
    await asyncio.to_thread(st.engine.precompile, params)    # a bad schema is a 400 before anything runs
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await submit(st, rid, [{"prompt_token_ids": ids}], params, body.priority, stream=body.stream)
    created = int(time.time())
    if body.stream:
        return sse(_chunks(st, rid, created, streams, body, top or 0, mode), streams)
    out, = await collect(http, streams)
    return {"id": rid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": [_choice(st, body, o, top or 0, mode) for o in out.outputs],
            "usage": usage_of([out])}


def _choice(st: ServerState, body: ChatCompletionRequest, o: CompletionOutput, top: int, mode: str) -> dict:
    message: dict = {"role": "assistant", "content": o.text}
    finish = o.finish_reason
    if mode != "none":
        content, calls = tool_calls.parse(body, mode, o.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls"
    return {"index": o.index, "message": message, "logprobs": chat_logprobs(st.engine.tokenizer, o, top),
            "finish_reason": finish, "stop_reason": o.stop_reason}


async def _chunks(st: ServerState, rid: str, created: int, streams, body: ChatCompletionRequest, top: int,
                  mode: str):
    """Text deltas as they come. With tools, a choice's text is held until it finishes and then sent
    as one `delta.tool_calls` (each call with its index) and the finish reason, or as content if the
    output was not a call."""
    def wrap(choices):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "choices": choices}

    for i in range(body.n):
        yield wrap([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}])
    usage = Usage()
    held: dict[int, list[str]] = {}
    async for _, item in deltas(streams, usage):
        if isinstance(item, RequestError):
            yield item
            return
        if isinstance(item, RequestOutput):
            continue
        o: CompletionOutput = item
        lp = chat_logprobs(st.engine.tokenizer, o, top)
        if mode == "none":
            yield wrap([{"index": o.index, "delta": {"content": o.text}, "logprobs": lp,
                         "finish_reason": o.finish_reason}])
            continue
        held.setdefault(o.index, []).append(o.text)
        if o.finish_reason is None:
            continue
        content, calls = tool_calls.parse(body, mode, "".join(held.pop(o.index)))
        delta: dict = {"content": content}
        if calls:
            delta["tool_calls"] = [c | {"index": k} for k, c in enumerate(calls)]
        yield wrap([{"index": o.index, "delta": delta, "logprobs": lp, "finish_reason": None}])
        yield wrap([{"index": o.index, "delta": {}, "logprobs": None,
                     "finish_reason": "tool_calls" if calls else o.finish_reason}])
    if body.stream_options and body.stream_options.include_usage:
        yield wrap([]) | {"usage": usage.body()}
