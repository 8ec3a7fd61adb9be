"""The server against OpenAI's published OpenAPI document (issue 52): a pinned copy in openapi/ (its README
names the source commit). Every response validates against the spec's schema (chat completion and its
stream's chunks, text completion, Response and its stream events, embeddings, models, errors); every
optional request field the spec defines, with a sample value made from its schema and with null where
the spec allows null, is answered 200 or, for the few fields knowingly refused (`REFUSED`), a 400 in
OpenAI's error shape naming that field. Nothing is downloaded: the tests read only the pinned file."""
from __future__ import annotations

import functools
import json
import pathlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml
from jsonschema import Draft202012Validator
from pydantic import TypeAdapter
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.entrypoints.helpers import serve_in_thread
from tests.entrypoints.test_clients import TOOLS_TEMPLATE

SPEC_PATH = pathlib.Path(__file__).parent / "openapi" / "openai-openapi.yaml"
SPEC_URI = "urn:openai-openapi"
MAX_MODEL_LEN = 128
USER = [{"role": "user", "content": "Say hi."}]

# path -> (request schema, base body: the required fields and a small token limit)
ENDPOINTS = {
    "/chat/completions": ("CreateChatCompletionRequest", {"model": "m", "messages": USER, "max_tokens": 2}),
    "/completions": ("CreateCompletionRequest", {"model": "m", "prompt": "Hi", "max_tokens": 2}),
    "/responses": ("CreateResponse", {"model": "m", "input": "Hi", "max_output_tokens": 16}),   # the spec's least
    "/embeddings": ("CreateEmbeddingRequest", {"model": "m", "input": "Hi"}),
}
RESPONSE_SCHEMAS = {"/chat/completions": "CreateChatCompletionResponse", "/completions": "CreateCompletionResponse",
                    "/responses": "Response", "/embeddings": "CreateEmbeddingResponse"}
STREAM_SCHEMAS = {"/chat/completions": "CreateChatCompletionStreamResponse",
                  "/completions": "CreateCompletionResponse", "/responses": "ResponseStreamEvent"}
# the token limits: the base body's, and whatever replaces it when one of these is the field under test
LIMITS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}
# a null limit is the context's end: these keep such a request short (chat: the other limit; else a long prompt)
NO_LIMIT = {"/chat/completions": {"max_tokens": 2, "max_completion_tokens": 2},
            "/completions": {"prompt": [5] * (MAX_MODEL_LEN - 4)},
            "/responses": {"input": "word " * (MAX_MODEL_LEN - 48)}}

# (path, field) -> why a valid value of it is a 400 naming the field (features this server does not have)
REFUSED = {
    ("/chat/completions", "moderation"): "no moderation is run",
    ("/completions", "suffix"): "no insertion (fill-in-the-middle) mode",
    ("/responses", "moderation"): "no moderation is run",
    ("/responses", "prompt"): "no stored prompt templates",
    ("/responses", "conversation"): "no stored conversations (previous_response_id is served)",
    ("/responses", "truncation"): "'auto' (dropping the conversation's first items) is not done",
    ("/embeddings", "dimensions"): "only a model's own (matryoshka) dimensions",
}
# fields whose sample names something that does not exist here: a 404 naming the field
NOT_FOUND = {("/responses", "previous_response_id")}


# ---------------------------------------------------------------- the pinned spec
def _nullable_as_null_type(node: Any) -> Any:
    """The document is OpenAPI 3.1 (JSON Schema 2020-12) but still marks some fields with 3.0's
    `nullable: true`, which 2020-12 ignores: read it as `anyOf: [schema, null]`."""
    if isinstance(node, list):
        return [_nullable_as_null_type(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable_as_null_type(v) for k, v in node.items()}
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def spec() -> dict:
    with open(SPEC_PATH, "rb") as f:
        return _nullable_as_null_type(yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))


@functools.cache
def registry() -> Registry:
    return Registry().with_resource(SPEC_URI, Resource.from_contents(spec(), default_specification=DRAFT202012))


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"{SPEC_URI}#/components/schemas/{name}"}, registry=registry())


