"""The server over real HTTP on a loopback port, driven by the official openai SDK."""
import asyncio
import time

import httpx
import openai
import pytest

from tests.entrypoints.helpers import serve_in_thread

API_KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    # float32: tests below compare greedy texts of repeated prompts, which hit the prefix cache and so run
    # fewer prefill rows; bf16 GEMMs round differently with the row count (float32 ones do not here)
    engine = LLMEngine(EngineArgs(num_kv_blocks=600, max_waiting_requests=40, max_num_seqs=32, dtype="float32"))
    app = build_app(engine, api_key=API_KEY, max_body_bytes=200_000, served_model_name=["SmolLM2-135M-Instruct", "m"])
    with serve_in_thread(app) as base:
        yield base, engine, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def wait_idle(engine, timeout=10.0):
    t = time.time()
    while time.time() - t < timeout:
        if not engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False


def metric(base, name, labels=""):
    text = httpx.get(base + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return None


def test_models_and_health(server, client):
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


# ---------------------------------------------------------------- `model`: served names, aliases, unknown names
MSGS = [{"role": "user", "content": "Hi"}]
MODEL_ROUTES = [("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "stream": True}),
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True}),
                ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
                ("/v1/embeddings", {"input": "Hi"}),
                ("/tokenize", {"prompt": "Hi"}),
                ("/detokenize", {"tokens": [1, 2]})]


@pytest.mark.parametrize("path,body", MODEL_ROUTES, ids=[p + (" stream" if b.get("stream") else "")
                                                         for p, b in MODEL_ROUTES])
