"""/v1/responses through the openai SDK itself (`responses.create`, `.stream`, `.parse`, `.retrieve`,
`.delete`): the same greedy tokens as /v1/chat/completions on the same conversation, the stream the
SDK's own accumulator accepts, tool calls and their outputs, structured outputs, the bounded store,
and every malformed item a 4xx naming it."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.entrypoints.helpers import serve_in_thread
from tests.entrypoints.test_clients import idle

WEATHER = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=600, max_num_seqs=16, dtype="float32"))
    with serve_in_thread(build_app(engine, served_model_name="m")) as base:
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def _chat(client, messages, n=24) -> str:
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0)
    return r.choices[0].message.content


def test_a_conversation_equals_chat_completions(client, server):
    """instructions + input, then previous_response_id: the same tokens chat completions gives for the
    explicit message list (instructions are not carried into the second turn, as OpenAI's API does)."""
    first = client.responses.create(model="m", instructions="Answer in one sentence.", input="Name a big river.",
                                    max_output_tokens=24, temperature=0)
    assert first.object == "response" and first.output[0].type == "message"
    assert first.output_text == _chat(client, [{"role": "system", "content": "Answer in one sentence."},
                                               {"role": "user", "content": "Name a big river."}])
    second = client.responses.create(model="m", input=[{"role": "user", "content": "And a long one?"}],
                                     previous_response_id=first.id, max_output_tokens=24, temperature=0)
    assert second.output_text == _chat(client, [{"role": "user", "content": "Name a big river."},
                                                {"role": "assistant", "content": first.output_text},
                                                {"role": "user", "content": "And a long one?"}])
    assert second.previous_response_id == first.id
    u = second.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens <= 24
    assert u.input_tokens > first.usage.input_tokens - 10                # the first turn is in the prompt
    assert idle(server[1])


def test_stream_is_what_the_sdk_accumulates(client, server):
    """Lifecycle first and last, increasing sequence numbers, text deltas that add up to the final
    text, and the SDK's get_final_response equal to the non-streamed response's text."""
    whole = client.responses.create(model="m", input="Tell me about the sea.", max_output_tokens=20, temperature=0)
    with client.responses.stream(model="m", input="Tell me about the sea.", max_output_tokens=20,
                                 temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert final.status == whole.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 20
    with httpx.stream("POST", server[0] + "/v1/responses", json={"model": "m", "input": "Hi", "stream": True,
                                                                  "max_output_tokens": 4}) as r:
        lines = list(r.iter_lines())
    named = [ln[7:] for ln in lines if ln.startswith("event: ")]
    assert named[0] == "response.created" and named[-1] == "response.completed"     # `event:` lines, as OpenAI's
    assert idle(server[1])


def test_parse_with_a_pydantic_model(client):
    class City(BaseModel):
        name: str
        country: str
    r = client.responses.parse(model="m", input="A city as JSON.", text_format=City, max_output_tokens=120,
                               temperature=0)
    assert isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema"


def test_tool_call_and_its_output(client, server):
    """tool_choice required -> a function_call item whose arguments validate; its output sent back as
    a function_call_output item continues the stored conversation (the model sees the tool's answer:
    the same tokens as chat completions with the assistant call and the tool message)."""
    r = client.responses.create(model="m", input="What is the weather in Paris?", tools=WEATHER,
                                tool_choice="required", max_output_tokens=40, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    follow = client.responses.create(model="m", previous_response_id=r.id, max_output_tokens=16, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny, 21 C"}])
    call_msgs = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in calls]
    want = client.chat.completions.create(model="m", max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": call_msgs},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"}])
    assert follow.output_text == want.choices[0].message.content
    with client.responses.stream(model="m", input="Weather in Rome?", tools=WEATHER, max_output_tokens=40,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert final.output[0].type == "function_call" and "city" in json.loads(final.output[0].arguments)
    assert idle(server[1])


def test_store_retrieve_delete(client):
    r = client.responses.create(model="m", input="Hello", max_output_tokens=4)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept = client.responses.create(model="m", input="Hello", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="m", input="Hi", previous_response_id=kept.id, max_output_tokens=4)


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [3]}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": WEATHER}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "n": 2}, "n"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server[0] + "/v1/responses", json={"model": "m", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert idle(server[1])


def test_store_is_bounded_by_count_and_bytes():
    from pagedserve.entrypoints.responses_api import ResponseStore
    s = ResponseStore(max_items=3, max_bytes=2000)
    for i in range(5):
        s.put({"id": f"r{i}", "text": "x" * 10}, [{"role": "user", "content": "y"}])
    assert len(s) == 3 and s.get("r0") is None and s.get("r4") is not None
    s.put({"id": "big", "text": "x" * 900}, [])
    s.put({"id": "big2", "text": "x" * 900}, [])
    assert s.bytes <= 2000 and s.get("big2") is not None and s.get("r2") is None
    s.put({"id": "huge", "text": "x" * 5000}, [])                 # larger than the store: not kept
    assert s.get("huge") is None and s.get("big2") is not None
    assert s.delete("big2") and not s.delete("big2")


def test_reasoning_becomes_a_reasoning_item():
    """With --reasoning-parser, <think>...</think> is a `reasoning` item before the message."""
    from types import SimpleNamespace

    from pagedserve.entrypoints.responses_api import _items
    st = SimpleNamespace(reasoning_parser="qwen3")
    items, message = _items(st, None, "none", "<think>the user wants a city</think>Paris")
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "the user wants a city" and items[1]["content"][0]["text"] == "Paris"
    assert message == {"role": "assistant", "content": "Paris"}
