"""Soak: many requests over real HTTP against a `pagedserve serve` whose KV pool is small enough to
force preemption, the way users send them: streaming and not, chat and completions, n in 1..3,
stop strings, priorities, several prompts per completion with echo and prompt logprobs, JSON-schema
constrained chats, /v1/responses (streamed and not) and /v1/embeddings beside them, streams dropped
mid-way, client timeouts, aborted requests, and a few hostile fields beside the well-formed ones.

It asserts that every request either completed with the right token count, was cut by its own
client, or (hostile) got a 400; that no answer says "abort" or "error" unless the client caused
it; no 5xx; nothing hung; afterwards nothing runs or waits, every KV block is free or cached, and
the server is healthy. Exit status 1 if any of that fails.

Usage: python bench/soak.py [--requests 1000] [--concurrency 16] [--num-kv-blocks 48] [--preemption-mode swap]
       [--kv-cache-dtype int8] [--url URL] [--serve-args "--dtype bfloat16"] [--rss-every 50]
       [--warmup 500 --max-rss-growth-mb 20] [--observe]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_proc import process_tree, serve  # noqa: E402

WORDS = ("paged attention keeps the cache in blocks while continuous batching lets requests join and leave "
         "every step so long prompts are chunked and short ones finish early").split()
SYSTEM = "You are a terse assistant. " * 6          # a shared prefix for the prefix cache
# a constraint no answer can complete inside max_tokens, so every constrained choice ends by length
LONG_JSON = {"type": "json_schema", "json_schema": {"name": "note", "schema": {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string", "minLength": 4000}}}}}
HOSTILE = [{"temperature": float("inf")}, {"seed": 2**64}, {"n": 10**6}, {"top_k": 2**63}, {"logprobs": 99},
           {"prompt": "abc \ud800 def"}, {"stop": ["x"] * 10_000}]


def plan(i: int, rng: random.Random, max_tokens: int) -> dict:
    """What request i is and what its client will do."""
    chat = rng.random() < 0.5
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
    p = {"i": i, "chat": chat, "stream": rng.random() < 0.5, "n": rng.choice((1, 1, 2, 3)),
         "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens), "priority": rng.choice((-1, 0, 0, 1)),
         "stop": [rng.choice(WORDS)] if rng.random() < 0.2 else None, "action": "complete"}
    p["body"] = ({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": words}]} if chat
                 else {"prompt": SYSTEM + words})
    p["prompts"] = 1
    p["route"] = "chat" if chat else "completions"
    k, route = rng.random(), rng.random()
    if route < 0.08:                  # the Responses API: one output, EOS may end it (no ignore_eos there)
        p.update(route="responses", n=1, stop=None)
        p["body"] = {"input": words, "instructions": SYSTEM}
    elif route < 0.13:                # embeddings of two inputs, pooled in the same steps as the generations
        p.update(route="embeddings", n=1, stop=None, stream=False, prompts=2)
        p["body"] = {"input": [SYSTEM + words, words]}
    elif chat and k < 0.15:             # structured output: a grammar mask on this request's rows
        p["body"]["response_format"] = LONG_JSON
    elif not chat and k < 0.15:       # several prompts in one request, echoed with prompt logprobs
        p["prompts"] = 2
        p["body"] = {"prompt": [SYSTEM + words, " ".join(reversed(words.split()))], "echo": True, "logprobs": 1}
    r = rng.random()
    if r < 0.03:
        p["action"], p["hostile"] = "hostile", rng.choice(HOSTILE)
    elif p["stream"] and r < 0.18:
        p["action"], p["after_chunks"] = "disconnect", rng.randint(1, 6)
    elif r < 0.23:
        p["action"], p["timeout"] = "client_timeout", rng.uniform(0.2, 2.0)
    elif r < 0.26:
        p["action"], p["cancel_after"] = "abort", rng.uniform(0.05, 1.0)
    return p


def request_body(p: dict) -> dict:
    if p["route"] in ("responses", "embeddings"):
        body = dict(p["body"], priority=p["priority"])
        if p["route"] == "responses":
            body.update(max_output_tokens=p["max_tokens"], temperature=0.8, seed=p["i"], stream=p["stream"])
        if p["action"] == "hostile":
            bad = dict(p["hostile"])
            if "prompt" in bad:
                bad = {"input": bad.pop("prompt")}
            body.update(bad)
        return body
    body = dict(p["body"], n=p["n"], max_tokens=p["max_tokens"], temperature=0.8, seed=p["i"], ignore_eos=True,
                priority=p["priority"], stream=p["stream"])
    if p["stop"]:
        body["stop"] = p["stop"]
    if p["stream"]:
        body["stream_options"] = {"include_usage": True}
    if p["action"] == "hostile":
        bad = dict(p["hostile"])
        if p["chat"] and "prompt" in bad:
            bad = {"messages": [{"role": "user", "content": bad.pop("prompt")}]}
        body.update(bad)
    return body


JSON = {"content-type": "application/json"}


def encode(p: dict) -> bytes:
    """json.dumps as Python has it: Infinity and lone surrogates travel, as hostile clients send them."""
    return json.dumps(request_body(p)).encode()


def check_tokens(p: dict, reasons: list, completion_tokens: int) -> str:
    """'ok', or what is wrong with a finished answer."""
    n = p["n"] * p.get("prompts", 1)
    if len(reasons) != n:
        return f"{len(reasons)} choices for n={p['n']} x {p.get('prompts', 1)} prompts"
    bad = [r for r in reasons if r not in ("stop", "length")]
    if bad:
        return f"finish_reason {bad[0]!r} the client did not cause"
    if "stop" in reasons and not p["stop"]:
        return "stopped early without a stop string (EOS is ignored)"
    n_len = reasons.count("length")
    lo, hi = n_len * p["max_tokens"], n * p["max_tokens"]
    if not lo <= completion_tokens <= hi or (n_len == n and completion_tokens != hi):
        return f"{completion_tokens} tokens for n={p['n']} x max_tokens={p['max_tokens']} ({reasons})"
    return "ok"


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "embeddings": "/v1/embeddings"}


def check_response(p: dict, resp: dict) -> str:
    """'ok', or what is wrong with a finished /v1/responses answer."""
    out, status = resp["usage"]["output_tokens"], resp["status"]
    if status == "incomplete" and out == p["max_tokens"] or status == "completed" and 0 < out <= p["max_tokens"]:
        return "ok"
    return f"status {status!r} with {out} tokens for max_output_tokens={p['max_tokens']}"


async def run_one(client: httpx.AsyncClient, p: dict, hang_s: float) -> dict:
    path = PATHS[p["route"]]
    t0 = time.perf_counter()
    res = {"i": p["i"], "action": p["action"]}
    try:
        coro = (stream_one if p["stream"] else plain_one)(client, path, p)
        limit = {"client_timeout": p.get("timeout"), "abort": p.get("cancel_after")}.get(p["action"]) or hang_s
        res.update(await asyncio.wait_for(coro, timeout=limit))
    except (asyncio.TimeoutError, TimeoutError):
        res["outcome"] = "hung" if p["action"] not in ("client_timeout", "abort") else "client_cut"
    except httpx.HTTPError as e:
        res["outcome"], res["detail"] = "transport_error", repr(e)
    res["latency_s"] = time.perf_counter() - t0
    return res


async def plain_one(client, path, p) -> dict:
    r = await client.post(path, content=encode(p), headers=JSON)
    if r.status_code != 200:
        return {"outcome": "4xx" if r.status_code < 500 else "5xx", "status": r.status_code, "detail": r.text[:200]}
    j = r.json()
    if p["route"] == "responses":
        return {"outcome": check_response(p, j), "tokens": j["usage"]["output_tokens"]}
    if p["route"] == "embeddings":
        dims = {len(e["embedding"]) for e in j["data"]}
        ok = len(j["data"]) == 2 and len(dims) == 1 and dims.pop() > 0
        return {"outcome": "ok" if ok else f"embeddings: {len(j['data'])} vectors of sizes {dims}", "tokens": 0}
    reasons = [c["finish_reason"] for c in sorted(j["choices"], key=lambda c: c["index"])]
    return {"outcome": check_tokens(p, reasons, j["usage"]["completion_tokens"]), "tokens": j["usage"]["completion_tokens"]}


# the error types the server gives failures of its own (a 5xx before a stream starts; in a stream, the error event)
SERVER_ERROR_TYPES = {"engine_dead", "server_error", "server_overloaded", "server_shutting_down"}


async def stream_one(client, path, p) -> dict:
    reasons: dict[int, str] = {}
    usage, chunks = None, 0
    async with client.stream("POST", path, content=encode(p), headers=JSON) as r:
        if r.status_code != 200:
            await r.aread()
            return {"outcome": "4xx" if r.status_code < 500 else "5xx", "status": r.status_code,
                    "detail": r.text[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:      # (its code is OpenAI's string or null, not a status: the type tells)
                server = obj["error"].get("type") in SERVER_ERROR_TYPES
                return {"outcome": "5xx" if server else "4xx", "detail": str(obj["error"])}
            chunks += 1
            if p["action"] == "disconnect" and chunks >= p["after_chunks"]:
                return {"outcome": "client_cut"}
            if obj.get("type") == "response.completed":
                return {"outcome": check_response(p, obj["response"]),
                        "tokens": obj["response"]["usage"]["output_tokens"]}
            for c in obj.get("choices", []):
                if c.get("finish_reason"):
                    reasons[c["index"]] = c["finish_reason"]
            usage = obj.get("usage") or usage
    if usage is None:
        return {"outcome": "stream ended without usage"}
    return {"outcome": check_tokens(p, [reasons[k] for k in sorted(reasons)], usage["completion_tokens"]),
            "tokens": usage["completion_tokens"]}


# ---------------------------------------------------------------- observers (--observe)
def _metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {name (labels summed): value} for the few series the checks read."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def check_scheduler(j: dict, prev: dict | None) -> tuple[str | None, dict]:
    """/debug/scheduler read between two steps: the queues and the pool agree with each other."""
    kv, running, waiting = j["kv"], j["running"], j["waiting"]
    ids = [r["request_id"] for r in running] + [r["request_id"] for r in waiting]
    if len(ids) != len(set(ids)):
        return "a request is listed twice (running and waiting, or twice in one queue)", j
    if not 0 <= kv["blocks_free"] <= kv["blocks_total"]:
        return f"blocks_free {kv['blocks_free']} outside [0, {kv['blocks_total']}]", j
    if len(running) > j["limits"]["max_num_seqs"]:
        return f"{len(running)} running > max_num_seqs {j['limits']['max_num_seqs']}", j
    if any(not 0 <= r["num_computed_tokens"] <= r["num_tokens"] for r in running):
        return "a running request computed more tokens than it has", j
    # blocks in use are held by running requests (waiting ones hold none: recomputed or swapped out);
    # shared blocks count once per holder, so the holders' sum can only be larger
    used = kv["blocks_total"] - kv["blocks_free"]
    if sum(r["blocks"] for r in running) < used:
        return f"{used} blocks in use but the running requests hold {sum(r['blocks'] for r in running)}", j
    if prev is not None and j["step"] < prev["step"]:
        return f"step went back from {prev['step']} to {j['step']}", j
    return None, j


def check_state(j: dict, prev: dict | None) -> tuple[str | None, dict]:
    """/debug/state: the block map, the queues, the step record and the engine's counters agree."""
    s, h = j["summary"], j["health"]
    if s["free"] + s["used"] + s["cached"] + 1 != j["config"]["num_blocks"]:      # + the null block
        return f"block states {s['free']}+{s['used']}+{s['cached']} + null != {j['config']['num_blocks']}", j
    if s["running"] != sum(r["queue"] == "running" for r in j["requests"]):
        return "summary.running differs from the running requests listed", j
    if j["steps"] and (j["steps"][-1]["step"] != j["step"] or j["steps"][-1]["generated"] > h["generation_tokens"]):
        return f"the last step record {j['steps'][-1]['step']} is not the engine's step {j['step']}", j
    if prev is not None:
        ph = prev["health"]
        for k in ("generation_tokens", "prompt_tokens", "preemptions"):
            if h[k] < ph[k]:
                return f"health.{k} went back from {ph[k]} to {h[k]}", j
        if sum(h["finished"].values()) < sum(ph["finished"].values()):
            return "the finished count went back", j
    return None, j


