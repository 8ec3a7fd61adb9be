"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM, SGLang and
llama.cpp's server serve it, so the Anthropic SDK and coding agents can point at pagedserve.

A request is translated into what /v1/chat/completions runs (as `responses_api.py` does): `system` and
the user / assistant turns become chat messages (`tool_use` blocks an assistant's tool calls,
`tool_result` blocks tool messages), `tools` / `tool_choice` and the sampling fields a
ChatCompletionRequest, so the chat template, the tool-call parser and the constraints are chat's own.
Without --tool-call-parser, tools with `tool_choice` auto still reach the template and the output is
text (agents always send tools: a 400 would lock them out). The answer is a `message` whole, or
Anthropic's stream (`message_start`, per block `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`). Errors come in Anthropic's shape (`http_errors.error_response` picks
it by the path)."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.entrypoints import tool_calls
from pagedserve.entrypoints.http_errors import RequestError, anthropic_error_body
from pagedserve.entrypoints.protocol import (INT32_MAX, ChatCompletionRequest, FunctionDefinition, NamedFunction,
                                             NamedToolChoice, Tool, _Body, _Sampling, to_sampling_params)
from pagedserve.entrypoints.responses import (EngineStreamResponse, Usage, admit, check_model, collect, deltas,
                                              model_name, state)
from pagedserve.entrypoints.server_state import ServerState
from pagedserve.errors import EngineDeadError
from pagedserve.tokenizer import apply_chat_template

router = APIRouter()


# ---------------------------------------------------------------- the request body
class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]     # blocks are checked by `conversation` (400 naming the block)


class MessagesTool(_Body):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None   # server tools (web search, ...) are not served
    cache_control: dict[str, Any] | None = None     # accepted and ignored (the prefix cache is automatic)


class MessagesToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Sampling):
    """Anthropic's fields (`metadata` accepted and ignored), and the sampling extensions every
    generating route takes (min_p, seed, repetition_penalty, priority, traffic_class)."""
    messages: list[MessageParam] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    # accepted and ignored: extended thinking is the model's own; the prefix cache is automatic
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: the same body, max_tokens not needed."""
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)


# ---------------------------------------------------------------- the request as a chat request
def _text_blocks(content: Any, where: str) -> str:
    """A string, or a list of text blocks (cache_control and citations on them ignored)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"{where}: must be a string or a list of text blocks")
    parts = []
    for j, b in enumerate(content):
        if (kind := _kind(b)) != "text":
            raise RequestError(f"{where}[{j}].type", f"{where}[{j}].type: block type {kind!r} is not supported "
                                                     f"here (only text)")
        parts.append(_field(b, "text", str, f"{where}[{j}]"))
    return "".join(parts)


def _field(block: dict, name: str, kind: type, where: str) -> Any:
    if not isinstance(block.get(name), kind):
        raise RequestError(f"{where}.{name}", f"{where}.{name}: must be a{'n' if kind is dict else ''} "
                                              f"{'object' if kind is dict else 'string'}")
    return block[name]


def conversation(body: MessagesRequest, images: list[tuple[str, str]] | None = None, mark: str = "") -> list[dict]:
    """`system` and `messages` as chat-template messages; a malformed block is a 400 naming it. Image
    blocks (a vision-language model: `images` given) become `mark` + newline where they stand, their
    data URLs appended to `images` with the field naming each; without `images` they are refused."""
    msgs = [{"role": "system", "content": _text_blocks(body.system, "system")}] if body.system else []
    names: dict[str, str] = {}              # tool_use id -> tool name (tool messages carry it)
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            msgs.append(_assistant_turn(m.content, f"messages[{i}].content", names))
        else:
            msgs += _user_turn(m.content, f"messages[{i}].content", names, images, mark)
    return msgs


def _assistant_turn(blocks: list[dict], where: str, names: dict[str, str]) -> dict:
    """Text blocks and tool_use blocks: one assistant message with its tool calls."""
    text, calls = [], []
    for j, b in enumerate(blocks):
        at, kind = f"{where}[{j}]", _kind(b)
        if kind == "text":
            text.append(_field(b, "text", str, at))
        elif kind == "tool_use":
            tid, name = _field(b, "id", str, at), _field(b, "name", str, at)
            names[tid] = name
            calls.append({"id": tid, "type": "function",
                          "function": {"name": name, "arguments": _field(b, "input", dict, at)}})
        elif kind not in ("thinking", "redacted_thinking"):   # not shown again (as chat templates drop it)
            raise RequestError(f"{at}.type", f"{at}.type: block type {kind!r} is not supported in an assistant "
                                             f"message (supported: text, tool_use, thinking)")
    return {"role": "assistant", "content": "".join(text)} | ({"tool_calls": calls} if calls else {})


