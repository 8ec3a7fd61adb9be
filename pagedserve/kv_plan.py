"""`pagedserve kv-plan`: the seed's KV-cache arithmetic for a model and a set of request lengths.

bytes/token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes; a request of L tokens holds
ceil(L / block_size) blocks; the tail of its last block is the only waste. A contiguous reservation
of max_len tokens per request holds max_len tokens whatever the request uses.

Sliding-window layers (Gemma 3: 5 of every 6 attend to the last 1,024 positions) need only the blocks
covering their window: `windowed_bytes` is what a request holds when the blocks behind the window are
given back (vLLM's hybrid allocator; pagedserve does this when every layer slides, and keeps them
when only some do: one block table serves all layers)."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from pagedserve.config import parse_bytes
from pagedserve.core.kv_layout import KVLayout

MiB, GiB = 2**20, 2**30
DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}
# bytes stored per token and kv head beside the values: pagedserve's int8 KV cache keeps one float32
# scale per token and head (--kv-cache-dtype int8); fp8 here means a per-tensor scale, as vLLM's
SCALE_BYTES = {"int8": 4}


@dataclass(slots=True)
class RequestPlan:
    live_tokens: int
    blocks: int
    allocated_bytes: int
    live_bytes: int
    tail_waste_bytes: int
    contiguous_bytes: int
    windowed_bytes: int            # = allocated_bytes without sliding-window layers


@dataclass(slots=True)
class KVPlan:
    bytes_per_token: int
    block_size: int
    block_bytes: int
    requests: list[RequestPlan]
    total_blocks: int
    total_allocated_bytes: int
    total_live_bytes: int
    total_tail_waste_bytes: int
    contiguous_max_len: int
    total_contiguous_bytes: int
    budget_bytes: int | None
    fit_len: int | None
    fit_paged: int | None
    fit_contiguous: int | None
    sliding_window: int = 0
    sliding_layers: int = 0
    layers: int = 0


def plan(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int, lengths: list[int],
         max_len: int, budget_bytes: int | None = None, fit_len: int | None = None, scale_bytes: int = 0,
         sliding_window: int = 0, sliding_layers: int = 0) -> KVPlan:
    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("block_size", block_size),
                    ("max_len", max_len)):
        if v < 1:
            raise ValueError(f"{name} must be positive, got {v}")
    if any(L < 1 for L in lengths):
        raise ValueError(f"lengths must be positive, got {lengths}")
    if sliding_window < 0 or not 0 <= sliding_layers <= layers or bool(sliding_window) != bool(sliding_layers):
        raise ValueError(f"sliding_window ({sliding_window}) and sliding_layers ({sliding_layers}) go together, "
                         f"with 0 < sliding_layers <= layers ({layers})")
    per_tok = 2 * layers * kv_heads * (head_dim * dtype_bytes + scale_bytes)
    per_layer_block = per_tok // layers * block_size
    block_bytes = per_tok * block_size
    window_blocks = -(-(sliding_window - 1) // block_size) + 1 if sliding_window else 0   # W - 1 back + this one
    # the engine's layout (core/kv_layout.py): layer planes per kind of group, padding included
    layout = KVLayout.of([0] * (layers - sliding_layers) + [sliding_window] * sliding_layers)
    full_planes = layout.planes * sum(1 for w in layout.windows if not w)
    reqs = []
    for L in lengths:
        blocks = -(-L // block_size)
        windowed = per_layer_block * (full_planes * blocks + (layout.planes * layout.num_groups - full_planes)
                                      * min(blocks, window_blocks))
        reqs.append(RequestPlan(L, blocks, blocks * block_bytes, L * per_tok, blocks * block_bytes - L * per_tok,
                                max(max_len, L) * per_tok, windowed))
    fit_p = fit_c = None
    if budget_bytes is not None:
        fl = fit_len or max_len
        fit_p = (budget_bytes // block_bytes) // -(-fl // block_size)
        fit_c = budget_bytes // (max_len * per_tok)
        fit_len = fl
    return KVPlan(per_tok, block_size, block_bytes, reqs, sum(r.blocks for r in reqs),
                  sum(r.allocated_bytes for r in reqs), sum(r.live_bytes for r in reqs),
                  sum(r.tail_waste_bytes for r in reqs), max_len, sum(r.contiguous_bytes for r in reqs),
                  budget_bytes, fit_len, fit_p, fit_c, sliding_window, sliding_layers, layers)



# ---------------------------------------------------------------- the engine's memory plan (EngineCore)
def workspace_bytes(cfg, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, dtype_bytes: int) -> int:
    """A step's scratch beside the weights and the KV pool: activations at the step's token budget, the
    float32 logits of its sequences and the attention's gather of their contexts."""
    act = max_num_batched_tokens * (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                    + 3 * cfg.intermediate_size)
    gather = max_num_seqs * max_model_len * cfg.num_kv_heads * cfg.head_dim * 2
    return (act + gather) * dtype_bytes + max_num_seqs * cfg.vocab_size * 4


