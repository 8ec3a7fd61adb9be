"""`pagedserve top --url http://127.0.0.1:8000`: the dashboard's snapshot (`GET /debug/state`) on a
terminal, refreshed live with rich: the queues, a compact block map, the step timeline."""
from __future__ import annotations

import os
import time

import httpx
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

BARS = " ▁▂▃▄▅▆▇█"
COLOURS = ["red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green", "bright_yellow",
           "bright_blue", "bright_magenta", "bright_cyan"]


def _colour(request_id: str) -> str:
    root = request_id.split("#")[0]
    return COLOURS[sum(map(ord, root)) % len(COLOURS)]


def _spec(sp: dict | None) -> str:
    if not sp:
        return ""
    rate = "-" if sp["acceptance_rate"] is None else f"{100 * sp['acceptance_rate']:.1f}%"
    how = sp["method"] if not sp.get("draft_model") else f"draft model {os.path.basename(sp['draft_model'].rstrip('/'))}"
    return f" · speculative {how}: {sp['num_draft_tokens']} drafted, {rate} accepted"


def render(s: dict, width: int = 100) -> Group:
    m, h = s["summary"], s["health"]
    hr = h["prefix_hit_rate"]
    head = Text(f"pagedserve · {s['model']} · step {s['step']} · KV {100 * m['kv_usage']:.1f}% used "
                f"({m['used']} used, {m['shared']} shared, {m['cached']} cached, {m['free']} free of "
                f"{s['config']['num_blocks']}) · running {m['running']} · waiting {m['waiting']} "
                f"(swapped {m['swapped']}) · prefix hits {'-' if hr is None else f'{100 * hr:.1f}%'} · "
                f"preemptions {h['preemptions']}{_spec(h.get('spec_decode'))}", style="bold")
    blocks = Text()
    names = s["blocks"]["state_names"]
    for i, st in enumerate(s["blocks"]["state"]):
        name, ref = names[st], s["blocks"]["ref"][i]
        owners = s["blocks"]["owners"].get(str(i))
        if name == "used" and owners:
            blocks.append(str(min(ref, 9)) if ref > 1 else "#", style=_colour(s["requests"][owners[0][0]]["id"]))
        else:
            blocks.append({"null": "x", "free": ".", "cached": "c"}.get(name, "?"), style="dim")
        if (i + 1) % width == 0:
            blocks.append("\n")
    table = Table("request", "queue", "prio", "tokens", "blocks", "age", "why waiting", box=None, pad_edge=False)
    for r in s["requests"][:30]:
        prio = str(r["priority"]) if r.get("traffic_class") is None else f"{r['traffic_class']}/{r['priority']}"
        table.add_row(Text(r["id"], style=_colour(r["id"])), r["queue"], prio,
                      f"{r['num_computed_tokens']}/{r['num_tokens']}",
                      f"{len(r['host_blocks'])} host" if r["queue"] == "swapped" else str(len(r["blocks"])),
                      f"{r['age_s']:.1f}s", r.get("reason", ""))
    steps = s["steps"][-width:]
    budget = s["config"]["max_num_batched_tokens"]
    line = Text("steps  ")
    for x in steps:
        frac = min(1.0, (x["prefill"] + x["decode"]) / budget)
        line.append(BARS[round(frac * (len(BARS) - 1))], style="red" if x["preempted"] else
                    "yellow" if x["prefill"] else "magenta" if x.get("draft") else "blue")
    ms = [x["step_ms"] for x in steps]
    lat = h["ttft_s"], h["itl_s"], h["tpot_s"]
    fmt = lambda v: "-" if v is None else f"{1e3 * v:.0f} ms"      # noqa: E731
    foot = Text(f"tokens per step vs budget {budget} (yellow: with prefill, magenta: with drafts, red: a preemption) "
                f"· step ms "
                f"last {ms[-1] if ms else 0:.1f} max {max(ms) if ms else 0:.1f} · TTFT p50 {fmt(lat[0]['p50'])} "
                f"p99 {fmt(lat[0]['p99'])} · ITL p50 {fmt(lat[1]['p50'])} p99 {fmt(lat[1]['p99'])} · TPOT p50 "
                f"{fmt(lat[2]['p50'])} p99 {fmt(lat[2]['p99'])}", style="dim")
    parts = [head]
    if h.get("traffic_classes"):
        parts.append(Text("classes  " + " · ".join(
            f"{c['name']} (prio {c['priority']}): {c['running']} running, {c['waiting']} waiting"
            + (f", held by {c['held_by']}" if c["held_by"] else "") for c in h["traffic_classes"]), style="cyan"))
    return Group(*parts, Text("KV blocks (# owned, digit = shared refcount, c cached, . free)", style="dim"),
                 blocks, table, line, foot)


def run_top(ns) -> int:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    url = ns.url.rstrip("/") + "/debug/state"
    n = 0
    with httpx.Client(timeout=10) as client, Live(Text("connecting..."), auto_refresh=False, screen=False) as live:
        while ns.iterations <= 0 or n < ns.iterations:
            try:
                r = client.get(url, headers=headers)
                r.raise_for_status()
                live.update(render(r.json(), ns.width), refresh=True)
            except httpx.HTTPError as e:
                live.update(Text(f"{url}: {e}", style="red"), refresh=True)
            n += 1
            if ns.iterations <= 0 or n < ns.iterations:
                time.sleep(ns.refresh)
    return 0


def add_top_flags(ap) -> None:
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--refresh", type=float, default=0.5, help="seconds between frames")
    ap.add_argument("--iterations", type=int, default=0, help="frames to draw, then exit (0: until Ctrl-C)")
    ap.add_argument("--width", type=int, default=100, help="blocks and steps per line")
