"""Traffic classes served: a request picks its class by `traffic_class`, X-Traffic-Class or priority;
an unknown class is a 400 naming the field; the class shows in /debug/scheduler, /debug/state and per
class on /metrics; an interactive request takes a slot from batch work, which still finishes whole."""
import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from tests.entrypoints.helpers import serve_in_thread

CLASSES = [{"name": "interactive", "priority": 0, "ttft_p99_ms": 60000, "itl_p99_ms": 10000},
           {"name": "batch", "priority": 10, "preemption_mode": "swap", "max_waiting": 8}]


@pytest.fixture(scope="module")
def server():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=300, max_num_seqs=2, traffic_classes=json.dumps(CLASSES)))
    app = build_app(engine, served_model_name="m")
    with serve_in_thread(app) as base:
        yield base, engine


def metric(base, name, labels):
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return None


def test_an_unknown_class_is_a_400_naming_the_field(server):
    base, engine = server
    for kw in ({"json": {"prompt": "hi", "max_tokens": 2, "traffic_class": "bulk"}},
               {"json": {"prompt": "hi", "max_tokens": 2}, "headers": {"X-Traffic-Class": "bulk"}}):
        r = httpx.post(base + "/v1/completions", timeout=30, **kw)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "traffic_class" and "'bulk'" in err["message"] and "interactive, batch" in err["message"]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "traffic_class": 7}, timeout=30)
    assert r.status_code == 400 and "traffic_class" in r.text
    assert not engine.has_unfinished_requests() and all(v == 0 for v in engine.held().values())


def test_each_way_of_naming_a_class_is_counted_under_it(server):
    base, _ = server
    name, ttft = "pagedserve:class_request_success_total", "pagedserve:class_time_to_first_token_seconds_count"
    before = {c: metric(base, name, f'{{traffic_class="{c}"}}') for c in ("interactive", "batch")}
    body = {"prompt": "The paged cache", "max_tokens": 3}
    assert httpx.post(base + "/v1/completions", json={**body, "traffic_class": "batch"}, timeout=60).status_code == 200
    assert httpx.post(base + "/v1/completions", json=body, headers={"X-Traffic-Class": "batch"},
                      timeout=60).status_code == 200
    assert httpx.post(base + "/v1/completions", json={**body, "priority": 12}, timeout=60).status_code == 200
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                   extra_body={"traffic_class": "interactive"})
    assert metric(base, name, '{traffic_class="batch"}') == before["batch"] + 3
    assert metric(base, name, '{traffic_class="interactive"}') == before["interactive"] + 1
    assert metric(base, ttft, '{traffic_class="batch"}') >= 3
    assert metric(base, "pagedserve:class_slo_met_total", '{slo="ttft",traffic_class="interactive"}') >= 1


def test_interactive_takes_a_slot_from_batch_which_still_finishes_whole(server):
    """max_num_seqs 2, both held by batch streams: an interactive request preempts one (swap), runs, and
    both batch streams end with every token they asked for."""
    base, engine = server

    def batch(i):
        with httpx.stream("POST", base + "/v1/completions", timeout=120,
                          json={"prompt": f"Batch job {i}: count", "max_tokens": 60, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True},
                                "traffic_class": "batch"}) as s:
            events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        return chunks[-1]["usage"]["completion_tokens"], reasons[-1]

    preempted_before = metric(base, "pagedserve:num_preemptions_total", "")
    with cf.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(batch, i) for i in range(2)]
        deadline = time.time() + 60
        while len(engine.core.scheduler.running) < 2 and time.time() < deadline:
            time.sleep(0.01)
        state = httpx.get(base + "/debug/scheduler").json()
        assert {r["traffic_class"] for r in state["running"]} == {"batch"}
        assert [c["name"] for c in state["traffic_classes"]] == ["interactive", "batch"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "Quick question", "max_tokens": 4,
                                                       "ignore_eos": True, "traffic_class": "interactive"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        results = [f.result(timeout=120) for f in futs]
    assert results == [(60, "length")] * 2
    assert metric(base, "pagedserve:num_preemptions_total", "") >= preempted_before + 1
    snap = httpx.get(base + "/debug/state").json()
    assert [c["name"] for c in snap["health"]["traffic_classes"]] == ["interactive", "batch"]
    assert not engine.has_unfinished_requests() and all(v == 0 for v in engine.held().values())


def test_the_itl_floor_is_a_gauge_per_class_with_a_target_and_in_debug_scheduler(server):
    """Issue 54: pagedserve:class_itl_floor_seconds for each class with an ITL target, from start; once the
    step-time model is fitted (16 steps), /debug/scheduler gives each such class's floor now."""
    base, engine = server
    assert metric(base, "pagedserve:class_itl_floor_seconds", '{traffic_class="interactive"}') >= 0
    assert metric(base, "pagedserve:class_itl_floor_seconds", '{traffic_class="batch"}') is None
    r = httpx.post(base + "/v1/completions", json={"prompt": "Count slowly", "max_tokens": 24, "ignore_eos": True,
                                                   "traffic_class": "interactive"}, timeout=120)
    assert r.status_code == 200 and engine.core.step_cost.count >= 16
    state = httpx.get(base + "/debug/scheduler").json()
    floors = {c["name"]: c["itl_floor_ms"] for c in state["traffic_classes"]}
    assert floors["batch"] is None and floors["interactive"] >= 0
    assert "itl_floor_ms_at_startup" in state["limits"]
    assert metric(base, "pagedserve:class_itl_floor_seconds", '{traffic_class="interactive"}') >= 0
