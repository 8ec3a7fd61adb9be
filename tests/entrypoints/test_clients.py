"""What real clients send, over real HTTP with the openai SDK: several prompts per completion, echo
with prompt logprobs, text offsets, logit bias, the tokenizer endpoints, structured outputs (the SDK's
`parse` with a Pydantic model, nested JSON schemas), tool calls, and unknown fields."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve import SamplingParams
from tests.entrypoints.helpers import serve_in_thread

PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "The sky is"]
TOOLS_TEMPLATE = (  # a chat template that renders tools (SmolLM2's own does not)
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nCall one as <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=800, max_num_seqs=32, dtype="float32"))
    app = build_app(engine, served_model_name="m")
    with serve_in_thread(app) as base:
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def idle(engine, timeout=10.0) -> bool:
    t = time.time()
    while time.time() - t < timeout:
        if not engine.has_unfinished_requests():
            return all(b.ref_cnt == 0 for b in engine.core.kv.pool.blocks[1:])
        time.sleep(0.02)
    return False


# ---------------------------------------------------------------- /v1/completions
def test_multi_prompt_equals_one_by_one(client, server):
    many = client.completions.create(model="m", prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in sorted(many.choices, key=lambda c: c.index)] == list(range(8))
    by_index = {c.index: c.text for c in many.choices}
    for i, p in enumerate(PROMPTS):
        one = client.completions.create(model="m", prompt=p, max_tokens=8, temperature=0)
        assert by_index[2 * i] == by_index[2 * i + 1] == one.choices[0].text
    ids = [server[1].tokenizer(p)["input_ids"] for p in PROMPTS]
    as_ids = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(as_ids.choices, key=lambda c: c.index)] == [by_index[2 * i] for i in range(4)]
    assert many.usage.prompt_tokens == sum(len(x) for x in ids)
    chunks = list(client.completions.create(model="m", prompt=PROMPTS, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {i: by_index[2 * i] for i in range(4)}
    assert chunks[-1].usage.prompt_tokens == many.usage.prompt_tokens


def test_echo_logprobs_equal_offline_prompt_logprobs(client, llm):
    prompt = "Paged attention stores the KV cache in blocks"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    off = llm.generate(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=2), use_tqdm=False)[0]
    P = len(off.prompt_token_ids)
    assert c.text == prompt + off.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == P + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, P):
        assert abs(lp.token_logprobs[p] - off.prompt_logprobs[p][off.prompt_token_ids[p]].logprob) < 1e-4
    for j in range(3):
        t = off.outputs[0].token_ids[j]
        assert abs(lp.token_logprobs[P + j] - off.outputs[0].logprobs[j][t].logprob) < 1e-4
    # text_offset: where each token's text starts in the choice's text
    assert lp.text_offset[0] == 0
    assert all(c.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))


def test_echo_with_max_tokens_0_scores_the_prompt(client, server):
    prompt = "Two plus two is four"
    r = client.completions.create(model="m", prompt=[prompt, "Hello there"], max_tokens=0, echo=True, logprobs=1)
    a, b = sorted(r.choices, key=lambda c: c.index)
    assert a.text == prompt and b.text == "Hello there"
    assert len(a.logprobs.tokens) == len(server[1].tokenizer(prompt)["input_ids"])
    assert a.logprobs.token_logprobs[0] is None and all(x <= 0 for x in a.logprobs.token_logprobs[1:])
    assert r.usage.completion_tokens == 0
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert "".join(ch.text for c in chunks for ch in c.choices) == prompt
    assert idle(server[1])


def test_logit_bias_bans_and_forces(client):
    base = client.completions.create(model="m", prompt="The capital of France is", max_tokens=1, temperature=0,
                                     logprobs=0)
    tok = base.choices[0].logprobs.tokens[0]
    ids = httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize",
                     json={"prompt": tok, "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(model="m", prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != base.choices[0].text
    forced = client.completions.create(model="m", prompt="The capital of France is", max_tokens=2, temperature=0,
                                       logit_bias={"1234": 100})
    assert forced.choices[0].text == 2 * httpx.post(str(client.base_url).replace("/v1/", "") + "/detokenize",
                                                    json={"tokens": [1234]}).json()["prompt"]


# ---------------------------------------------------------------- tokenizer endpoints, models
def test_tokenizer_endpoints_and_models(server, client):
    base, engine = server
    r = httpx.post(base + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == engine.tokenizer("Hello world")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.core.max_model_len and len(r["token_strs"]) == r["count"]
    assert httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    info = httpx.get(base + "/tokenizer_info").json()
    assert info["eos_token"] == engine.tokenizer.eos_token and "im_start" in info["chat_template"]
    bad = httpx.post(base + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    m = client.models.list().data[0]
    assert m.root and m.parent is None and m.max_model_len == engine.core.max_model_len


def test_unknown_fields_are_400_and_ignored_ones_accepted(server, client):
    base = server[0]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 1, "logprob": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob"
    ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                        user="u1", metadata={"a": "b"}, store=False, seed=3)
    assert ok.choices[0].finish_reason == "length"
    ok = client.completions.create(model="m", prompt="x", max_tokens=2, extra_body={
        "stop_token_ids": [2], "include_stop_str_in_output": True, "skip_special_tokens": False})
    assert ok.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- structured outputs
class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    """Bounded lists and strings: a 135M model left free repeats list items until max_tokens."""
    name: str = Field(max_length=20)
    species: str = Field(max_length=20)
    age: int
    colour: Colour
    toys: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)


def test_sdk_parse_with_a_pydantic_model(client):
    subjects = ["a cat", "a dog", "a parrot", "a goldfish", "a hamster", "a rabbit", "a snake", "a horse",
                "a turtle", "a ferret"]

    def one(s):
        return client.beta.chat.completions.parse(
            model="m", messages=[{"role": "user", "content": f"Describe {s} as a pet, in JSON."}],
            response_format=Pet, max_tokens=200, temperature=0)
    with ThreadPoolExecutor(len(subjects)) as pool:        # all at once: one batch, as clients send them
        for r in pool.map(one, subjects):
            assert isinstance(r.choices[0].message.parsed, Pet), r.choices[0].message.content


NESTED = {"type": "object", "additionalProperties": False, "required": ["title", "status", "tags", "author"],
          "properties": {
              "title": {"type": "string", "maxLength": 40},
              "status": {"enum": ["draft", "published", "archived"]},
              "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
              "author": {"type": "object", "additionalProperties": False, "required": ["name", "scores"],
                         "properties": {"name": {"type": "string", "maxLength": 20},
                                        "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}}}}


def test_nested_json_schema_always_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "post", "schema": NESTED}}

    def one(i, temp):
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "A blog post as JSON"}],
                                              response_format=fmt, max_tokens=300, temperature=temp, seed=i, n=2)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4), [0.0, 0.8, 1.0, 1.2]))
    for r in got:
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), NESTED)
    r = client.completions.create(model="m", prompt='A JSON object with a name and an age: {"name": "Bob", "age": 31}. '
                                  'Another one:', max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = client.completions.create(model="m", prompt="Pick:", max_tokens=10, extra_body={"guided_choice": ["x", "y"]})
    assert r.choices[0].text in ("x", "y")


# ---------------------------------------------------------------- tool calls
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["tz"],
    "properties": {"tz": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_and_required_tool_calls(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=150)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), params)
    # the answer to a call goes back as an assistant message with tool_calls and a tool message
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model="m", messages=follow, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls


def test_streamed_tool_calls(client):
    chunks = list(client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], max_tokens=100, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), WEATHER["function"]["parameters"])
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_auto_tool_choice_needs_a_parser(server):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]
    r = httpx.post(server[0] + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                             "tool_choice": {"type": "function",
                                                                             "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_auto_tool_choice_with_hermes_parser():
    """With a parser and a template that renders tools, "auto" is served; the model's <tool_call>
    blocks become tool_calls (the parser itself on a fixed text: the small model rarely calls)."""
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    from pagedserve.entrypoints.tool_calls import parse_hermes
    content, calls = parse_hermes('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                                  '"unit": "celsius"}}</tool_call>')
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert parse_hermes("no call here") == ("no call here", [])
    engine = LLMEngine(EngineArgs(num_kv_blocks=64, dtype="float32"))
    app = build_app(engine, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes", served_model_name="m")
    with serve_in_thread(app) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 8},
                       timeout=30)
        assert r.status_code == 200, r.text
        toks = httpx.post(base + "/tokenize", json={"messages": ASK}).json()
        assert toks["count"] > 0


# ---------------------------------------------------------------- guidellm's exact bodies
# guidellm (src/guidellm/backends/openai/request_handlers.py) always streams with vLLM's
# continuous_usage_stats, sends stop: null and ignore_eos, and reads usage from the chunks.
GUIDELLM_COMPLETION = {"model": "m", "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                       "max_tokens": 12, "stop": None, "ignore_eos": True,
                       "prompt": "The quick brown fox jumps over the lazy dog. " * 8}
GUIDELLM_CHAT = {"model": "m", "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": 12, "stop": None, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text",
                                                            "text": "Tell me about the sea. " * 6}]}]}


def _sse(base: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + route, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("route,body", [("/v1/completions", GUIDELLM_COMPLETION),
                                        ("/v1/chat/completions", GUIDELLM_CHAT)])
def test_guidellm_bodies_get_usage_in_every_chunk(server, route, body):
    base, engine = server
    chunks = _sse(base, route, body)
    assert all("usage" in c for c in chunks), "continuous_usage_stats: usage in every chunk"
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 40
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 12           # running counts, the last one the total
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 12
    # without the extension, usage comes once, at the end (the OpenAI behaviour)
    plain = _sse(base, route, body | {"stream_options": {"include_usage": True}})
    assert [("usage" in c) for c in plain] == [False] * (len(plain) - 1) + [True]
    assert idle(engine)
