"""Where OpenAI's API and the server should agree (issue 52): CORS before the API key, system_fingerprint,
explicit nulls, fields OpenAI accepts, and a prompt over the context as context_length_exceeded. Over real
HTTP with the openai SDK (httpx where the exact JSON on the wire is the point)."""
import httpx
import openai
import pytest

from tests.entrypoints.helpers import serve_in_thread

API_KEY = "test-key"
MAX_MODEL_LEN = 128
USER = [{"role": "user", "content": "Say hi."}]
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=4))
    with serve_in_thread(build_app(engine, api_key=API_KEY, served_model_name="m")) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


def post(base, path, body, headers=None):
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"} | (headers or {}),
                      timeout=60)


# ---------------------------------------------------------------- CORS
def preflight(base, path="/v1/chat/completions", origin=ORIGIN):
    return httpx.options(base + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                               "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_passes_the_api_key_check_but_the_request_does_not(server):
    r = preflight(server)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    body = {"messages": USER, "max_tokens": 1}
    no_key = httpx.post(server + "/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == "*"
    ok = post(server, "/v1/chat/completions", body, headers={"Origin": ORIGIN})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"


def test_cors_flags_without_api_key():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.server import CORSConfig, build_app
    ns = build_parser(only="serve").parse_args(["serve", "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods",
                                                '["GET", "POST"]', "--allowed-headers", '["Authorization"]',
                                                "--allow-credentials"])
    assert (ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials) == \
        ([ORIGIN], ["GET", "POST"], ["Authorization"], True)
    defaults = build_parser(only="serve").parse_args(["serve"])
    assert defaults.allowed_origins == defaults.allowed_methods == defaults.allowed_headers == ["*"]
    assert defaults.allow_credentials is False
    with pytest.raises(SystemExit):
        build_parser(only="serve").parse_args(["serve", "--allowed-origins", "*"])   # not a JSON list
    cors = CORSConfig(tuple(ns.allowed_origins), tuple(ns.allowed_methods), ("authorization", "content-type"), True)
    engine = LLMEngine(EngineArgs(num_kv_blocks=16, max_model_len=64, max_num_seqs=2))
    with serve_in_thread(build_app(engine, cors=cors, dashboard=False, served_model_name="m")) as base:
        r = preflight(base)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-allow-credentials"] == "true"
        assert preflight(base, origin="https://evil.example").status_code == 400    # Starlette's refusal
        ok = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"Origin": ORIGIN},
                        timeout=60)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN


# ---------------------------------------------------------------- system_fingerprint
def test_system_fingerprint_on_chat_chunks_and_completions(client):
    chat = client.chat.completions.create(model="m", messages=USER, max_tokens=2)
    fp = chat.system_fingerprint
    assert fp and fp.startswith("fp_pagedserve-")
    chunks = list(client.chat.completions.create(model="m", messages=USER, max_tokens=2, stream=True))
    assert chunks and all(c.system_fingerprint == fp for c in chunks)
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2).system_fingerprint == fp
    assert all(c.system_fingerprint == fp
               for c in client.completions.create(model="m", prompt="Hi", max_tokens=2, stream=True))


# ---------------------------------------------------------------- explicit null = the default
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER, "n": None, "stream": None, "logprobs": None,
                              "parallel_tool_calls": None, "top_logprobs": None, "stream_options": None,
                              "max_completion_tokens": None, "reasoning_effort": None, "store": None}),
    ("/v1/completions", {"prompt": "Hi", "n": None, "stream": None, "echo": None, "logprobs": None,
                         "best_of": None, "suffix": None}),
    ("/v1/responses", {"input": "Hi", "stream": None, "store": None, "background": None,
                       "parallel_tool_calls": None, "max_output_tokens": 2}),
])
def test_null_is_the_default(server, path, body):
    r = post(server, path, body | ({"max_tokens": 2} if path != "/v1/responses" else {}))
    assert r.status_code == 200, r.text
    out = r.json()
    if path == "/v1/responses":
        assert out["object"] == "response" and out["store"] is True and out["parallel_tool_calls"] is True
    else:
        assert len(out["choices"]) == 1 and out["choices"][0]["logprobs"] is None


