"""The live dashboard: /debug/state against the engine's own counters at many points of a run;
/dashboard in headless Chromium (Debian's chromium + chromium-driver, selenium) while a workload
with shared prefixes and a pool small enough to force preemption runs; `pagedserve top` under a
pseudo-terminal."""
from __future__ import annotations

import asyncio
import os
import pty
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.entrypoints.helpers import serve_in_thread

KEY = "dash-key"
H = {"Authorization": f"Bearer {KEY}"}
SHARED = "You are a helpful assistant who answers in one short sentence. " * 3
RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results")


def _serve(model: str | None, num_kv_blocks: int):
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(model=model, num_kv_blocks=num_kv_blocks, block_size=16, max_num_seqs=8,
                                  max_num_batched_tokens=96, long_prefill_token_threshold=48, dtype="float32"))
    app = build_app(engine, api_key=KEY)
    with serve_in_thread(app) as base:
        yield base, engine, app


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer) -> str:
    """A tiny random Llama with the default model's tokenizer: the same prompts make the same blocks,
    sharing and preemption as the default model, in steps of a few ms."""
    from tests.model.helpers import save_random_llama
    return save_random_llama(tmp_path_factory.mktemp("dash-model"), tokenizer)


@pytest.fixture(scope="module")
def served():
    """The default model, for the browser and `pagedserve top`: the page is held to being at most 40 steps
    behind the engine, a bound made for its steps (~0.2 s here with 8 rows; a tiny model's take ~20 ms,
    which would make it a sub-second real-time bound). Its pool is 32 blocks, so BROWSER_WORKLOAD's
    shorter answers still preempt."""
    yield from _serve(None, 32)


@pytest.fixture(scope="module")
def tiny_served(tiny_model):
    """The tiny model behind the same server, for the checks of /debug/state against the engine's own
    counters, which do not depend on the weights: the full workload's ~220 steps in seconds."""
    yield from _serve(tiny_model, 40)


# the browser's workload on `served`: 16 requests of 40 tokens make ~120 steps of which ~40, from step 40
# on, have requests waiting beside shared blocks (what the screenshot waits for), and preempt in the
# 32-block pool (72 tokens in a 40-block pool: ~220 steps, measured 48 s here)
BROWSER_WORKLOAD = dict(n=16, max_tokens=40)


def workload(base: str, n: int = 16, max_tokens: int = 72, stagger_s: float = 0.05) -> threading.Thread:
    """Requests with a shared prefix (prefix-cache sharing), some n=2 (fork sharing), more than the
    pool holds (preemption, waiting with reasons): 16 of 72 tokens overfill a 40-block pool. They start
    `stagger_s` apart, all within a few steps of the default model; on the tiny model 0.05 s is a few
    steps each, and requests spread that thin overfill the pool only some of the time."""
    def one(i):
        body = {"prompt": SHARED + f"Question {i}: what is {i} plus {i}?", "max_tokens": max_tokens,
                "temperature": 0.7, "seed": i, "n": 2 if i % 3 == 0 else 1, "ignore_eos": True}
        httpx.post(base + "/v1/completions", json=body, headers=H, timeout=300)

    def run():
        ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
            time.sleep(stagger_s)
        for t in ts:
            t.join()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def engine_view(app, engine) -> tuple[dict, dict]:
    """A snapshot and the engine's own counters, read in the engine thread at the same moment."""
    from pagedserve.entrypoints.dashboard import snapshot

    def read():
        kv, sch = engine.core.kv, engine.core.scheduler
        return snapshot(engine, app.state.server.recorder), {
            "num_free_blocks": kv.num_free_blocks, "num_cached_blocks": kv.pool.num_cached_blocks(),
            "used": kv.pool.num_usable_blocks - kv.num_free_blocks, "running": len(sch.running),
            "waiting": len(sch.waiting), "usage": kv.usage()}
    return asyncio.run(app.state.aengine.call(read))


def check_against_counters(snap: dict, own: dict) -> None:
    m = snap["summary"]
    assert m["num_free_blocks"] == own["num_free_blocks"] == m["free"] + m["cached"]
    assert m["used"] == own["used"] and m["num_cached_blocks"] == own["num_cached_blocks"]
    assert m["running"] == own["running"] and m["waiting"] == own["waiting"]
    assert abs(m["kv_usage"] - own["usage"]) < 1e-4
    assert len(snap["blocks"]["state"]) == snap["config"]["num_blocks"]
    assert sum(1 for r in snap["requests"] if r["queue"] == "running") == own["running"]
    used = {b for r in snap["requests"] for b in r["blocks"]}
    assert used == {i for i, st in enumerate(snap["blocks"]["state"]) if st == 2}
    for b, owners in snap["blocks"]["owners"].items():     # a block's refcount = the tables holding it
        assert snap["blocks"]["ref"][int(b)] == len(owners)
    for r in snap["requests"]:
        if r["queue"] != "running":
            assert r["reason"]


