"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE /v1/responses/{id}.

A request is translated into what /v1/chat/completions runs: `instructions` + the previous response's
conversation (`previous_response_id`) + the `input` items become chat messages (function calls and
their outputs become assistant tool calls and tool messages); `tools`, `tool_choice`, `text.format`
and the sampling fields become a ChatCompletionRequest, so tool calls, structured outputs and
reasoning work exactly as there. The output is returned as Response items (`reasoning`, `message`,
`function_call`), whole or as the Responses stream events (`response.created`, ...
`response.output_text.delta`, ... `response.completed`).

Responses are kept for `previous_response_id` and GET unless `store` is false, in a store bounded by
count and bytes (`ResponseStore`: the oldest go first)."""
from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Request

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.entrypoints import reasoning, tool_calls
from pagedserve.entrypoints.protocol import (ChatCompletionRequest, FunctionDefinition, JsonSchemaFormat, NamedFunction,
                                             NamedToolChoice, ResponseFormat, ResponsesRequest, Tool,
                                             refuse_unsupported, to_sampling_params)
from pagedserve.entrypoints.responses import Usage, admit, check_model, collect, deltas, model_name, sse, state
from pagedserve.entrypoints.http_errors import RequestError
from pagedserve.entrypoints.server_state import ServerState
from pagedserve.tokenizer import apply_chat_template

router = APIRouter()

MAX_STORED_RESPONSES = 1024          # ResponseStore bounds: responses kept for previous_response_id / GET
MAX_STORED_BYTES = 64 * 2**20        # ... and the JSON bytes of all of them together


class ResponseStore:
    """Stored responses (the response body and the conversation it ends), oldest evicted first once
    either bound is passed. Touched only from the event loop."""

    def __init__(self, max_items: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_bytes:
            return                      # larger than the whole store: not kept (a later reference is a 404)
        self._items[response["id"]] = (response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, (_, _, s) = self._items.popitem(last=False)
            self.bytes -= s

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        item = self._items.get(rid)
        return None if item is None else item[:2]

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is not None:
            self.bytes -= item[2]
        return item is not None

    def __len__(self) -> int:
        return len(self._items)


def store_of(st: ServerState) -> ResponseStore:
    if st.responses is None:
        st.responses = ResponseStore()
    return st.responses


# ---------------------------------------------------------------- input items -> chat messages
def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or a list of text parts of the given types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"{where}: must be a string or a list of content parts")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds:
            raise RequestError(f"{where}[{j}].type", f"{where}[{j}].type: content part {kind!r} is not supported "
                                                     f"(supported: {', '.join(kinds)})")
        if not isinstance(p.get("text", p.get("refusal")), str):
            raise RequestError(f"{where}[{j}].text", f"{where}[{j}].text: must be a string")
        parts.append(p.get("text", p.get("refusal")))
    return "".join(parts)


def _arguments(text: Any, where: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise RequestError(where, f"{where}: must be a JSON string") from None


def input_messages(items: str | list[dict], offset: int = 0) -> list[dict]:
    """`input` as chat-template messages; a malformed or unsupported item is a 400 naming it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict] = []
    names: dict[str, str] = {}            # call_id -> function name (tool messages carry it)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(where, f"{where}: must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role", f"{where}.role: must be user, system, developer or assistant, "
                                                    f"got {role!r}")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(item.get("content"), f"{where}.content", kinds + ("text",))
            msgs.append({"role": role, "content": text})
        elif kind == "function_call":
            for f in ("call_id", "name", "arguments"):
                if not isinstance(item.get(f), str):
                    raise RequestError(f"{where}.{f}", f"{where}.{f}: a function_call item needs a string {f}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item["arguments"], f"{where}.arguments")}}
            names[item["call_id"]] = item["name"]
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)            # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}.call_id", f"{where}.call_id: a function_call_output needs a string call_id")
            out = item.get("output")
            text = out if isinstance(out, str) else _text_of(out, f"{where}.output", ("input_text",))
            msg = {"role": "tool", "content": text, "tool_call_id": item["call_id"]}
            if item["call_id"] in names:
                msg["name"] = names[item["call_id"]]
            msgs.append(msg)
        elif kind == "reasoning":
            continue        # earlier reasoning is not shown to the model again (as chat templates drop it)
        else:
            raise RequestError(f"{where}.type", f"{where}.type: input item type {kind!r} is not supported (supported: "
                                                "message, function_call, function_call_output, reasoning)")
    return msgs