def test_stream_null_through_the_sdk(client):
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=2, stream=None, n=None)
    assert r.object == "chat.completion" and len(r.choices) == 1


def test_null_stays_a_400_where_the_field_is_not_nullable(server):
    r = post(server, "/v1/chat/completions", {"messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------- fields OpenAI accepts
def test_openai_chat_fields_accepted(client):
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=2, modalities=["text"],
                                       prediction={"type": "content", "content": "Hi there"},
                                       web_search_options={}, verbosity="low",
                                       extra_body={"audio": {"voice": "alloy", "format": "wav"}})
    assert r.choices[0].message.content is not None


def test_audio_output_is_refused_naming_modalities(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, modalities=["text", "audio"])
    assert e.value.param == "modalities"


OK_FN = {"name": "report", "description": "report the result",
         "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                        "additionalProperties": False}}


def test_legacy_functions_are_served_as_tools(client):
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=30, functions=[OK_FN],
                                       function_call={"name": "report"})
    call, = r.choices[0].message.tool_calls
    assert call.function.name == "report" and r.choices[0].finish_reason == "tool_calls"
    follow = client.chat.completions.create(model="m", max_tokens=2, functions=[OK_FN], function_call="none",
                                            messages=USER + [
                                                {"role": "assistant", "content": None,
                                                 "function_call": {"name": "report", "arguments": '{"ok": true}'}},
                                                {"role": "function", "name": "report", "content": "noted"}])
    assert follow.choices[0].message.tool_calls is None


def test_legacy_functions_beside_tools_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, functions=[OK_FN],
                                       tools=[{"type": "function", "function": OK_FN}])
    assert e.value.param == "functions"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, function_call="none",
                                       tool_choice="none")
    assert e.value.param == "function_call"


# ---------------------------------------------------------------- context_length_exceeded
LONG = " ".join(["word"] * (2 * MAX_MODEL_LEN))


def context_error(call):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    assert e.value.code == "context_length_exceeded", e.value.body
    return e.value


def test_prompt_over_the_context_names_the_prompt_field(client):
    assert context_error(lambda: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": LONG}], max_tokens=1)).param == "messages"
    assert context_error(lambda: client.chat.completions.create(       # no max_tokens: still the messages
        model="m", messages=[{"role": "user", "content": LONG}])).param == "messages"
    assert context_error(lambda: client.completions.create(model="m", prompt=LONG)).param == "prompt"
    assert context_error(lambda: client.completions.create(model="m", prompt=[5] * MAX_MODEL_LEN)).param == "prompt"
    assert context_error(lambda: client.embeddings.create(model="m", input=LONG)).param == "input"
    assert context_error(lambda: client.responses.create(model="m", input=LONG)).param == "input"


def test_chat_stream_over_the_context_is_a_400_before_streaming(client):
    assert context_error(lambda: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": LONG}], stream=True)).param == "messages"


def test_max_tokens_past_the_context_is_blamed_on_max_tokens(client):
    # the prompt fits, with its max_tokens it does not: max_tokens is what to lower (as vLLM)
    e = context_error(lambda: client.completions.create(model="m", prompt=[5] * 10, max_tokens=MAX_MODEL_LEN - 5))
    assert e.param == "max_tokens"
    # max_tokens alone beyond the context: trimming the prompt would not help, so not context_length_exceeded
    with pytest.raises(openai.BadRequestError) as big:
        client.chat.completions.create(model="m", messages=USER, max_tokens=10 * MAX_MODEL_LEN)
    assert big.value.param == "max_tokens" and big.value.code != "context_length_exceeded"