def test_debug_state_matches_the_engine_counters(tiny_served):
    base, engine, app = tiny_served
    assert httpx.get(base + "/debug/state").status_code == 401         # --api-key protects it
    t = workload(base, stagger_s=0.005)
    seen = {"waiting": 0, "shared": 0, "preempted": 0}
    while t.is_alive():
        snap, own = engine_view(app, engine)
        check_against_counters(snap, own)
        seen["waiting"] += snap["summary"]["waiting"] > 0
        seen["shared"] += snap["summary"]["shared"] > 0
        time.sleep(0.02)            # every few steps of the tiny model
    t.join()
    snap = httpx.get(base + "/debug/state", headers=H).json()
    assert snap["summary"]["used"] == 0 and not snap["requests"]
    assert snap["summary"]["free"] + snap["summary"]["cached"] == snap["config"]["num_blocks"] - 1
    assert seen["waiting"] and seen["shared"], seen
    assert any(s["preempted"] for s in snap["steps"]) and any(s["admitted"] for s in snap["steps"])
    assert snap["health"]["ttft_s"]["n"] > 0 and snap["health"]["prefix_hit_rate"] > 0
    # the same samples as /metrics: ITL = gaps between a stream's outputs, TPOT = each request's mean
    text = httpx.get(base + "/metrics", headers=H).text
    count = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.endswith(tuple("0123456789"))
             and "_count" in ln.split()[0]}
    for key, name in (("ttft_s", "time_to_first_token_seconds"), ("itl_s", "inter_token_latency_seconds"),
                      ("tpot_s", "time_per_output_token_seconds")):
        assert snap["health"][key]["n"] == count[f"pagedserve:{name}_count"], key
    assert snap["health"]["tpot_s"]["n"] > 0
    spec = httpx.get(base + "/openapi.json").json()
    assert "/debug/state" in spec["paths"]


def _driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        opts.add_argument(a)
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=opts)


def _dom_counts(driver) -> tuple[dict, dict]:
    """Cells per state and the summary of the frame they were drawn from (read in one script)."""
    return driver.execute_script("""
        const c = {}; for (const b of document.querySelectorAll('#blocks .blk')) c[b.dataset.state] = (c[b.dataset.state] || 0) + 1;
        const refs = [...document.querySelectorAll('#blocks .blk[data-shared]')].map(b => +b.dataset.ref);
        return [c, window.dash.snap.summary, window.dash.snap.step, refs];""")


def test_dashboard_in_a_real_browser(served):
    base, engine, _ = served
    driver = _driver()
    try:
        driver.get(base + f"/dashboard#key={KEY}")
        deadline = time.time() + 30
        while time.time() < deadline and not driver.execute_script("return window.dash && window.dash.frames"):
            time.sleep(0.1)
        assert driver.execute_script("return window.dash.frames") > 0
        t = workload(base, **BROWSER_WORKLOAD)
        seen = {"shared": False, "reason": "", "frames": 0}
        shot = False
        while t.is_alive():
            counts, summary, step, shared = _dom_counts(driver)
            assert sum(counts.values()) == engine.core.kv.pool.num_blocks             # one cell per block
            assert counts.get("used", 0) == summary["used"] and counts.get("free", 0) == summary["free"]
            assert counts.get("cached", 0) == summary["cached"] and counts.get("null") == 1
            live = httpx.get(base + "/debug/state", headers=H).json()
            assert live["step"] - step <= 40        # the page draws the current state, a frame behind at most
            if shared:                               # the same frame: shared cells show their refcount
                seen["shared"] = True
                assert min(shared) > 1
            reason = driver.execute_script(
                "const r = document.querySelector('tr[data-queue=waiting] td.reason'); return r ? r.textContent : ''")
            seen["reason"] = seen["reason"] or reason
            if not shot and shared and reason and step >= 40:
                os.makedirs(RESULTS, exist_ok=True)
                # outline one request's block table: found and clicked in one script, since the page redraws its
                # rows every frame (a handle from find_element can be stale by the time it is clicked)
                assert driver.execute_script(
                    "const r = document.querySelector('tr.req'); if (r) r.click(); return !!r")
                time.sleep(0.3)
                driver.save_screenshot(os.path.join(RESULTS, "dashboard.png"))
                shot = True
            time.sleep(0.15)
        t.join()
        assert seen["shared"] and seen["reason"], seen
        deadline = time.time() + 10
        while time.time() < deadline:
            counts, summary, step, _ = _dom_counts(driver)
            if not counts.get("used"):
                break
            time.sleep(0.25)
        assert set(counts) <= {"free", "cached", "null"}, counts       # every cell back to free or cached
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors and not driver.execute_script("return window.dash.errors"), errors
        assert shot
    finally:
        driver.quit()


