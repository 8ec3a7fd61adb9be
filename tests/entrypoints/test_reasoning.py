"""--reasoning-parser: <think>...</think> goes to reasoning_content, whole and streamed; a stream's
deltas add up to the whole answer however the text is cut (tags split across chunks included)."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from pagedserve.entrypoints.reasoning import ReasoningStream, split
from tests.entrypoints.helpers import serve_in_thread

THINK_REGEX = "<think>[a-z ]{3,12}</think>[a-z ]{3,12}"     # forces the tags through the real engine


@pytest.fixture(scope="module")
def servers():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=200, dtype="float32"))
    with serve_in_thread(build_app(engine, reasoning_parser="qwen3", dashboard=False, served_model_name="m")) as qwen3:
        yield qwen3


def _chat(base, stream: bool, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "Think, then answer: what is two plus two?"}],
            "max_tokens": 40, "temperature": 0, "stream": stream} | extra
    if not stream:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]
    reasoning, content = "", ""
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    reasoning += c["delta"].get("reasoning_content") or ""
                    content += c["delta"].get("content") or ""
    return {"reasoning_content": reasoning or None, "content": content}


def test_think_block_goes_to_reasoning_content(servers):
    forced = {"structured_outputs": {"regex": THINK_REGEX}}
    whole = _chat(servers, False, **forced)
    assert whole["reasoning_content"] and "<think>" not in whole["reasoning_content"]
    assert whole["content"] and "</think>" not in whole["content"]
    streamed = _chat(servers, True, **forced)
    assert (streamed["reasoning_content"], streamed["content"]) == (whole["reasoning_content"], whole["content"])


def test_output_without_think_is_all_content(servers):
    whole = _chat(servers, False)
    assert whole["reasoning_content"] is None and whole["content"]
    assert _chat(servers, True)["content"] == whole["content"]


@settings(max_examples=200, deadline=None)
@given(parser=st.sampled_from(["qwen3", "deepseek_r1"]),
       text=st.lists(st.sampled_from(["<think>", "</think>", "<", "</th", "ink>", "a", " ", "\n", "b c"]),
                     max_size=12).map("".join),
       cuts=st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_stream_deltas_add_up_to_the_whole(parser, text, cuts):
    stream, r, c, i = ReasoningStream(parser), "", "", 0
    for n in cuts * (len(text) // max(1, sum(cuts)) + 1):
        if i >= len(text):
            break
        dr, dc = stream.feed(text[i:i + n])
        r, c, i = r + dr, c + dc, i + n
    dr, dc = stream.feed(text[i:], final=True)
    whole = split(parser, text)
    assert (r + dr, c + dc) == (whole[0] or "", whole[1])
