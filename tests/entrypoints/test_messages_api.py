"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over real HTTP, driven by the
official anthropic SDK unmodified."""
import anthropic
import httpx
import pytest

from tests.entrypoints.helpers import serve_in_thread
from tests.entrypoints.test_clients import TOOLS_TEMPLATE

API_KEY = "test-key"
CONVO = [{"role": "user", "content": "Name a planet."}, {"role": "assistant", "content": "Mars."},
         {"role": "user", "content": "Name another one."}]
SYSTEM = "You are a terse assistant."
GREEDY = {"temperature": 0}     # (this SDK's create() has no temperature argument: newer models take none)
UNIT = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                         "required": ["unit"], "additionalProperties": False}}


def _engine():
    from pagedserve import EngineArgs, LLMEngine
    # float32: the greedy texts compared below run with different prefix-cache hits (see test_server.py)
    return LLMEngine(EngineArgs(num_kv_blocks=300, max_num_seqs=8, dtype="float32"))


@pytest.fixture(scope="module")
def server():
    """The model's own chat template (it does not render tools), an API key, no tool-call parser."""
    from pagedserve.entrypoints.server import build_app
    app = build_app(_engine(), api_key=API_KEY, dashboard=False, served_model_name=["SmolLM2-135M-Instruct", "m"])
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tool_client():
    """A template that renders tools and the hermes parser (--enable-auto-tool-choice --tool-call-parser hermes)."""
    from pagedserve.entrypoints.server import build_app
    app = build_app(_engine(), chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes", dashboard=False,
                    served_model_name="m")
    with serve_in_thread(app) as base:
        yield anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)


def test_create_equals_chat_completions_greedy(server, client):
    m = client.messages.create(model="m", max_tokens=12, extra_body=GREEDY, system=SYSTEM, messages=CONVO,
                               metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == "SmolLM2-135M-Instruct"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    chat = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                      json={"messages": [{"role": "system", "content": SYSTEM}] + CONVO, "max_tokens": 12,
                            "temperature": 0}).json()
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat["usage"]["prompt_tokens"],
                                                             chat["usage"]["completion_tokens"])
    # system as text blocks, content as text blocks: the same prompt
    blocks = client.messages.create(model="m", max_tokens=12, extra_body=GREEDY,
                                    system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
                                    messages=[{"role": c["role"], "content": [{"type": "text", "text": c["content"]}]}
                                              for c in CONVO])
    assert blocks.content == m.content and blocks.usage.input_tokens == m.usage.input_tokens
    # a final assistant turn is continued (prefill), not answered
    prefill = client.messages.create(model="m", max_tokens=4, extra_body=GREEDY, system=SYSTEM,
                                     messages=CONVO + [{"role": "assistant", "content": "Sure: Jupiter"}])
    assert prefill.content[0].type == "text"
    assert m.usage.input_tokens < prefill.usage.input_tokens < m.usage.input_tokens + 8


def test_max_tokens_and_stop_sequence(client):
    kw = dict(model="m", extra_body=GREEDY,
              messages=[{"role": "user", "content": "Write a sentence about the sea."}])
    cut = client.messages.create(max_tokens=3, **kw)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    text = client.messages.create(max_tokens=16, **kw).content[0].text
    stop = text.split()[2]
    s = client.messages.create(max_tokens=16, stop_sequences=[stop, "zzqx"], **kw)
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop
    assert stop not in s.content[0].text and text.startswith(s.content[0].text)


def test_stream_events_and_final_message_equal_create(client):
    kw = dict(model="m", max_tokens=10, extra_body=GREEDY, system=SYSTEM, messages=CONVO)
    full = client.messages.create(**kw)
    raw = [e.type for e in client.messages.create(stream=True, **kw)]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == ["content_block_stop",
                                                                                 "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == full.content[0].text
    # (the stream helper's blocks are ParsedTextBlocks: compared as what the wire carried)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in full.content]
    assert final.stop_reason == full.stop_reason and final.stop_sequence == full.stop_sequence
    assert (final.usage.input_tokens, final.usage.output_tokens) == (full.usage.input_tokens,
                                                                     full.usage.output_tokens)
    # a cut stream says so in message_delta
    with client.messages.stream(**kw | {"max_tokens": 2}) as s:
        assert s.get_final_message().stop_reason == "max_tokens"


def test_count_tokens(client):
    kw = dict(model="m", system=SYSTEM, messages=CONVO)
    n = client.messages.count_tokens(**kw).input_tokens
    assert n == client.messages.create(max_tokens=1, **kw).usage.input_tokens and n > 10


def test_named_tool_then_tool_result(client):
    """tool_choice `tool` constrains the output to the tool's input (no parser needed); the call and its
    result go back as the next turn's tool_use / tool_result blocks."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model="m", max_tokens=24, extra_body=GREEDY, messages=ask, tools=[UNIT],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and call.input["unit"] in ("celsius",
                                                                                                  "fahrenheit")
    with client.messages.stream(model="m", max_tokens=24, extra_body=GREEDY, messages=ask, tools=[UNIT],
                                tool_choice={"type": "any"}) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert kinds == ["input_json_delta"] and streamed.stop_reason == "tool_use"
    assert streamed.content[0].input == call.input
    turn = ask + [{"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                    call.model_dump(include={"type", "id", "name", "input"})]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": [{"type": "text", "text": "18 degrees, sunny"}]},
                                               {"type": "text", "text": "Thanks."}]}]
    after = client.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=turn, tools=[UNIT])
    assert after.content[0].type == "text" and after.stop_reason in ("end_turn", "max_tokens")
    errored = turn[:-1] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_unknown",
                                                         "content": "timeout", "is_error": True}]}]
    assert client.messages.create(model="m", max_tokens=4, messages=errored).content[0].type == "text"


def test_auto_tools_without_parser_are_text(client):
    m = client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "Weather in Paris?"}],
                               tools=[UNIT])
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text"


def test_tools_reach_the_template_with_the_parser(tool_client):
    kw = dict(model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    plain = tool_client.messages.count_tokens(**kw).input_tokens
    with_tools = tool_client.messages.count_tokens(tools=[UNIT], **kw).input_tokens
    assert with_tools > plain + 20
    assert tool_client.messages.count_tokens(tools=[UNIT], tool_choice={"type": "none"}, **kw).input_tokens == plain
    m = tool_client.messages.create(max_tokens=16, tools=[UNIT], tool_choice={"type": "auto"}, **kw)
    assert m.usage.input_tokens == with_tools
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body,field", [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"model": "m", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x"}]}]},
     "messages[0].content[0].type"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": "not an object"}]}]}, "messages[0].content[0].input"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [UNIT],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "system": [{"type": "x"}]},
     "system[0].type"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "bogus": 1}, "bogus"),
])
def test_bad_input_is_an_anthropic_400_naming_the_field(server, client, body, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body=body, cast_to=object)
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    assert e.value.api_message.startswith(field), e.value.api_message
    raw = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": API_KEY}).json()
    assert raw["type"] == "error" and set(raw["error"]) == {"type", "message"}


def test_api_key_headers(server, client):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.count_tokens(
            model="m", messages=CONVO)
    assert e.value.type == "authentication_error"
    body = {"model": "m", "messages": CONVO}
    assert httpx.post(server + "/v1/messages/count_tokens", json=body, headers={"x-api-key": API_KEY}).status_code \
        == 200
    assert httpx.post(server + "/v1/messages/count_tokens", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    # the OpenAI routes keep OpenAI's error shape
    r = httpx.post(server + "/v1/chat/completions", json={"messages": CONVO})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and "type" not in r.json()