def test_unknown_model_is_a_404_model_not_found_listing_the_served_names(server, path, body):
    """As OpenAI answers (invalid_request_error, code model_not_found, param model) and vLLM refuses:
    before anything is admitted, and before the body's values are checked against the model (an `n` over
    max_num_seqs); a body that does not parse is still a 400 first."""
    base, engine, _ = server
    for extra in ({}, {"n": 1000} if path in ("/v1/chat/completions", "/v1/completions") else {}):
        r = httpx.post(base + path, json=body | extra | {"model": "gpt-4o"},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found" and err["param"] == "model"
        assert "`gpt-4o` does not exist" in err["message"] and "SmolLM2-135M-Instruct, m" in err["message"]
    assert wait_idle(engine)
    held = httpx.get(base + "/debug/scheduler", headers={"Authorization": f"Bearer {API_KEY}"}).json()["held"]
    assert all(v == 0 for v in held.values()), held


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_unknown_model_on_the_messages_api_is_anthropics_404(server, path):
    base, engine, _ = server
    r = httpx.post(base + path, json={"model": "claude-opus-4", "max_tokens": 2, "messages": MSGS},
                   headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 404, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "`claude-opus-4` does not exist" in body["error"]["message"]
    assert "SmolLM2-135M-Instruct, m" in body["error"]["message"]
    assert wait_idle(engine)


def test_unknown_model_with_the_openai_sdk(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="Hi")


def test_aliases_each_serve_the_model_and_responses_name_the_first(server, client):
    """--served-model-name A B: both are the model (the same greedy text), /v1/models lists both in
    order, responses report the first. An omitted or empty `model` is the served model too (OpenAI
    requires the field; pagedserve, as vLLM, never has)."""
    base, engine, _ = server
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct", "m"]
    texts = set()
    for name in ("SmolLM2-135M-Instruct", "m"):
        r = client.completions.create(model=name, prompt="The sky is", max_tokens=4, temperature=0)
        assert r.model == "SmolLM2-135M-Instruct"
        texts.add(r.choices[0].text)
        c = client.chat.completions.create(model=name, messages=MSGS, max_tokens=2)
        assert c.model == "SmolLM2-135M-Instruct"
        stream = client.chat.completions.create(model=name, messages=MSGS, max_tokens=2, stream=True)
        assert {ch.model for ch in stream} == {"SmolLM2-135M-Instruct"}
        m = httpx.post(base + "/v1/messages", json={"model": name, "max_tokens": 2, "messages": MSGS},
                       headers={"x-api-key": API_KEY}).json()
        assert m["model"] == "SmolLM2-135M-Instruct"
    assert len(texts) == 1
    for body in ({}, {"model": ""}):
        r = httpx.post(base + "/v1/completions", json={"prompt": "The sky is", "max_tokens": 4, "temperature": 0}
                       | body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and r.json()["model"] == "SmolLM2-135M-Instruct"
        assert r.json()["choices"][0]["text"] in texts
    assert wait_idle(engine)


def test_served_model_name_takes_several_names():
    """The CLI's --served-model-name NAME [NAME ...] (vLLM's); build_app takes a str or a list."""
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.server_state import served_names
    ns = build_parser(only="serve").parse_args(["serve", "--served-model-name", "a", "b"])
    assert ns.served_model_name == ["a", "b"]
    assert build_parser(only="serve").parse_args(["serve"]).served_model_name is None
    assert served_names(None, "dflt") == ("dflt",) and served_names("x", "dflt") == ("x",)
    assert served_names(["a", "b", "a"], "dflt") == ("a", "b")
    with pytest.raises(ValueError, match="served_model_name"):
        served_names(["a", " "], "dflt")


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="m", prompt="The three primary colours are", max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and len(full.choices[0].text) > 0
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_chat_stream_equals_non_stream(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "Name two planets."}], max_tokens=30, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert full.choices[0].finish_reason in ("stop", "length")


def test_n2_stop_and_logprobs(client):
    r = client.completions.create(model="m", prompt="Once upon a time", max_tokens=10, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 20
    base = client.completions.create(model="m", prompt="Once upon a time", max_tokens=16, temperature=0)
    words = base.choices[0].text.split()
    stop = words[2]
    s = client.completions.create(model="m", prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop])
    assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
    assert base.choices[0].text.startswith(s.choices[0].text)
    lp = client.completions.create(model="m", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    l = lp.choices[0].logprobs
    assert len(l.tokens) == len(l.token_logprobs) == 6 == lp.usage.completion_tokens
    assert "".join(l.tokens) == lp.choices[0].text
    for tok_lp, tops in zip(l.token_logprobs, l.top_logprobs):
        assert tok_lp <= 0 and abs(max(tops.values()) - tok_lp) < 1e-5     # greedy: the chosen one is the top
    c = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens
    assert all(len(x.top_logprobs) == 3 for x in c.choices[0].logprobs.content)


def test_usage_exact_and_cached_tokens(client, server):
    long = "Paged attention keeps the KV cache in fixed-size blocks. " * 8
    a = client.completions.create(model="m", prompt=long, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model="m", prompt=long, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    tok = server[1].tokenizer
    assert a.usage.prompt_tokens == len(tok(long)["input_ids"]) and a.usage.completion_tokens == 3
    assert b.usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_follow_requests(server, client):
    base, engine, _ = server
    assert wait_idle(engine)
    ttft0 = metric(base, "pagedserve:time_to_first_token_seconds_count") or 0
    gen0 = metric(base, "pagedserve:generation_tokens_total") or 0
    n_tok = 0
    for i in range(3):
        r = client.completions.create(model="m", prompt=f"Count to {i + 3}:", max_tokens=5 + i, temperature=0,
                                      extra_body={"ignore_eos": True})
        n_tok += r.usage.completion_tokens
    assert wait_idle(engine)
    time.sleep(0.1)
    assert metric(base, "pagedserve:time_to_first_token_seconds_count") - ttft0 == 3
    assert metric(base, "pagedserve:generation_tokens_total") - gen0 == n_tok
    assert metric(base, "pagedserve:num_requests_running") == 0
    assert metric(base, "pagedserve:num_requests_waiting") == 0
    assert metric(base, "pagedserve:kv_cache_usage_perc") == 0.0
    assert metric(base, "pagedserve:max_num_seqs") == 32
    assert metric(base, "pagedserve:kv_blocks_total") == 599
    dbg = httpx.get(base + "/debug/scheduler", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert dbg["running"] == [] and dbg["kv"]["blocks_free"] == 599


def test_streams_reach_the_latency_histograms(server, client):
    """A stream's outputs are deltas: every gap between a choice's tokens is an ITL sample (each of n = 2
    choices), every finished request a TPOT sample per choice, streamed or not; TTFT once a request."""
    base, engine, _ = server
    assert wait_idle(engine)
    names = ("inter_token_latency_seconds", "time_per_output_token_seconds", "time_to_first_token_seconds")
    before = [metric(base, f"pagedserve:{n}_count") or 0 for n in names]
    for _ in range(2):
        chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=6, stream=True, temperature=0,
                                                     extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
    list(client.completions.create(model="m", prompt="Once upon", max_tokens=5, n=2, stream=True, temperature=0.8,
                                   seed=1, extra_body={"ignore_eos": True}))
    client.completions.create(model="m", prompt="Once upon", max_tokens=4, extra_body={"ignore_eos": True})
    assert wait_idle(engine)
    time.sleep(0.1)
    itl, tpot, ttft = (metric(base, f"pagedserve:{n}_count") - b for n, b in zip(names, before))
    assert itl == 2 * 5 + 2 * 4          # the streams' gaps; the last request was not streamed: no gaps seen
    assert tpot == 2 + 2 + 1 and ttft == 4


def test_disconnect_mid_stream_frees_blocks(server):
    base, engine, _ = server
    assert wait_idle(engine)
    free0 = engine.core.kv.num_free_blocks
    with httpx.stream("POST", base + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "Write a very long essay about the ocean.", "max_tokens": 2000,
                            "ignore_eos": True, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) >= 3:
                break
        assert engine.has_unfinished_requests(), lines
    t = time.time()
    while engine.has_unfinished_requests() and time.time() - t < 1.0:
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.core.kv.num_free_blocks == free0


def test_disconnect_non_stream_aborts(server):
    base, engine, _ = server
    assert wait_idle(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True}, timeout=0.5)
    assert wait_idle(engine, timeout=2.0)


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"prompt": "x", "guided_regex": "[0-9"}, "guided_regex"),
    ({"prompt": "x", "guided_json": {"type": "nope"}}, "guided_json"),
    ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
])
def test_bad_fields_give_400_naming_them(server, body, field):
    r = httpx.post(server[0] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["code"] is None


def test_prompt_over_max_model_len_and_malformed_and_oversized(server):
    base, engine, _ = server
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(base + "/v1/completions", json={"prompt": [5] * 100, "max_tokens": 10 ** 5}, headers=h)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers=h | {"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", content=b"x" * 300_000, headers=h | {"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(base + "/v1/chat/completions", json={"messages": []}, headers=h)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200        # still serving


def test_wrong_or_missing_key_is_401(server):
    base = server[0]
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="x", max_tokens=1)


def test_503_when_waiting_queue_full(server):
    base, engine, _ = server
    assert wait_idle(engine)

    async def go():
        async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            reqs = [c.post(base + "/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 40,
                                                          "ignore_eos": True}) for i in range(90)]
            return await asyncio.gather(*reqs)
    codes = [r.status_code for r in asyncio.run(go())]
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
    assert wait_idle(engine, timeout=60)
    assert engine.core.kv.num_free_blocks == engine.core.kv.pool.num_usable_blocks


def test_32_concurrent_streams(server):
    base, engine, _ = server
    assert wait_idle(engine)
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0)

    async def one(i):
        n = 8 + i % 9
        stream = await client.completions.create(model="m", prompt=f"Item {i}:", max_tokens=n, stream=True,
                                                 temperature=0, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        usage = None
        async for c in stream:
            if c.usage:
                usage = c.usage
        return n, usage.completion_tokens

    async def all_():
        return await asyncio.gather(*(one(i) for i in range(32)))
    res = asyncio.run(all_())
    assert all(n == got for n, got in res)
    assert wait_idle(engine)


def test_streamed_logprobs_cover_every_token(client):
    """Deltas whose text is still empty (part of a multi-byte character) carry their tokens into the
    next chunk: a stream's logprobs list every generated token once."""
    kw = dict(model="m", prompt="Write the word 'café' and an emoji: ", max_tokens=24, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    toks = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(toks) == full.usage.completion_tokens == 24
    assert toks == full.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_without_traffic_classes_a_named_class_is_a_400_and_the_header_is_ignored(server):
    base = server[0]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "traffic_class": "batch"},
                   headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "traffic_class"
    assert "--traffic-classes" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={**auth, "X-Traffic-Class": "batch"}, timeout=30)
    assert r.status_code == 200