def _user_turn(blocks: list[dict], where: str, names: dict[str, str], images: list | None, mark: str) -> list[dict]:
    """Text blocks and tool_result blocks: a tool message per result, the text around them as user messages."""
    msgs, text, results = [], [], 0
    for j, b in enumerate(blocks):
        at, kind = f"{where}[{j}]", _kind(b)
        if kind == "text":
            text.append(_field(b, "text", str, at))
        elif kind == "tool_result":
            if text:
                msgs.append({"role": "user", "content": "".join(text)})
                text = []
            tid = _field(b, "tool_use_id", str, at)
            result = _text_blocks(b.get("content", ""), f"{at}.content")
            msgs.append({"role": "tool", "content": f"Error: {result}" if b.get("is_error") else result,
                         "tool_call_id": tid} | ({"name": names[tid]} if tid in names else {}))
            results += 1
        elif kind == "image" and images is not None:
            images.append(_image_url(b, at))
            text.append(f"{mark}\n")
        else:
            raise RequestError(f"{at}.type", f"{at}.type: block type {kind!r} is not supported in a user message "
                                             f"(supported: text, tool_result)")
    if text or not results:
        msgs.append({"role": "user", "content": "".join(text)})
    return msgs


def _image_url(block: dict, at: str) -> tuple[str, str]:
    """An image block's source as a URL (base64 -> a data URL) and the field naming it."""
    src = _field(block, "source", dict, at)
    if src.get("type") == "base64":
        media, data = _field(src, "media_type", str, f"{at}.source"), _field(src, "data", str, f"{at}.source")
        return f"data:{media};base64,{data}", f"{at}.source.data"
    if src.get("type") == "url":
        return _field(src, "url", str, f"{at}.source"), f"{at}.source.url"
    raise RequestError(f"{at}.source.type", f"{at}.source.type: must be base64 or url, got {src.get('type')!r}")


