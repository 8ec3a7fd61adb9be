"""OpenAI request bodies (pydantic) and the mapping to SamplingParams. An unknown field is a 400
that names it; the few fields accepted and ignored are listed in `IGNORED_FIELDS` (and the README).
An explicit null in a field OpenAI's spec marks nullable means its default (`NULL_IS_DEFAULT`)."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.errors import ParamError
from pagedserve.sampling_params import (INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_TOP_K, SamplingParams,
                                        StructuredOutputsParams)

INT32_MAX = 2**31 - 1
# accepted and ignored: they change nothing a single-model server without storage does
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_retention", "prompt_cache_options",
                  # chat: audio output is refused by `modalities`; no web search; a prediction changes only speed
                  "audio", "prediction", "web_search_options", "verbosity", "stream_options.include_obfuscation",
                  # responses: no built-in tools for max_tool_calls to count, no compaction, no output logprobs
                  "max_tool_calls", "context_management", "top_logprobs", "include", "reasoning", "text.verbosity")


def check_utf8(value: Any) -> Any:
    """JSON may carry lone surrogates ("\\ud800") that no tokenizer can encode: reject them here."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("contains a lone surrogate (not valid Unicode text)") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_utf8(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_utf8(k)
            check_utf8(v)
    return value


class _Body(BaseModel):
    """Every number finite, every string valid Unicode, no unknown field: a bad field is a 400 that names it."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # fields OpenAI's spec marks nullable that have a non-null default here: an explicit null is that default
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.NULL_IS_DEFAULT:
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULL_IS_DEFAULT}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, v: Any) -> Any:
        return check_utf8(v)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension (guidellm always sends it): with include_usage, usage so far in every chunk
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None     # OpenAI's; accepted and ignored (no obfuscation padding)

    def usage_in_every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Sampling(_Body):
    """The fields every generating route takes (chat, completions, responses)."""
    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    traffic_class: str | None = Field(None, max_length=64)    # --traffic-classes (or X-Traffic-Class)
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class _Common(_Sampling):
    NULL_IS_DEFAULT = ("n", "stream")
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    n: int = Field(1, ge=1, le=INT32_MAX)          # at most max_num_seqs: checked against the engine
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None      # token id (as a string, JSON keys are) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None   # vLLM's
    guided_json: dict[str, Any] | str | None = None          # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    store: bool | None = None                                 # accepted and ignored (IGNORED_FIELDS)


class CompletionRequest(_Common):
    NULL_IS_DEFAULT = _Common.NULL_IS_DEFAULT + ("echo",)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)     # 0 only with echo: the prompt, scored
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)      # only = n (no server-side ranking)
    suffix: str | None = None                                   # only null (no insertion mode)


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]   # function: legacy `tool`
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None       # legacy: an assistant's one call, as a tool call
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    NULL_IS_DEFAULT = _Common.NULL_IS_DEFAULT + ("logprobs", "parallel_tool_calls")
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's field (Open WebUI sends it when set): given to the chat template, as vLLM does
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated function calling: served as `tools` / `tool_choice` (legacy_functions)
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    modalities: list[Literal["text", "audio"]] | None = None    # "audio" is a 400 (text output only)
    moderation: dict[str, Any] | None = None     # only null: no moderation is run (refuse_unsupported)
    # accepted and ignored (IGNORED_FIELDS)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None          # accepted and ignored


class ResponsesFunctionTool(FunctionDefinition):
    """The Responses API's tools are flat: chat's function definition with the type beside it."""
    type: Literal["function"]


class ResponsesToolChoice(NamedFunction):
    type: Literal["function"]


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool | None = None     # accepted and ignored (no obfuscation padding)


class ResponsesReasoning(_Body):
    effort: str | None = None             # accepted and ignored: the model decides how long it thinks
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Sampling):
    """POST /v1/responses: OpenAI's fields, and vLLM's sampling extensions (top_k, min_p, seed, stop,
    repetition_penalty, priority). `input` items are checked by the route (400 naming the item)."""
    NULL_IS_DEFAULT = ("stream", "store", "background", "parallel_tool_calls")
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    previous_response_id: str | None = None
    store: bool = True                    # kept for previous_response_id and GET unless false
    stream: bool = False
    reasoning: ResponsesReasoning | None = None
    background: bool = False
    truncation: str | None = None
    include: list[str] | None = None      # accepted and ignored (no logprobs / encrypted reasoning to include)
    stream_options: ResponsesStreamOptions | None = None
    # only null (refuse_unsupported): no stored prompt templates, conversations or moderation
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # accepted and ignored (IGNORED_FIELDS)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tool_calls: int | None = Field(None, ge=0)
    context_management: list[dict[str, Any]] | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's; lora_int_id accepted and unused: the name identifies it)."""
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's fields; vLLM's priority)."""
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    traffic_class: str | None = Field(None, max_length=64)
    user: str | None = None               # accepted and ignored (IGNORED_FIELDS)


def structured_outputs(req: _Common) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, under whichever of its names (400 if more than one)."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ParamError("response_format", "response_format: type json_schema needs json_schema.schema")
        found.append(("response_format", {"json": rf.json_schema.schema_}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        found.append(("structured_outputs", {k: v for k, v in (("json", so.json_), ("json_object", so.json_object),
                                                                ("regex", so.regex), ("choice", so.choice),
                                                                ("grammar", so.grammar)) if v}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            found.append((name, {key: getattr(req, name)}))
    if not found:
        return None
    if len(found) > 1:
        raise ParamError(found[1][0], f"{found[1][0]}: only one constraint per request (also got {found[0][0]})")
    name, kw = found[0]
    return StructuredOutputsParams(**kw, param=name)


def logit_bias(req: _Common) -> dict[int, float] | None:
    if req.logit_bias is None:
        return None
    out = {}
    for k, v in req.logit_bias.items():
        if not k.isdigit():
            raise ParamError("logit_bias", f"logit_bias: keys must be token ids, got {k!r}")
        out[int(k)] = v
    return out


def to_sampling_params(req: _Common, max_tokens: int | None, logprobs: int | None,
                       constraint: StructuredOutputsParams | None = None, **extra) -> SamplingParams:
    def pick(v, default):
        return default if v is None else v
    return SamplingParams(
        n=req.n, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), top_k=pick(req.top_k, -1),
        min_p=pick(req.min_p, 0.0), seed=req.seed, presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0), repetition_penalty=pick(req.repetition_penalty, 1.0),
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, max_tokens=max_tokens,
        min_tokens=req.min_tokens, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=logit_bias(req),
        structured_outputs=constraint if constraint is not None else structured_outputs(req), **extra)


# field -> why a non-null value is refused (a 400 naming it): OpenAI features this server does not have
UNSUPPORTED = {"moderation": "no moderation is run", "prompt": "no stored prompt templates",
               "conversation": "no stored conversations (previous_response_id continues a stored response)"}


def refuse_unsupported(req: ChatCompletionRequest | ResponsesRequest) -> None:
    for name, why in UNSUPPORTED.items():
        if getattr(req, name, None) is not None:
            raise ParamError(name, f"{name}: not supported ({why})")


def legacy_functions(req: ChatCompletionRequest) -> None:
    """OpenAI's deprecated function calling as what replaced it: `functions` become tools of type function,
    `function_call` the tool_choice (a ParamError naming the field when both forms are given); and
    `modalities` asking for audio is refused (the server writes text)."""
    refuse_unsupported(req)
    if req.modalities is not None and "audio" in req.modalities:
        raise ParamError("modalities", "modalities: only text output is supported (no audio)")
    if req.functions is not None:
        if req.tools is not None:
            raise ParamError("functions", "functions: not with tools (functions is the deprecated form of tools)")
        req.tools = [Tool(type="function", function=f) for f in req.functions]
    if req.function_call is not None:
        if req.tool_choice is not None:
            raise ParamError("function_call", "function_call: not with tool_choice (function_call is the "
                                              "deprecated form of tool_choice)")
        fc = req.function_call
        req.tool_choice = fc if isinstance(fc, str) else NamedToolChoice(type="function", function=fc)


def message_dict(m: ChatMessage) -> dict:
    """A message as chat templates take it: text content; an assistant's tool calls with their
    arguments parsed (HF templates expect a mapping); a tool result's id and name."""
    content = m.content
    if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if p.get("type") != "text":
                raise ValueError(f"messages: content part type {p.get('type')!r} is not supported (only text)")
            parts.append(str(p.get("text", "")))
        content = "".join(parts)
    out: dict[str, Any] = {"role": "tool" if m.role == "function" else m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    calls = list(m.tool_calls or []) + ([ToolCall(function=m.function_call)] if m.function_call else [])
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in calls]
    return out


def _arguments(text: str) -> Any:
    import json
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError("messages: a tool call's function.arguments must be a JSON string") from None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
