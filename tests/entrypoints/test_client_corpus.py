"""The request bodies real clients send (tests/entrypoints/client_corpus/*.json), replayed over HTTP
against the server: every one a 200 whose body the openai SDK's own response types accept (LangChain
and LiteLLM parse through them), and nothing left running. The LangChain and LiteLLM files were
captured from the clients themselves (client_corpus/capture.py); vllm bench serve's, guidellm's and
Open WebUI's were written from their sources (each file names its client and version). lm-evaluation-
harness runs itself in test_lm_eval.py, the openai SDK in test_clients.py and test_responses_api.py."""
from __future__ import annotations

import asyncio
import glob
import json
import os

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.entrypoints.helpers import serve_in_thread
from tests.entrypoints.test_clients import TOOLS_TEMPLATE, idle

CORPUS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "client_corpus", "*.json")))
CASES = {os.path.basename(p)[:-5]: json.load(open(p)) for p in CORPUS}


@pytest.fixture(scope="module")
def replies():
    """Every corpus request sent at once (the engine batches them), as the clients configured for
    tools expect: auto tool choice on (hermes parser, a template that renders tools). Bodies without
    max_tokens run to the end of a short context."""
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=1200, max_num_seqs=32, max_model_len=300, dtype="float32"))
    # the names the clients were configured with, served as aliases (an unknown `model` is a 404)
    names = sorted({c["body"]["model"] for c in CASES.values() if c["body"].get("model")})
    app = build_app(engine, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes", served_model_name=names)

    async def send(base, case):
        async with httpx.AsyncClient(timeout=300) as c:
            if case["body"].get("stream"):
                async with c.stream("POST", base + case["path"], json=case["body"], headers=case["headers"]) as r:
                    return r.status_code, [ln async for ln in r.aiter_lines()]
            r = await c.post(base + case["path"], json=case["body"], headers=case["headers"])
            return r.status_code, r.text

    async def all_of(base):
        got = await asyncio.gather(*(send(base, c) for c in CASES.values()))
        return dict(zip(CASES, got))

    with serve_in_thread(app) as base:
        out = asyncio.run(all_of(base))
        assert idle(engine), "a replayed request left something running or a block held"
    return out


def test_corpus_covers_the_clients():
    clients = {c["client"].split()[0] for c in CASES.values()}
    assert {"langchain-openai", "litellm", "vllm", "guidellm", "open-webui"} <= clients, clients


@pytest.mark.parametrize("name", list(CASES))
def test_client_request_is_served(replies, name):
    case = CASES[name]
    status, body = replies[name]
    assert status == 200, f"{case['client']}: {body if isinstance(body, str) else body[:3]}"
    chat = case["path"].endswith("chat/completions")
    if not case["body"].get("stream"):
        (ChatCompletion if chat else Completion).model_validate_json(body)
        return
    data = [ln[6:] for ln in body if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks and not any("error" in c for c in chunks), chunks[-1]
    for c in chunks:
        if chat:
            ChatCompletionChunk.model_validate(c)
        else:       # the SDK streams completions as Completion, unvalidated: finish_reason is null until the end
            Completion.model_validate(c | {"choices": [ch | {"finish_reason": ch["finish_reason"] or "stop"}
                                                       for ch in c["choices"]]})
    usage_wanted = (case["body"].get("stream_options") or {}).get("include_usage")
    assert bool(chunks[-1].get("usage")) == bool(usage_wanted)