def _kind(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def as_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The ChatCompletionRequest whose tools, tool choice and sampling this request means."""
    tools = None if not body.tools else [
        Tool.model_construct(type="function", function=FunctionDefinition.model_construct(
            name=t.name, description=t.description, parameters=t.input_schema)) for t in body.tools]
    c = body.tool_choice
    choice = None if c is None else {"auto": "auto", "any": "required", "none": "none"}.get(c.type)
    if c is not None and c.type == "tool":
        if c.name is None:
            raise RequestError("tool_choice.name", "tool_choice.name: tool_choice type 'tool' needs the tool's name")
        choice = NamedToolChoice(type="function", function=NamedFunction(name=c.name))
    fields = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                     "repetition_penalty", "priority")}
    return ChatCompletionRequest.model_construct(
        messages=[], tools=tools, tool_choice=choice, stop=list(body.stop_sequences or []),
        parallel_tool_calls=not (c is not None and c.disable_parallel_tool_use), max_completion_tokens=body.max_tokens,
        **fields)


def plan(st: ServerState, body: MessagesRequest) -> tuple[ChatCompletionRequest, str, list[dict] | None]:
    """(the chat request, its tool mode, the tools the template gets). Without a parser, `auto` is text
    with the tools still shown to the model."""
    chat = as_chat(body)
    if chat.tools and chat.tool_choice in (None, "auto") and st.tool_call_parser is None:
        return chat, "none", tool_calls.template_tools(chat, "auto")
    mode = tool_calls.tool_mode(chat, st.tool_call_parser, st.chat_template or st.engine.tokenizer.chat_template)
    return chat, mode, tool_calls.template_tools(chat, mode)


def prompt_of(st: ServerState, body: MessagesRequest, tools: list[dict] | None) -> dict:
    """The prompt through the model's chat template; a final assistant turn is continued (prefill). With
    image blocks (a vision-language model), the images decoded and their placeholders expanded."""
    vision = st.engine.images
    urls: list[tuple[str, str]] | None = [] if vision is not None else None
    msgs = conversation(body, urls, vision.placeholder if vision is not None else "")
    prefill = msgs[-1]["role"] == "assistant" and "tool_calls" not in msgs[-1]
    try:
        ids = apply_chat_template(st.engine.tokenizer, msgs, not prefill, tools=tools, chat_template=st.chat_template,
                                  continue_final_message=prefill)
    except (ValueError, TypeError) as e:
        raise RequestError(getattr(e, "param", "messages"), str(e)) from None
    return vision.prompt(ids, urls, st.engine.args.allowed_media_domains) if urls else {"prompt_token_ids": ids}


# ---------------------------------------------------------------- the routes
@router.post("/v1/messages")
async def create_message(body: MessagesRequest, http: Request):
    st = state(http)
    check_model(st, body.model)
    chat, mode, tools = plan(st, body)
    params = to_sampling_params(chat, body.max_tokens, None, constraint=tool_calls.constraint(chat, mode))
    rid, prompts, streams = await admit(st, http, body, "msg_", params,
                                        lambda: [prompt_of(st, body, tools)])
    shell = {"id": rid, "type": "message", "role": "assistant", "model": model_name(st, body.model), "content": [],
             "stop_reason": None, "stop_sequence": None}
    n_prompt = len(prompts[0]["prompt_token_ids"])
    if body.stream:
        return EngineStreamResponse(_sse(_events(chat, mode, shell, streams, n_prompt)), streams)
    out, = await collect(http, streams)
    o = out.outputs[0]
    blocks, stop_reason = _blocks(chat, mode, o)
    return shell | {"content": blocks, "stop_reason": stop_reason, "stop_sequence": _stop_sequence(o),
                    "usage": {"input_tokens": n_prompt, "output_tokens": len(o.token_ids)}}


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, http: Request):
    st = state(http)
    check_model(st, body.model)
    _, _, tools = plan(st, body)
    return {"input_tokens": len((await asyncio.to_thread(prompt_of, st, body, tools))["prompt_token_ids"])}


# ---------------------------------------------------------------- the response
def _stop_sequence(o: CompletionOutput) -> str | None:
    return o.stop_reason if isinstance(o.stop_reason, str) else None     # (an int: the EOS token)


def _blocks(chat: ChatCompletionRequest, mode: str, o: CompletionOutput) -> tuple[list[dict], str]:
    """(content blocks, stop_reason) of a finished output: a text block (unless the output is only
    tool calls), then a tool_use block per call."""
    content, calls = tool_calls.parse(chat, mode, o.text) if mode != "none" else (o.text, [])
    if any(not isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls):
        content, calls = o.text, []         # a tool_use block's input is an object: anything else stays text
    blocks = [{"type": "text", "text": content or ""}] if content or not calls else []
    blocks += [{"type": "tool_use", "id": f"toolu_{c['id'].removeprefix('call_')}", "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"])} for c in calls]
    if calls:
        return blocks, "tool_use"
    if o.finish_reason == "length":
        return blocks, "max_tokens"
    return blocks, "stop_sequence" if _stop_sequence(o) is not None else "end_turn"


async def _events(chat: ChatCompletionRequest, mode: str, shell: dict, streams, n_prompt: int):
    """Anthropic's stream. Text is streamed as it comes into block 0; with tools the output is held
    until it finishes (a call is only known to be one once it is whole), then sent block by block."""
    yield {"type": "message_start", "message": shell | {"usage": {"input_tokens": n_prompt, "output_tokens": 0}}}
    if mode == "none":
        yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    usage = Usage(prompt={0: n_prompt})
    held: list[str] = []
    final: CompletionOutput | None = None
    async for _, item in deltas(streams, usage):
        if isinstance(item, RequestError):
            yield item
            return
        if isinstance(item, RequestOutput):
            continue
        final = item
        if mode != "none":
            held.append(item.text)
        elif item.text:
            yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": item.text}}
    if final is None:
        return
    blocks, stop_reason = _blocks(chat, mode, CompletionOutput(0, "".join(held), [], None, None, final.finish_reason,
                                                               final.stop_reason))
    if mode == "none":
        yield {"type": "content_block_stop", "index": 0}
    else:
        for k, b in enumerate(blocks):
            if b["type"] == "text":
                yield {"type": "content_block_start", "index": k, "content_block": {"type": "text", "text": ""}}
                if b["text"]:
                    yield {"type": "content_block_delta", "index": k,
                           "delta": {"type": "text_delta", "text": b["text"]}}
            else:
                yield {"type": "content_block_start", "index": k, "content_block": b | {"input": {}}}
                yield {"type": "content_block_delta", "index": k,
                       "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}}
            yield {"type": "content_block_stop", "index": k}
    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": _stop_sequence(final)},
           "usage": {"output_tokens": usage.completion}}
    yield {"type": "message_stop"}


async def _sse(events):
    """Each event with its `event:` line; a failure (or an engine that dies mid-stream) as an `error`
    event, which the Anthropic SDK raises as the matching APIStatusError."""
    try:
        async for ev in events:
            if isinstance(ev, RequestError):
                yield f"event: error\ndata: {json.dumps(anthropic_error_body(ev.status, ev.message))}\n\n"
                return
            yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"
    except EngineDeadError as e:
        yield f"event: error\ndata: {json.dumps(anthropic_error_body(500, f'the engine is dead: {e}'))}\n\n"