def check_metrics(text: str, prev: dict | None) -> tuple[str | None, dict]:
    """/metrics: counters never go back; gauges inside their limits."""
    v = _metric_values(text)
    if v.get("pagedserve:num_requests_running", 0) > v.get("pagedserve:max_num_seqs", 0):
        return "num_requests_running > max_num_seqs", v
    if not 0 <= v.get("pagedserve:kv_blocks_free", 0) <= v.get("pagedserve:kv_blocks_total", 0):
        return "kv_blocks_free outside [0, kv_blocks_total]", v
    if prev is not None:
        for k in ("pagedserve:generation_tokens_total", "pagedserve:prompt_tokens_total",
                  "pagedserve:num_preemptions_total", "pagedserve:request_success_total"):
            if v.get(k, 0) < prev.get(k, 0):
                return f"{k} went back from {prev.get(k)} to {v.get(k)}", v
    return None, v


OBSERVED = {"/metrics": check_metrics, "/debug/scheduler": check_scheduler, "/debug/state": check_state}


async def observe(client: httpx.AsyncClient, done: asyncio.Event) -> dict:
    """Read /metrics, /debug/scheduler and /debug/state as fast as they answer (one reader each,
    reads back to back) until `done`: every answer a 200 whose snapshot is consistent in itself and
    with the reader's previous one (counters never go back)."""
    reads, bad, inconsistent = collections.Counter(), [], []

    async def reader(path, check):
        prev = None
        while not done.is_set():
            try:
                r = await client.get(path, timeout=60)
            except httpx.HTTPError as e:
                bad.append({"path": path, "error": repr(e)})
                continue
            reads[path] += 1
            if r.status_code != 200:
                bad.append({"path": path, "status": r.status_code, "detail": r.text[:200]})
                continue
            problem, prev = check(r.text if path == "/metrics" else r.json(), prev)
            if problem:
                inconsistent.append({"path": path, "problem": problem})
    await asyncio.gather(*(reader(p, c) for p, c in OBSERVED.items()))
    return {"reads": dict(reads), "non_200": bad[:20], "num_non_200": len(bad), "inconsistent": inconsistent[:20],
            "num_inconsistent": len(inconsistent)}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def rss_sample(pid: int) -> dict[str, float]:
    """MiB resident, per process of the server's tree: 'server', then 'child1', 'child2', ... by pid."""
    pids = process_tree(pid)
    return {("server" if p == pid else f"child{k}"): round(rss_bytes(p) / 2**20, 1)
            for k, p in enumerate([pid] + sorted(set(pids) - {pid}))}