# ---------------------------------------------------------------- the request as a chat request
def as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The ChatCompletionRequest whose tools, constraints and sampling this request means."""
    tools = None if body.tools is None else [
        Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                          parameters=t.parameters, strict=t.strict))
        for t in body.tools]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    fmt = body.text.format if body.text is not None else None
    rf = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise RequestError("text.format.schema", "text.format.schema: type json_schema needs a schema")
        rf = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.schema_,
                                                                             strict=fmt.strict))
    elif fmt is not None:
        rf = ResponseFormat(type=fmt.type)
    fields = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                     "repetition_penalty", "priority")}
    return ChatCompletionRequest.model_construct(
        messages=[], tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
        response_format=rf, max_completion_tokens=body.max_output_tokens, **fields)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, http: Request):
    st = state(http)
    check_model(st, body.model)
    refuse_unsupported(body)
    if body.background:
        raise RequestError("background", "background: background responses are not supported")
    if body.truncation not in (None, "disabled"):
        raise RequestError("truncation", "truncation: only 'disabled' is supported (a prompt longer than the "
                                         "context is a 400)")
    chat = as_chat(body)
    template = st.chat_template or st.engine.tokenizer.chat_template
    mode = tool_calls.tool_mode(chat, st.tool_call_parser, template)
    grammar = tool_calls.constraint(chat, mode)
    if grammar is not None and chat.response_format is not None and chat.response_format.type != "text":
        raise RequestError("text.format", "text.format: not with tool_choice 'required' or a named tool")
    params = to_sampling_params(chat, body.max_output_tokens, None, constraint=grammar)
    history: list[dict] = []
    if body.previous_response_id is not None:
        prev = store_of(st).get(body.previous_response_id)
        if prev is None:
            raise RequestError("previous_response_id", f"previous_response_id: no stored response "
                                                       f"{body.previous_response_id!r}", 404, "not_found_error")
        history = prev[1]
    convo = history + input_messages(body.input)
    msgs = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + convo
    if not msgs:
        raise RequestError("input", "input: needs at least one message")

    def prompt() -> list[dict]:
        try:
            return [{"prompt_token_ids": apply_chat_template(st.engine.tokenizer, msgs, True, chat_template=st.chat_template,
                                                             tools=tool_calls.template_tools(chat, mode))}]
        except (ValueError, TypeError) as e:
            raise RequestError("input", str(e)) from None
    rid, prompts, streams = await admit(st, http, body, "resp_", params, prompt, prompt_field="input")
    ids = prompts[0]["prompt_token_ids"]
    shell = _shell(st, body, rid, int(time.time()))
    if body.stream:
        return sse(_events(st, body, chat, mode, shell, convo, streams, len(ids)), streams, event_lines=True)
    out, = await collect(http, streams)
    o = out.outputs[0]
    items, message = _items(st, chat, mode, o.text)
    resp = _finish(shell, items, o.finish_reason,
                   _usage(st, out.num_cached_tokens, len(out.prompt_token_ids), len(o.token_ids), items))
    if body.store:
        store_of(st).put(resp, convo + [message])
    return resp


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, http: Request):
    got = store_of(state(http)).get(response_id)
    if got is None:
        raise RequestError("response_id", f"response_id: no stored response {response_id!r}", 404, "not_found_error")
    return got[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, http: Request):
    if not store_of(state(http)).delete(response_id):
        raise RequestError("response_id", f"response_id: no stored response {response_id!r}", 404, "not_found_error")
    return {"id": response_id, "object": "response", "deleted": True}


# ---------------------------------------------------------------- the response body
def _shell(st: ServerState, body: ResponsesRequest, rid: str, created: int) -> dict:
    """The response object without its output (what `response.created` carries)."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
        else {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": "in_progress", "model": model_name(st, body.model),
            "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                            else body.tool_choice.model_dump()) or "auto",
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning else None, "store": body.store,
            "text": {"format": fmt}, "truncation": "disabled", "metadata": body.metadata or {}} | \
        ({"user": body.user} if body.user is not None else {})   # `user` and `usage`: not nullable in OpenAI's spec


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _items(st: ServerState, chat: ChatCompletionRequest, mode: str, text: str) -> tuple[list[dict], dict]:
    """(output items, the assistant message the conversation continues with) of a finished output."""
    items = []
    if st.reasoning_parser:
        thought, text = reasoning.split(st.reasoning_parser, text)
        if thought:
            items.append(_reasoning_item(thought))
    content, calls = tool_calls.parse(chat, mode, text) if mode != "none" else (text, [])
    if content or not calls:
        items.append(_message_item(content or ""))
    items += [_call_item(c) for c in calls]
    message = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}} for c in calls]
    return items, message


def _usage(st: ServerState, cached: int, prompt: int, out: int, items: list[dict]) -> dict:
    thought = "".join(p["text"] for it in items if it["type"] == "reasoning" for p in it["content"])
    n_thought = len(st.engine.tokenizer(thought, add_special_tokens=False)["input_ids"]) if thought else 0
    # cache_write_tokens: what is billed for writing a cache, which nothing here is
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": min(n_thought, out)}, "total_tokens": prompt + out}