def schema_errors(name: str, instance: Any) -> list[str]:
    """Each error with where it is; a oneOf/anyOf failure lists its branches' own errors (the closest first)."""
    def describe(e) -> str:
        where = "/".join(map(str, e.absolute_path)) or "<root>"
        return f"{where}: {e.message[:300]}"
    out = []
    for e in validator(name).iter_errors(instance):
        out.append(describe(e))
        for sub in sorted(e.context or (), key=lambda s: -len(s.absolute_path))[:5]:
            out.append("    " + describe(sub))
    return out


def assert_valid(name: str, instance: Any) -> None:
    errors = schema_errors(name, instance)
    assert not errors, f"not a valid {name}:\n" + "\n".join(errors) + "\n" + json.dumps(instance)[:2000]


def schema(ref_or_schema: dict) -> dict:
    while "$ref" in ref_or_schema:
        ref_or_schema = spec()["components"]["schemas"][ref_or_schema["$ref"].rsplit("/", 1)[1]]
    return ref_or_schema


def properties(s: dict) -> tuple[dict[str, dict], set[str]]:
    """A schema's properties and required names through its allOf."""
    s, props, required = schema(s), {}, set()
    for part in s.get("allOf", []):
        p, r = properties(part)
        props.update(p)
        required |= r
    props.update(s.get("properties", {}))
    return props, required | set(s.get("required", []))


def sample(s: dict) -> Any:
    """One valid value of a schema: its enum's first, const, default or example, else the first non-null
    branch's, else a value of its type (an object with its required properties, an array of one item)."""
    s = schema(s)
    if "enum" in s:
        return next(v for v in s["enum"] if v is not None)
    if "const" in s:
        return s["const"]
    branches = [b for b in s.get("anyOf", []) + s.get("oneOf", []) if schema(b).get("type") != "null"]
    if branches and "type" not in s:
        return sample(branches[0])
    if s.get("allOf"):
        props, required = properties(s)
        return {k: sample(props[k]) for k in sorted(required) if k in props}
    if s.get("default") is not None:
        return s["default"]
    if "example" in s and not isinstance(s["example"], (dict, list)):
        return s["example"]
    kind = s.get("type", "object")
    kind = next(t for t in kind if t != "null") if isinstance(kind, list) else kind
    if kind in ("integer", "number"):
        return max(s.get("minimum", 1), min(1, s.get("maximum", 1)))
    if kind == "boolean":
        return True
    if kind == "string":
        return "x" * s.get("minLength", 1)
    if kind == "array":
        return [sample(s.get("items", {"type": "string"}))] * max(1, s.get("minItems", 1))
    props, required = properties(s)
    return {k: sample(props[k]) for k in sorted(required) if k in props}


def optional_fields(path: str) -> list[tuple[str, dict]]:
    props, required = properties({"$ref": f"#/components/schemas/{ENDPOINTS[path][0]}"})
    return [(k, v) for k, v in sorted(props.items()) if k not in required and k != "model"]


