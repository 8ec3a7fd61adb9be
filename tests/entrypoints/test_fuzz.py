"""Schemathesis against the server's own OpenAPI schema, over real HTTP: valid and invalid bodies
for every operation, a bounded number of examples each. No response may be a 5xx; every 4xx
carries OpenAI's error JSON (Anthropic's on /v1/messages)."""
import collections

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from pagedserve.entrypoints.dashboard import router as dashboard_router
from pagedserve.entrypoints.routes import router
from tests.entrypoints.helpers import serve_in_thread

KEY = "k"
MODEL = "m"         # the served name: the schema's `model` (valid bodies name it; any other name is a 404)
EXAMPLES = collections.Counter()


def _spec() -> dict:
    app = FastAPI(title="pagedserve")     # the same routes, without an engine: only the schema is needed
    app.include_router(router)
    app.include_router(dashboard_router)
    spec = app.openapi()
    for s in spec["components"]["schemas"].values():
        if "model" in s.get("properties", {}):
            s["properties"]["model"] = {"anyOf": [{"type": "string", "enum": [MODEL]}, {"type": "null"}]}
    return spec


schema = schemathesis.openapi.from_dict(_spec())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=25,
                                deterministic=True)


@pytest.fixture(scope="module")
def base():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    # a short context and a request timeout bound the work one generated request can ask for
    engine = LLMEngine(EngineArgs(num_kv_blocks=128, max_num_seqs=4, max_model_len=48))
    app = build_app(engine, api_key=KEY, request_timeout_s=5.0, served_model_name=MODEL)
    with serve_in_thread(app) as url:
        yield url
    assert not engine.has_unfinished_requests()
    assert all(b.ref_cnt == 0 for b in engine.core.kv.pool.blocks[1:])


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_and_errors_are_openai_json(base, case):
    r = case.call(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    EXAMPLES[f"{case.method} {case.path}"] += 1
    assert r.status_code < 500, (case.body, r.text[:300])
    if r.status_code >= 400 and case.path.startswith("/v1/messages"):
        body = r.json()
        assert body["type"] == "error" and body["error"]["message"] and body["error"]["type"]
    elif r.status_code >= 400:
        err = r.json()["error"]
        # OpenAI's code is a string or null, never the HTTP status (its OpenAPI document)
        codes = (None, "context_length_exceeded") + (("model_not_found",) if r.status_code == 404 else ())
        assert err["message"] and err["code"] in codes and "type" in err


def test_fuzzer_ran_enough_examples():
    """Runs after the parametrized test (same module, declaration order)."""
    print(f"\nfuzz examples: {sum(EXAMPLES.values())} {dict(EXAMPLES)}")
    assert EXAMPLES["POST /v1/completions"] >= 20 and EXAMPLES["POST /v1/chat/completions"] >= 20
    assert EXAMPLES["POST /v1/responses"] >= 20 and EXAMPLES["POST /v1/embeddings"] >= 20
    assert EXAMPLES["POST /v1/messages"] >= 20 and EXAMPLES["POST /v1/messages/count_tokens"] >= 20
