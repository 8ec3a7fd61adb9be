"""Tool calls on /v1/chat/completions, as vLLM serves them.

- `tool_choice` "required" or a named function: the output is constrained (a JSON-schema grammar)
  to the tool-call JSON, so it always parses and its arguments validate against the tool's
  parameters; it is returned as `message.tool_calls` with finish reason "tool_calls".
- "auto": the model decides, so it needs a chat template that renders `tools` and a parser for how
  the model writes a call (`--tool-call-parser`); otherwise the request gets a 400, never silence.
- "none" (the default without tools): plain text; the tools are not shown to the model."""
from __future__ import annotations

import json
import re
import uuid

from pagedserve.entrypoints.protocol import ChatCompletionRequest, NamedToolChoice
from pagedserve.entrypoints.http_errors import RequestError
from pagedserve.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)     # <tool_call>{"name": ..., "arguments": {...}}</tool_call>


def tool_mode(body: ChatCompletionRequest, parser: str | None, chat_template: str | None) -> str:
    """"none" | "auto" | "required" | "named", or a 400 naming the field."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if isinstance(choice, NamedToolChoice):
        if not body.tools or choice.function.name not in {t.function.name for t in body.tools}:
            raise RequestError("tool_choice", f"tool_choice: no tool named {choice.function.name!r} in tools")
        return "named"
    if choice == "required" and not body.tools:
        raise RequestError("tool_choice", "tool_choice: 'required' needs a non-empty tools list")
    if choice == "auto" and body.tools:
        if parser is None:
            raise RequestError("tool_choice", "tool_choice: 'auto' needs a server started with "
                                              "--enable-auto-tool-choice and --tool-call-parser (one of "
                                              f"{', '.join(TOOL_CALL_PARSERS)}); use 'required', a named "
                                              "function or 'none'")
        if not chat_template or "tools" not in chat_template:
            raise RequestError("tool_choice", "tool_choice: 'auto' needs a chat template that renders tools; "
                                              "this model's does not (start the server with --chat-template)")
        return "auto"
    if choice == "auto":
        return "none"
    return choice


def constraint(body: ChatCompletionRequest, mode: str) -> StructuredOutputsParams | None:
    """The grammar that makes the output a tool call: for "required" a JSON array of one or more
    {"name", "parameters"} objects (each name with its own parameters), for a named function its
    parameters object."""
    if mode == "named":
        tool = _tool(body, body.tool_choice.function.name)
        return StructuredOutputsParams(json=tool.function.parameters or {"type": "object"}, param="tools")
    if mode == "required":
        items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": t.function.name},
                                 "parameters": t.function.parameters or {"type": "object"}}} for t in body.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, param="tools")
    return None


def parse(body: ChatCompletionRequest, mode: str, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output. A constrained output that does not parse was cut
    off by max_tokens: it is returned as content."""
    try:
        if mode == "named":
            return None, [_call(body.tool_choice.function.name, json.loads(text))]
        if mode == "required":
            return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
    except (ValueError, KeyError, TypeError):
        return text, []
    if mode == "auto":
        return parse_hermes(text)
    return text, []


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    calls = []
    for m in _HERMES.finditer(text):
        try:
            c = json.loads(m.group(1))
            calls.append(_call(c["name"], c.get("arguments", c.get("parameters", {}))))
        except (ValueError, KeyError, TypeError):
            return text, []          # a malformed call: the text as it is
    if not calls:
        return text, []
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def _call(name: str, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool(body: ChatCompletionRequest, name: str):
    return next(t for t in body.tools if t.function.name == name)


def template_tools(body: ChatCompletionRequest, mode: str) -> list[dict] | None:
    """The tools as chat templates take them (none when tool_choice is 'none')."""
    if mode == "none" or not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]
