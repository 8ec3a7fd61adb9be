"""Hostile input, table-driven: each one is a 4xx in OpenAI's error JSON, and the server answers the
next well-formed request as if nothing happened."""
import json

import httpx
import pytest

from tests.entrypoints.helpers import serve_in_thread

KEY = "k"
H = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


# (name, path, body: dict -> JSON, bytes -> raw, expected status, field the error must name or None)
CASES = [
    ("nan", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("infinity", C, b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("huge float", C, b'{"prompt": "x", "top_p": 1e999}', 400, "top_p"),
    ("negative max_tokens", C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("negative n", C, {"prompt": "x", "n": -3}, 400, "n"),
    ("negative temperature", CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    ("huge n", C, {"prompt": "x", "n": 1000}, 400, "n"),
    ("n beyond max_num_seqs", CHAT, {"messages": MSG, "n": 9}, 400, "n"),
    ("huge logprobs", C, {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("huge top_logprobs", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("huge max_tokens", C, {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_tokens past context", C, {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ("seed 2**64", C, {"prompt": "Hello", "max_tokens": 4, "seed": 2**64}, 400, "seed"),
    ("top_k 2**63", C, {"prompt": "x", "top_k": 2**63}, 400, "top_k"),
    ("10k stop strings", C, {"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}, 400, "stop"),
    ("long stop string", C, {"prompt": "x", "stop": ["y" * 5000]}, 400, "stop"),
    ("1M-character prompt", C, {"prompt": "word " * 200_000, "max_tokens": 1}, 400, "prompt"),  # over the context
    ("empty prompt", C, {"prompt": "", "max_tokens": 1}, 400, "prompt"),
    ("empty token list", C, {"prompt": [], "max_tokens": 1}, 400, "prompt"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("wrong role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages"),
    ("lone surrogate prompt", C, b'{"prompt": "abc \\ud800 def", "max_tokens": 2}', 400, "prompt"),
    ("lone surrogate chat", CHAT, b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', 400, "messages"),
    ("lone surrogate stop", C, b'{"prompt": "x", "stop": ["\\ud83d"]}', 400, "stop"),
    ("out-of-vocabulary id", C, {"prompt": [49152], "max_tokens": 1}, 400, "prompt"),
    ("negative token id", C, {"prompt": [5, -1], "max_tokens": 1}, 400, "prompt"),
    ("stop_token_ids out of vocabulary", C, {"prompt": "x", "stop_token_ids": [10**12]}, 400, "stop_token_ids"),
    ("not JSON", C, b"this is not json", 400, None),
    ("JSON array body", C, b"[1, 2, 3]", 400, None),
    ("deeply nested JSON", C, nested(100_000), 400, None),
    ("wrong type", C, {"prompt": {"a": 1}}, 400, "prompt"),
    ("wrong types", C, {"prompt": "x", "max_tokens": "x", "n": "y"}, 400, None),
    ("unknown route", "/v1/nothing", {"prompt": "x"}, 404, None),
]


@pytest.fixture(scope="module")
def base():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=300, max_num_seqs=8, max_model_len=512))
    app = build_app(engine, api_key=KEY)
    with serve_in_thread(app) as url:
        yield url
    assert not engine.has_unfinished_requests()
    assert all(b.ref_cnt == 0 for b in engine.core.kv.pool.blocks[1:])


@pytest.mark.parametrize("name,path,body,status,field", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_a_clear_4xx(base, name, path, body, status, field):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + path, content=content, headers=H, timeout=60)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    # OpenAI's string code where it has one (a prompt over the context), else null (never the status)
    assert err["code"] == ("context_length_exceeded" if name == "1M-character prompt" else None) and err["message"]
    if field is not None:
        assert err["param"] == field or err["param"].startswith(field), err
    ok = httpx.post(base + C, headers=H, json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_wrong_content_type_and_method(base):
    r = httpx.post(base + C, content=b"prompt=x", headers={"Authorization": f"Bearer {KEY}",
                                                          "content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.get(base + C, headers=H)
    assert r.status_code == 405 and r.json()["error"]["code"] is None