def test_pagedserve_top_under_a_pty(served):
    base, _, _ = served
    pid, fd = pty.fork()
    if pid == 0:       # the child: pagedserve top, one frame
        os.execv(sys.executable, [sys.executable, "-m", "pagedserve.entrypoints.cli", "top", "--url", base,
                                  "--api-key", KEY, "--iterations", "1", "--width", "60"])
    out = b""
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    for needle in ("pagedserve", "step", "KV blocks", "running", "why waiting", "tokens per step"):
        assert needle in text, (needle, text[-2000:])
    assert subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "top", "--help"],
                          capture_output=True).returncode == 0


def test_snapshot_shows_swapped_requests_with_their_host_blocks(tiny_model):
    """Swap preemption: a swapped request is listed as such, with its host blocks, and holds no device block
    (the tiny model: the same blocks swap as under the default model, whose steps are ~10x as long)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.entrypoints.dashboard import StateRecorder, snapshot
    llm = LLM(tiny_model, num_kv_blocks=20, block_size=16, preemption_mode="swap", swap_space=0.05, max_num_seqs=8,
              dtype="float32")
    from pagedserve.entrypoints.metrics import LatencySamples
    eng, rec = llm.engine, StateRecorder()
    for i in range(6):
        eng.add_request(f"r{i}", {"prompt_token_ids": list(range(100 + i, 140 + i))},
                        SamplingParams(max_tokens=40, ignore_eos=True))
    seen = None
    while eng.has_unfinished_requests():
        rec.on_step(eng, eng.step(), LatencySamples())
        snap = snapshot(eng, rec)
        swapped = [r for r in snap["requests"] if r["queue"] == "swapped"]
        if swapped and seen is None:
            seen = snap
            assert all(r["host_blocks"] and not r["blocks"] and r["reason"] for r in swapped)
            assert snap["summary"]["swapped"] == len(swapped)
            assert snap["summary"]["host_blocks_used"] == sum(len(r["host_blocks"]) for r in swapped)
            assert snap["config"]["num_host_blocks"] > 0
    assert seen is not None and snapshot(eng, rec)["summary"]["used"] == 0


def test_dashboard_aggregates_a_large_pool_and_sizes_its_charts(tiny_model):
    """A pool of the default server's size (11,650 blocks here) is drawn with one cell per run of k
    blocks, and says so; the cells' counts add up to the frame's summary; every chart is drawn at its
    panel's width (not a fixed bitmap stretched); the latency histograms mark p50 and p99."""
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(model=tiny_model, num_kv_blocks=11650, max_num_seqs=8, dtype="float32"))
    app = build_app(engine, api_key=KEY)
    with serve_in_thread(app) as base:
        driver = _driver()
        try:
            driver.get(base + f"/dashboard#key={KEY}")
            # long enough to be running when the page first draws (within ~1 s here), and no longer: the
            # histograms need finished requests, so every one is waited for below
            t = workload(base, n=8, max_tokens=200)
            deadline, seen = time.time() + 60, None
            while time.time() < deadline and t.is_alive():
                seen = driver.execute_script("""
                    const cells = [...document.querySelectorAll('#blocks .blk')], s = window.dash.snap;
                    if (!s) return null;
                    const sum = f => cells.reduce((a, c) => a + (+c.dataset[f] || 0), 0);
                    return {cells: cells.length, blocks: sum('blocks'), used: sum('used'), cached: sum('cached'),
                            summary: s.summary, n: s.blocks.state.length,
                            info: document.getElementById('blockinfo').textContent};""")
                if seen and seen["summary"]["used"]:
                    break
                time.sleep(0.2)
            assert seen and seen["summary"]["used"] > 0, seen
            assert seen["n"] == 11650 and seen["cells"] <= 1536 and seen["blocks"] == seen["n"], seen
            assert seen["used"] == seen["summary"]["used"] and seen["cached"] == seen["summary"]["cached"], seen
            assert "each cell is 8 blocks" in seen["info"], seen["info"]
            t.join()
            sizes = driver.execute_script("""return ['timeline', 'usage', 'lat'].map(id => {
                const c = document.getElementById(id), r = window.devicePixelRatio || 1;
                return [c.width, Math.round(c.clientWidth * r), c.height, Math.round(c.clientHeight * r)]; });""")
            assert all(w == cw and h == ch and w > 300 for w, cw, h, ch in sizes), sizes
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors and not driver.execute_script("return window.dash.errors"), errors
            assert driver.execute_script("return window.dash.snap.health.tpot_s.n") > 0      # histograms drawn
        finally:
            driver.quit()