@functools.cache
def request_cases() -> list[tuple[str, str, Any]]:
    """Each optional field with a sample value, and with null where the whole request schema allows it
    (asked of the validator: a property's allOf parts may disagree on null, and then null is invalid)."""
    cases = []
    for path in ENDPOINTS:
        for field, s in optional_fields(path):
            cases.append((path, field, sample(s)))
            if not schema_errors(ENDPOINTS[path][0], body_for(path, field, None)):
                cases.append((path, field, None))
    return cases


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=128, max_model_len=MAX_MODEL_LEN, max_num_seqs=8))
    # a tool-call parser and a template that renders tools: tools with the spec's default tool_choice
    # ("auto") are served, not refused
    app = build_app(engine, served_model_name="m", dashboard=False, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes")
    with serve_in_thread(app) as base:
        yield base + "/v1"


def sse_events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def completion_gaps(path: str, body: dict) -> dict:
    """Two nulls OpenAI itself sends where its spec's text_completion (and the SDK's Completion type) has
    none: a stream chunk's finish_reason until the last chunk (the spec gives chunks the whole response's
    schema), and with echo the first prompt token's logprob (nothing before it to predict it). The SDK's
    client builds its objects without validating, so clients take them. Read as values, so that the rest
    of the body is still checked."""
    if path != "/completions":
        return body
    def choice(c: dict) -> dict:
        lp = c.get("logprobs")
        if lp:
            lp = lp | {"token_logprobs": [0.0 if v is None else v for v in lp["token_logprobs"]],
                       "top_logprobs": [{} if v is None else v for v in lp["top_logprobs"]]}
        return c | {"finish_reason": c["finish_reason"] or "stop", "logprobs": lp}
    return body | {"choices": [choice(c) for c in body["choices"]]}


@functools.cache
def sdk_type(path: str, stream: bool) -> TypeAdapter:
    """The openai SDK's own type of an answer (what its client parses it as)."""
    from openai.types import Completion, CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent
    types = {("/chat/completions", False): ChatCompletion, ("/chat/completions", True): ChatCompletionChunk,
             ("/completions", False): Completion, ("/completions", True): Completion,
             ("/responses", False): Response, ("/responses", True): ResponseStreamEvent,
             ("/embeddings", False): CreateEmbeddingResponse}
    return TypeAdapter(types[path, stream])


def check_answer(path: str, r: httpx.Response, stream: bool) -> None:
    """A 200's body (or every event of its stream) valid against the spec's response schema and the
    openai SDK's type."""
    for body in sse_events(r.text) if stream else [r.json()]:
        body = completion_gaps(path, body)
        assert_valid(STREAM_SCHEMAS[path] if stream else RESPONSE_SCHEMAS[path], body)
        sdk_type(path, stream).validate_python(body)
    assert not stream or sse_events(r.text), r.text


def check_refusal(r: httpx.Response, field: str) -> None:
    assert_valid("ErrorResponse", r.json())
    err = r.json()["error"]
    assert err["type"] in ("invalid_request_error", "not_found_error"), r.text
    assert (err["param"] or "").split(".")[0] == field, r.text


# ---------------------------------------------------------------- the spec's own consistency
def test_pinned_spec_is_openapi_3_1_with_the_served_paths():
    doc = spec()
    assert doc["openapi"].startswith("3.1")
    for path in list(ENDPOINTS) + ["/models"]:
        assert path in doc["paths"]
    assert all(f in dict(optional_fields(p)) for p, f in REFUSED)   # no stale refusal


def test_request_samples_are_valid_against_the_spec():
    for path, field, value in request_cases():
        assert_valid(ENDPOINTS[path][0], body_for(path, field, value))


# ---------------------------------------------------------------- responses
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_response_validates(server, path):
    r = httpx.post(server + path, json=ENDPOINTS[path][1], timeout=60)
    assert r.status_code == 200, r.text
    check_answer(path, r, stream=False)


@pytest.mark.parametrize("path", list(STREAM_SCHEMAS))
def test_stream_events_validate(server, path):
    body = ENDPOINTS[path][1] | {"stream": True}
    if path != "/responses":
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    check_answer(path, r, stream=True)


def test_models_list_validates(server):
    r = httpx.get(server + "/models", timeout=60)
    assert r.status_code == 200
    assert_valid("ListModelsResponse", r.json())
    from openai.types import Model
    TypeAdapter(list[Model]).validate_python(r.json()["data"])
    assert_valid("Model", httpx.get(server + "/models/" + r.json()["data"][0]["id"], timeout=60).json())
    missing = httpx.get(server + "/models/no-such-model", timeout=60)
    assert missing.status_code == 404
    check_refusal(missing, "model")
    assert missing.json()["error"]["code"] == "model_not_found"


def test_chat_with_logprobs_and_n_validates(server):
    body = ENDPOINTS["/chat/completions"][1] | {"logprobs": True, "top_logprobs": 2, "n": 2}
    r = httpx.post(server + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    check_answer("/chat/completions", r, stream=False)
    r = httpx.post(server + "/chat/completions", json=body | {"stream": True}, timeout=60)
    check_answer("/chat/completions", r, stream=True)


def test_completion_with_logprobs_and_echo_validates(server):
    body = ENDPOINTS["/completions"][1] | {"logprobs": 2, "echo": True}
    r = httpx.post(server + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    check_answer("/completions", r, stream=False)


def test_chat_tool_call_validates(server):
    fn = {"name": "report", "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                           "required": ["ok"], "additionalProperties": False}}
    body = ENDPOINTS["/chat/completions"][1] | {"max_tokens": 30, "tools": [{"type": "function", "function": fn}],
                                                "tool_choice": "required"}
    for stream in (False, True):
        r = httpx.post(server + "/chat/completions", json=body | {"stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        check_answer("/chat/completions", r, stream=stream)


def test_responses_function_call_validates(server):
    tool = {"type": "function", "name": "report", "strict": True,
            "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                           "additionalProperties": False}}
    body = ENDPOINTS["/responses"][1] | {"max_output_tokens": 30, "tools": [tool], "tool_choice": "required"}
    for stream in (False, True):
        r = httpx.post(server + "/responses", json=body | {"stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        check_answer("/responses", r, stream=stream)


@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", {"messages": None}, "messages"),
    ("/chat/completions", {"messages": USER, "temperature": "hot"}, "temperature"),
    ("/chat/completions", {"messages": USER, "stream_options": {"include_usage": "x"}}, "stream_options"),
    ("/responses", {"input": "Hi", "stream_options": {"x": 1}}, "stream_options"),
    ("/completions", {"prompt": "Hi", "n": 0}, "n"),
    ("/embeddings", {"input": "Hi", "encoding_format": "hex"}, "encoding_format"),
    ("/responses", {"input": "Hi", "max_output_tokens": -1}, "max_output_tokens"),
])
def test_errors_validate(server, path, body, param):
    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    check_refusal(r, param)


def test_not_found_error_validates(server):
    r = httpx.get(server + "/responses/resp_missing", timeout=60)
    assert r.status_code == 404
    assert_valid("ErrorResponse", r.json())


# ---------------------------------------------------------------- every optional request field
def body_for(path: str, field: str, value: Any) -> dict:
    base = dict(ENDPOINTS[path][1])
    if field in LIMITS and value is None:
        return base | NO_LIMIT[path] | {field: None}
    if field in LIMITS:
        limit = next(v for k, v in base.items() if k in LIMITS)
        base = {k: v for k, v in base.items() if k not in LIMITS}
        value = limit if value is not None else None     # a small limit, not the sample's
    return base | {field: value}


def check_field(server: str, path: str, field: str, value: Any) -> str | None:
    """What is wrong with the answer to the base request with this one field (None: nothing)."""
    try:
        check_field_answer(server, path, field, value)
    except AssertionError as e:
        return f"{path} {field}={json.dumps(value)[:200]}: {str(e)[:1500]}"
    return None


def test_every_optional_field(server):
    # all at once (the engine batches them): one at a time takes minutes on a small CPU
    with ThreadPoolExecutor(8) as pool:
        problems = [p for p in pool.map(lambda case: check_field(server, *case), request_cases()) if p]
    assert not problems, f"{len(problems)} of {len(request_cases())} fields:\n" + "\n".join(problems)


def check_field_answer(server: str, path: str, field: str, value: Any) -> None:
    r = httpx.post(server + path, json=body_for(path, field, value), timeout=120)
    assert r.status_code < 500, r.text
    if (path, field) in REFUSED.keys() | NOT_FOUND and value is not None and r.status_code != 200:
        assert r.status_code == (404 if (path, field) in NOT_FOUND else 400), r.text
        check_refusal(r, field)
        return
    assert r.status_code == 200, f"{field}={json.dumps(value)[:300]}: {r.text}"
    check_answer(path, r, stream=field == "stream" and value is True)