async def soak(base: str, a, pid: int | None = None) -> dict:
    rng = random.Random(a.seed)
    plans = [plan(i, rng, a.max_tokens) for i in range(a.requests)]
    sem = asyncio.Semaphore(a.concurrency)
    limits = httpx.Limits(max_connections=a.concurrency * 2)
    rss: list[tuple[int, dict]] = [(0, rss_sample(pid))] if pid else []      # (requests finished, MiB per process)
    finished = 0
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
        async def guarded(p):
            nonlocal finished
            async with sem:
                res = await run_one(client, p, a.hang_s)
            finished += 1
            if pid and finished % a.rss_every == 0:
                rss.append((finished, rss_sample(pid)))
            return res
        done = asyncio.Event()
        watch = asyncio.ensure_future(observe(client, done)) if a.observe else None
        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in plans))
        wall = time.perf_counter() - t0
        done.set()
        observed = await watch if watch is not None else None
    return {"results": results, "wall_s": wall, "plans": plans, "rss": rss, "observed": observed}


def settle(base: str, timeout_s: float = 30.0) -> dict:
    """Wait for the server to go idle; return its scheduler state."""
    t0 = time.time()
    while True:
        dbg = httpx.get(base + "/debug/scheduler", timeout=10).json()
        if (not dbg["running"] and not dbg["waiting"]) or time.time() - t0 > timeout_s:
            return dbg
        time.sleep(0.2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--num-kv-blocks", type=int, default=48)
    ap.add_argument("--preemption-mode", default="recompute")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the server's KV cache format (int8: scales swap too)")
    ap.add_argument("--hang-s", type=float, default=150.0, help="a request with no answer after this is 'hung'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None, help="soak a running server instead of starting one")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--rss-every", type=int, default=50, help="record the server's RSS after every this many requests")
    ap.add_argument("--warmup", type=int, default=500, help="requests before RSS growth is counted")
    ap.add_argument("--max-rss-growth-mb", type=float, default=None,
                    help="fail when the RSS floor of any process of the server rises more than this after --warmup "
                         "requests (rss_growth)")
    ap.add_argument("--observe", action="store_true", help="read /metrics, /debug/scheduler and /debug/state as "
                    "fast as they answer during the soak: every read a 200 and consistent (observe)")
    ap.add_argument("--model", default=None, help="the server's model (default: its default model)")
    ap.add_argument("--serve-args", default="", help="more `pagedserve serve` flags for the path soaked, "
                                                      "e.g. '--dtype bfloat16' or '--quantization gguf'")
    a = ap.parse_args(argv)
    srv = None
    if a.url:
        base = a.url.rstrip("/")
    else:
        srv, base = serve(["--num-kv-blocks", str(a.num_kv_blocks), "--max-num-seqs", "16",
                           "--preemption-mode", a.preemption_mode, "--swap-space", "0.05",
                           "--kv-cache-dtype", a.kv_cache_dtype, *([a.model] if a.model else []),
                           *shlex.split(a.serve_args)])
    try:
        settled_start(base)
        rss0 = rss_bytes(srv.pid) if srv else None
        run = asyncio.run(soak(base, a, srv.pid if srv else None))
        dbg = settle(base)
        health = httpx.get(base + "/health", timeout=10).status_code
        metrics = httpx.get(base + "/metrics", timeout=10).text
        rss1 = rss_bytes(srv.pid) if srv else None
    finally:
        if srv is not None:
            srv.terminate()
            srv.wait(timeout=60)
    summary = summarize(run, dbg, health, metrics, rss0, rss1, a)
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if not summary["failures"] else 1


def summarize(run, dbg, health, metrics, rss0, rss1, a) -> dict:
    res = run["results"]
    outcomes = collections.Counter(r["outcome"] for r in res)
    failures = []
    for r in res:
        expected = {"hostile": ("4xx",), "disconnect": ("client_cut", "ok"), "client_timeout": ("client_cut", "ok"),
                    "abort": ("client_cut", "ok"), "complete": ("ok",)}[r["action"]]
        if r["outcome"] not in expected:
            failures.append({k: r.get(k) for k in ("i", "action", "outcome", "status", "detail")})
    preemptions = next((float(x.split()[-1]) for x in metrics.splitlines()
                        if x.startswith("pagedserve:num_preemptions_total")), 0.0)
    kv_ok = dbg["kv"]["blocks_free"] == dbg["kv"]["blocks_total"] and not dbg["running"] and not dbg["waiting"]
    if not kv_ok:
        failures.append({"leak": dbg["kv"], "running": len(dbg["running"]), "waiting": len(dbg["waiting"])})
    if health != 200:
        failures.append({"health": health})
    # async.deadlines: a finished request's deadline may stay until it passes (bounded, see _push_deadline)
    held = {k: v for k, v in dbg.get("held", {}).items() if v and k != "async.deadlines"}
    if held:
        failures.append({"held_after_idle": held})
    obs = run["observed"]
    if obs is not None and (obs["num_non_200"] or obs["num_inconsistent"]):
        failures.append({"observers": {k: obs[k] for k in ("non_200", "inconsistent")}})
    growth = rss_growth(run["rss"], a.warmup)
    if a.max_rss_growth_mb is not None and growth is not None and max(growth.values()) > a.max_rss_growth_mb:
        failures.append({"rss_growth_mb": growth, "allowed": a.max_rss_growth_mb, "after_requests": a.warmup})
    lat = [r["latency_s"] for r in res if r["outcome"] == "ok"]
    return {
        "requests": len(res), "concurrency": a.concurrency, "wall_s": round(run["wall_s"], 1),
        "completed": outcomes["ok"], "client_cut": outcomes["client_cut"], "rejected_hostile": sum(
            1 for r in res if r["action"] == "hostile" and r["outcome"] == "4xx"),
        "lost": len(failures), "5xx": outcomes["5xx"], "hung": outcomes["hung"],
        "leaked_blocks": dbg["kv"]["blocks_total"] - dbg["kv"]["blocks_free"], "healthy_after": health == 200,
        "preemptions": int(preemptions), "latency_p50_s": round(pct(lat, 50) or 0, 2),
        "latency_p99_s": round(pct(lat, 99) or 0, 2), "output_tokens": sum(r.get("tokens", 0) for r in res),
        "rss_before_mb": rss0 and round(rss0 / 2**20), "rss_after_mb": rss1 and round(rss1 / 2**20),
        "rss_growth_after_warmup_mb": growth, "held_after_idle": dbg.get("held"), "serve_args": a.serve_args,
        "rss_mb": run["rss"], "observed": obs,
        "outcomes": dict(outcomes), "failures": failures[:20],
    }


def settled_start(base: str, limit_s: float = 120.0) -> None:
    """Wait until the server's start-up work left for after ready (serve's GEMM shapes, built in idle time)
    is done: what a soak measures is the steady state, and shapes built lazily between its RSS samples (a
    busy host leaves the engine no idle time) would read as growth."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        st = (httpx.get(base + "/debug/state", timeout=10).json().get("startup") or {})
        if not st.get("pending"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"start-up work still pending after {limit_s:g} s: {st.get('pending')}")


def rss_growth(trace: list[tuple[int, dict]], warmup: int) -> dict[str, float] | None:
    """MiB by which each process's RSS floor rose after `warmup` requests: the lowest sample of the
    second half of the requests after warm-up minus the lowest of the first half. A step's transient
    buffers (prompt logprobs over a long prompt: tens of MiB) come and go between samples, so single
    samples swing by tens of MiB either way; what a leak or fragmentation keeps raises the floor."""
    after = [(n, s) for n, s in trace if n > warmup]
    if len(after) < 4:
        return None
    mid = (after[0][0] + after[-1][0]) / 2
    first, second = [s for n, s in after if n <= mid], [s for n, s in after if n > mid]
    return {k: round(min(s[k] for s in second) - min(s[k] for s in first), 1)
            for k in first[0] if all(k in s for s in first + second)}


if __name__ == "__main__":
    sys.exit(main())