def _finish(shell: dict, items: list[dict], finish_reason: str | None, usage: dict) -> dict:
    cut = finish_reason == "length"
    return shell | {"status": "incomplete" if cut else "completed", "output": items, "usage": usage,
                    "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


# ---------------------------------------------------------------- the stream
async def _events(st: ServerState, body: ResponsesRequest, chat: ChatCompletionRequest, mode: str, shell: dict,
                  convo: list[dict], streams, n_prompt: int):
    """The Responses stream: lifecycle events around each output item's added / delta / done events.
    Text is streamed as it comes; with tools, the output is held until it finishes and then sent as
    its items (a call is only known to be one once it is whole)."""
    seq = itertools.count()

    def ev(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    usage = Usage(prompt={0: n_prompt})
    items: list[dict] = []
    open_item: dict | None = None          # the item whose deltas are being sent
    thinking = reasoning.ReasoningStream(st.reasoning_parser) if st.reasoning_parser and mode == "none" else None
    held: list[str] = []
    last: RequestOutput | None = None
    final: CompletionOutput | None = None

    def start(item: dict):
        nonlocal open_item
        items.append(item)
        open_item = item
        idx = len(items) - 1
        added = item | ({"content": []} if item["type"] in ("message", "reasoning") else {})
        if item["type"] == "message":
            added["status"] = "in_progress"
        out = [ev("response.output_item.added", output_index=idx, item=added)]
        if item["type"] == "message":
            out.append(ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return out

    def delta(text: str):
        idx, item = len(items) - 1, open_item
        item["content"][0]["text"] += text
        kind = "response.output_text.delta" if item["type"] == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [ev(kind, item_id=item["id"], output_index=idx, content_index=0, delta=text, **extra)]

    def close():
        nonlocal open_item
        if open_item is None:
            return []
        idx, item = len(items) - 1, open_item
        open_item = None
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            return [ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                       text=text), ev("response.output_item.done", output_index=idx, item=item)]
        return [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text,
                   logprobs=[]),
                ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                   part=item["content"][0]),
                ev("response.output_item.done", output_index=idx, item=item)]

    def text_events(kind: str, text: str):
        out = []
        if open_item is None or open_item["type"] != kind:
            out += close()
            out += start(_message_item("") if kind == "message" else _reasoning_item(""))
        return out + delta(text)

    async for _, item in deltas(streams, usage):
        if isinstance(item, RequestError):
            yield item
            return
        if isinstance(item, RequestOutput):
            last = item
            continue
        o: CompletionOutput = item
        final = o
        if mode != "none":
            held.append(o.text)
            continue
        if thinking is not None:
            r, c = thinking.feed(o.text, final=o.finish_reason is not None)
            for kind, text in (("reasoning", r), ("message", c)):
                if text:
                    for e in text_events(kind, text):
                        yield e
        elif o.text:
            for e in text_events("message", o.text):
                yield e
    if final is None:
        return
    if mode != "none":
        whole, message = _items(st, chat, mode, "".join(held))
        for it in whole:
            if it["type"] == "function_call":
                idx = len(items)
                items.append(it)
                yield ev("response.output_item.added", output_index=idx, item=it | {"arguments": "",
                                                                                      "status": "in_progress"})
                yield ev("response.function_call_arguments.delta", item_id=it["id"], output_index=idx,
                         delta=it["arguments"])
                yield ev("response.function_call_arguments.done", item_id=it["id"], output_index=idx,
                         name=it["name"], arguments=it["arguments"])
                yield ev("response.output_item.done", output_index=idx, item=it)
            else:
                for e in start(it | {"content": [dict(it["content"][0], text="")]}):
                    yield e
                for e in delta(it["content"][0]["text"]) if it["content"][0]["text"] else []:
                    yield e
                for e in close():
                    yield e
    else:
        if not items:                        # an empty output is still one (empty) message
            for e in start(_message_item("")):
                yield e
        for e in close():
            yield e
        content = "".join(it["content"][0]["text"] for it in items if it["type"] == "message")
        message = {"role": "assistant", "content": content}
    prompt = len(last.prompt_token_ids) if last is not None else n_prompt
    cached = last.num_cached_tokens if last is not None else 0
    done = _finish(shell, items, final.finish_reason, _usage(st, cached, prompt, usage.completion, items))
    if body.store:
        store_of(st).put(done, convo + [message])
    # response.completed even when max_output_tokens cut it (status "incomplete" inside, as vLLM does): the
    # openai SDK's stream helper ends only on it
    yield ev("response.completed", response=done)