def pool_blocks(args, block_bytes: int, workspace: int, free: int, total: int | None, ranks: int,
                need_blocks: int | None = None) -> tuple[int, str]:
    """The KV pool in blocks, and how it was sized: --num-kv-blocks, else --kv-cache-memory, else on a GPU
    gpu_memory_utilization of each rank's device (`free` / `total`: its bytes once the weights are
    loaded), else on the host what max_num_seqs sequences of max_model_len tokens need (`need_blocks`),
    at most 20 % of the host's `free` bytes after the workspace and at most 4 GiB (as llama.cpp sizes its
    cache to its slots' context, not to the machine)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks, "num_kv_blocks"
    if args.kv_cache_memory is not None:
        budget, how = parse_bytes(args.kv_cache_memory, "kv_cache_memory"), "kv_cache_memory"
    elif total is not None:
        budget = gpu_kv_budget(free, total, args.gpu_memory_utilization, workspace) * ranks
        how = (f"gpu_memory_utilization {args.gpu_memory_utilization:g} of {total / GiB:.1f} GiB per GPU, "
               f"{(total - free) / GiB:.1f} GiB in use after the weights, minus the workspace; x {ranks} rank(s)")
    else:
        budget = min(int(0.2 * max(0, free - workspace)), 4 * GiB)
        how = f"20% of {free / GiB:.1f} GiB free after workspace, at most 4 GiB"
        if need_blocks is not None:
            need = (f"max_num_seqs {args.max_num_seqs} x max_model_len {args.max_model_len or 'of the model'} "
                    f"need {need_blocks} blocks")
            if 2 <= need_blocks <= budget // block_bytes:
                return need_blocks, f"{need}; the cap ({how}) would allow {budget // block_bytes}"
            how = f"{how}; {need}"
    if budget // block_bytes < 2:
        raise ValueError(f"kv_cache_memory {budget} bytes holds fewer than 2 blocks of {block_bytes} bytes")
    return budget // block_bytes, how


def gpu_kv_budget(free: int, total: int, utilization: float, workspace: int) -> int:
    """One GPU's KV pool bytes (vLLM's gpu_memory_utilization): the share of the device the engine may use,
    less what is in use once the weights are loaded (this process's and any other's) and the step's
    workspace. ValueError naming the parameter when nothing is left."""
    budget = int(utilization * total) - (total - free) - workspace
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization:g} leaves no KV cache memory: "
                         f"{utilization:g} x {total / GiB:.1f} GiB, {(total - free) / GiB:.1f} GiB already in use, "
                         f"{workspace / GiB:.2f} GiB workspace")
    return budget


def window_plan(cfg, layout: KVLayout, bytes_per_token: int) -> str:
    """The memory-plan line of a model with sliding-window layers: bytes per token per layer group."""
    w = [cfg.window(i) for i in range(cfg.num_layers)]
    per_layer = bytes_per_token // cfg.num_layers
    groups = {win: w.count(win) for win in sorted(set(w))}
    desc = ", ".join(f"{n} layers {'full' if win == 0 else f'window {win}'} ({n * per_layer} bytes/token)"
                     for win, n in groups.items())
    if layout.num_groups == 1 and layout.windows[0]:
        return (f"sliding window: {desc}; blocks behind the window of every layer return to the pool while a "
                "request runs")
    if layout.num_groups == 1:
        return (f"sliding window: {desc}; one block table serves every layer (--disable-hybrid-kv-cache-manager), "
                "so KV behind the windows is kept")
    return (f"sliding window: {desc}; block tables per group of layers: {layout.describe()} (a block id spans "
            f"{layout.planes} layers); a window group's blocks behind its window return to the pool while a "
            "request runs")

def _mib(b: int) -> str:
    v = b / MiB
    return f"{v:,.2f}".rstrip("0").rstrip(".") + " MiB"


def _size(b: int) -> str:
    return f"{_mib(b)} ({b / GiB:,.4g} GiB)" if b >= GiB else _mib(b)


def render(p: KVPlan) -> str:
    lines = [f"KV bytes per token: {p.bytes_per_token:,}  (block of {p.block_size} tokens = {_mib(p.block_bytes)})",
             "", f"{'request':>8} {'live tokens':>12} {'blocks':>7} {'allocated':>12} {'live':>12} {'tail waste':>11}"]
    for i, r in enumerate(p.requests):
        name = chr(ord("A") + i) if i < 26 else str(i)
        lines.append(f"{name:>8} {r.live_tokens:>12,} {r.blocks:>7,} {_mib(r.allocated_bytes):>12} "
                     f"{_mib(r.live_bytes):>12} {_mib(r.tail_waste_bytes):>11}")
    lines.append(f"{'total':>8} {sum(r.live_tokens for r in p.requests):>12,} {p.total_blocks:>7,} "
                 f"{_mib(p.total_allocated_bytes):>12} {_mib(p.total_live_bytes):>12} {_mib(p.total_tail_waste_bytes):>11}")
    lines += ["", f"paged: {_size(p.total_allocated_bytes)} allocated for {_size(p.total_live_bytes)} live "
              f"({_mib(p.total_tail_waste_bytes)} tail waste, "
              f"{100 * p.total_tail_waste_bytes / max(1, p.total_allocated_bytes):.2f}%)",
              f"contiguous reservation of {p.contiguous_max_len:,} tokens per request: {_size(p.total_contiguous_bytes)} "
              f"({100 * (1 - p.total_live_bytes / max(1, p.total_contiguous_bytes)):.1f}% of it unused)"]
    if p.sliding_window:
        win = sum(r.windowed_bytes for r in p.requests)
        beyond = p.bytes_per_token * (p.layers - p.sliding_layers) // p.layers
        layout = KVLayout.of([0] * (p.layers - p.sliding_layers) + [p.sliding_window] * p.sliding_layers)
        lines.append(f"with the blocks behind the {p.sliding_window:,}-token window of {p.sliding_layers} of {p.layers} "
                     f"layers given back: {_size(win)} ({100 * win / max(1, p.total_allocated_bytes):.1f}% of paged); "
                     f"bytes per token beyond the window {p.bytes_per_token:,} -> {beyond:,}; block tables per group "
                     f"of layers: {layout.describe()}")
    if p.budget_bytes is not None:
        lines.append(f"in {_size(p.budget_bytes)}: {p.fit_paged:,} requests of {p.fit_len:,} tokens fit paged, "
                     f"{p.fit_contiguous:,} with contiguous {p.contiguous_max_len:,}-token reservations")
    return "\n".join(lines)


def add_kv_plan_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="read the shape from a model (GGUF file or HF folder); "
                    "'default' for the bundled model")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--lengths", default="3900,420,2100,70", help="comma-separated request lengths in tokens")
    ap.add_argument("--max-len", type=int, default=4096, help="contiguous reservation per request")
    ap.add_argument("--budget", default=None, help="memory for the KV pool, e.g. 8GiB: how many requests fit")
    ap.add_argument("--fit-len", type=int, default=None, help="request length for --budget (default: --max-len)")
    ap.add_argument("--sliding-window", type=int, default=0, help="window of the sliding layers, in tokens")
    ap.add_argument("--sliding-layers", type=int, default=0, help="how many layers slide (Gemma 3: 5 of every 6)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")


def run_kv_plan(ns) -> int:
    layers, kv_heads, head_dim = ns.layers, ns.kv_heads, ns.head_dim
    if ns.model is not None:
        from pagedserve.model.loader import read_model_config, resolve_model
        cfg = read_model_config(resolve_model(None if ns.model == "default" else ns.model))
        layers, kv_heads, head_dim = layers or cfg.num_layers, kv_heads or cfg.num_kv_heads, head_dim or cfg.head_dim
        windows = [w for w in (cfg.layer_windows or []) if w]
        if windows and not ns.sliding_window:
            ns.sliding_window, ns.sliding_layers = max(windows), len(windows)
    missing = [f"--{n}" for n, v in (("layers", layers), ("kv-heads", kv_heads), ("head-dim", head_dim)) if v is None]
    if missing:
        raise ValueError(f"kv-plan needs --model or {', '.join(missing)}")
    try:
        lengths = [int(x) for x in ns.lengths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated integers, got {ns.lengths!r}") from None
    budget = parse_bytes(ns.budget, "--budget") if ns.budget else None
    p = plan(layers, kv_heads, head_dim, DTYPE_BYTES[ns.dtype], ns.block_size, lengths, ns.max_len, budget, ns.fit_len,
             SCALE_BYTES.get(ns.dtype, 0), ns.sliding_window, ns.sliding_layers)
    print(json.dumps(asdict(p), indent=2) if ns.json else render(p))
    return 0
