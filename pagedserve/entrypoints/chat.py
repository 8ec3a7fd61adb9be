"""POST /v1/chat/completions: the chat template (with tools and tool results), structured outputs
(`response_format`), tool calls (`tool_calls.py`), reasoning (`reasoning.py`), logprobs; whole or as
SSE chunks."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.entrypoints import reasoning, tool_calls
from pagedserve.entrypoints.protocol import ChatCompletionRequest, legacy_functions, message_dict, to_sampling_params
from pagedserve.entrypoints.responses import (Usage, admit, chat_logprobs, check_model, collect, deltas, model_name,
                                              sse, state, usage_of)
from pagedserve.entrypoints.http_errors import RequestError
from pagedserve.entrypoints.server_state import ServerState
from pagedserve.engine.multimodal import split_image_parts
from pagedserve.tokenizer import apply_chat_template

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request):
    st = state(http)
    check_model(st, body.model)
    legacy_functions(body)
    template = st.chat_template or st.engine.tokenizer.chat_template
    mode = tool_calls.tool_mode(body, st.tool_call_parser, template)
    grammar = tool_calls.constraint(body, mode)
    if grammar is not None and body.response_format is not None and body.response_format.type != "text":
        raise RequestError("response_format", "response_format: not with tool_choice 'required' or a named tool "
                                              "(the output is already the tool call's JSON)")
    top = body.top_logprobs
    params = to_sampling_params(body, body.max_completion_tokens or body.max_tokens,
                                (top or 0) if body.logprobs else None, constraint=grammar)

    def prompt() -> list[dict]:
        contents, urls = split_image_parts([m.content for m in body.messages], st.engine.images)
        messages = [m if c is m.content else m.model_copy(update={"content": c}) for m, c in zip(body.messages, contents)]
        try:
            msgs = [message_dict(m) for m in messages]
            ids = apply_chat_template(st.engine.tokenizer, msgs, body.add_generation_prompt,
                                      tools=tool_calls.template_tools(body, mode), chat_template=st.chat_template,
                                      continue_final_message=body.continue_final_message,
                                      **({"reasoning_effort": body.reasoning_effort} if body.reasoning_effort else {}),
                                      **(body.chat_template_kwargs or {}))
        except (ValueError, TypeError) as e:
            raise RequestError(getattr(e, "param", "messages"), str(e)) from None
        return [st.engine.images.prompt(ids, urls, st.engine.args.allowed_media_domains) if urls
                else {"prompt_token_ids": ids}]
    rid, prompts, streams = await admit(st, http, body, "chatcmpl-", params, prompt, prompt_field="messages")
    created = int(time.time())
    if body.stream:
        n_prompt = len(prompts[0]["prompt_token_ids"])
        return sse(_chunks(st, rid, created, streams, body, top or 0, mode, n_prompt), streams)
    out, = await collect(http, streams)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model_name(st, body.model),
            "system_fingerprint": st.system_fingerprint,
            "choices": [_choice(st, body, o, top or 0, mode) for o in out.outputs],
            "usage": usage_of([out])}


def _choice(st: ServerState, body: ChatCompletionRequest, o: CompletionOutput, top: int, mode: str) -> dict:
    text, message = o.text, {"role": "assistant", "refusal": None}     # refusal: required (null) by OpenAI's spec
    if st.reasoning_parser:
        message["reasoning_content"], text = reasoning.split(st.reasoning_parser, text)
    message["content"] = text
    finish = o.finish_reason
    if mode != "none":
        content, calls = tool_calls.parse(body, mode, text)
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls"
    return {"index": o.index, "message": message, "logprobs": chat_logprobs(st.engine.tokenizer, o, top),
            "finish_reason": finish, "stop_reason": o.stop_reason}


async def _chunks(st: ServerState, rid: str, created: int, streams, body: ChatCompletionRequest, top: int,
                  mode: str, n_prompt: int):
    """Text deltas as they come. With tools, a choice's text is held until it finishes and then sent
    as one `delta.tool_calls` (each call with its index) and the finish reason, or as content if the
    output was not a call."""
    usage = Usage(prompt={0: n_prompt})
    thinking = {i: reasoning.ReasoningStream(st.reasoning_parser) for i in range(body.n)} if st.reasoning_parser else {}
    every = body.stream_options is not None and body.stream_options.usage_in_every_chunk()

    def wrap(choices):
        chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name(st, body.model),
                 "system_fingerprint": st.system_fingerprint, "choices": choices}
        return chunk | {"usage": usage.body()} if every else chunk

    for i in range(body.n):
        yield wrap([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}])
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
            yield wrap([{"index": o.index, "delta": _text_delta(thinking.get(o.index), o), "logprobs": lp,
                         "finish_reason": o.finish_reason}])
            continue
        held.setdefault(o.index, []).append(o.text)
        if o.finish_reason is None:
            continue
        text, delta = "".join(held.pop(o.index)), {}
        if st.reasoning_parser:
            delta["reasoning_content"], text = reasoning.split(st.reasoning_parser, text)
        content, calls = tool_calls.parse(body, mode, text)
        delta["content"] = content
        if calls:
            delta["tool_calls"] = [c | {"index": k} for k, c in enumerate(calls)]
        yield wrap([{"index": o.index, "delta": delta, "logprobs": lp, "finish_reason": None}])
        yield wrap([{"index": o.index, "delta": {}, "logprobs": None,
                     "finish_reason": "tool_calls" if calls else o.finish_reason}])
    if body.stream_options and body.stream_options.include_usage:
        yield wrap([]) | {"usage": usage.body()}


def _text_delta(thinking: reasoning.ReasoningStream | None, o: CompletionOutput) -> dict:
    """{"content": ...}, or with a reasoning parser the reasoning part as "reasoning_content"."""
    if thinking is None:
        return {"content": o.text}
    r, c = thinking.feed(o.text, final=o.finish_reason is not None)
    return ({"reasoning_content": r} if r else {}) | ({"content": c} if c or not r else {})
