"""The start-up probe of the step-time model (traffic classes on a host with no calibration cached, issue 54): a
few steps built by hand, run through the executor and timed, so the live model is fitted before the first
request; its samples kept beside the host's calibration for the next start. Plain Python: the executor is given."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import time

from pagedserve.sim.cost_model import host_key

log = logging.getLogger("pagedserve")


PROBE_CONTEXT = 1024      # tokens of context behind the probe's deep rows (less where max_model_len or the pool is)
PROBE_CHUNK = 64          # the probe's largest prefill chunk (less where max_num_batched_tokens is)


def probe_rows(ctx: int, chunk: int) -> list[list[tuple[int, int, int, int]]]:
    """The steps the start-up probe times, each a list of (context, start, tokens, samples): decodes shallow
    and deep, one to eight at once; prefill chunks of 16 tokens up to `chunk`, at a prompt's start and deep in
    it; and chunks beside decodes, the steps an ITL target plans (issue 54). Every term of FIT_TERMS moves
    across them, so a fit on them is determined."""
    half, c = max(1, ctx // 2), max(16, chunk)
    steps = [[(0, 16, 1, 1)], [(0, ctx - 1, 1, 1)], [(i % 2, ctx - 1, 1, 1) for i in range(4)],
             [(i % 2, (i + 1) * ctx // 8 - 1, 1, 1) for i in range(8)],
             [(0, 0, 16, 0)], [(0, ctx - 16, 16, 0)], [(0, 16, 1, 1), (1, ctx - 1, 1, 1), (0, half, 16, 0)],
             [(0, half, min(64, c), 0)], [(0, 0, c, 0)], [(0, ctx - c, c, 1), (1, ctx - 1, 1, 1)],
             [*((i % 2, ctx - 1, 1, 1) for i in range(4)), (1, half, 32, 0)], [(0, 0, 8, 1), (1, half, 1, 1)]]
    return [sorted(((t, min(s, ctx - n), n, k) for t, s, n, k in step), key=lambda r: r[2] > 1)   # decodes first
            for step in steps]


def probe_tables(kv, max_model_len: int) -> tuple[int, int]:
    """(context tokens, blocks per table) of the probe's two block tables in this pool; 0 context: no room."""
    free = kv.num_free_blocks // 3 * kv.block_size            # two tables, a third of the pool left
    ctx = max(32, min(PROBE_CONTEXT, max_model_len - 1, free)) if free >= 32 else 0
    return ctx, kv.blocks_needed(ctx)


def warm_blocks(kv, max_model_len: int, touch) -> None:
    """Write one of the probe's tables' blocks (taken, touched, given back: free blocks that hold nothing are handed
    out first, so the first requests write into mapped memory), where the probe's samples come from the cache: the
    first step of a process otherwise paid ~0.9 s of first touches (issue 54, the AVX2 host's TTFT p99). One table
    (64 blocks of the default model: ~0.6 s on that host's VMs, whose first touches are slow) is more than a first
    step writes."""
    ctx, n = probe_tables(kv, max_model_len)
    if ctx and touch is not None:
        blocks = kv.pool.get_new_blocks(n)
        try:
            touch([b.block_id for b in blocks])
        finally:
            kv.pool.free_blocks(blocks)


def probe_step_times(execute, kv, max_model_len: int, max_tokens: int, touch=None,
                     passes: int = 2) -> list[tuple[list[tuple[int, int, int]], float]]:
    """The start-up probe of a step-time model (traffic classes without a cached calibration, issue 54: before
    it, the first steps of a flood were planned by a roofline and ran 1-5 s uncut): probe_rows' steps run
    through `execute` (the executor's: one SchedulerOutput), `passes` times after the first step once untimed;
    returns ((start, tokens, samples) rows, seconds) per timed step (~2 s on a 2-core AVX2 host). Two block
    tables of `ctx` tokens are taken from the pool and given back before any request exists; `touch(block_ids)`
    (the runner's, in process) writes them first, so deep rows read memory, not the zero page (a first touch
    costs: ~0.3 s for the 94 MB of two 1,024-token tables of the default model in float32 on that host). Their
    contents are whatever is there: the rows' values are not used."""
    from pagedserve.core.step import SamplingRow, ScheduledSeq, SchedulerOutput, whole
    from pagedserve.sampling_params import SamplingParams
    ctx, n = probe_tables(kv, max_model_len)
    chunk = min(PROBE_CHUNK, max_tokens, ctx)
    if not ctx or max_tokens < 16:
        return []
    tables = [kv.pool.get_new_blocks(n) for _ in range(2)]
    ids = [whole((tuple(b.block_id for b in t),) * len(kv.windows)) for t in tables]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    out, steps = [], probe_rows(ctx, chunk)
    try:
        if touch is not None:
            touch([b.block_id for t in tables for b in t])
        for timed, step in [(False, steps[0])] + [(True, step) for _ in range(passes) for step in steps]:
            so = SchedulerOutput(tuple(ScheduledSeq(f"probe-{j}", (0,) * n, s, ids[t], SamplingRow(
                f"probe-{j}", params, None, 1, 0, ()) if k else None) for j, (t, s, n, k) in enumerate(step)))
            t0 = time.perf_counter()
            execute(so)
            if timed:
                out.append(([(s, n, k) for _, s, n, k in step], time.perf_counter() - t0))
    finally:
        for t in tables:
            kv.pool.free_blocks(t)
        execute(SchedulerOutput(finished_req_ids=tuple(f"probe-{j}" for j in range(max(map(len, steps))))))
    return out


def probe_cache_path(calibration: str) -> str:
    """Where the start-up probe's samples are kept: beside the calibration file (cache_path) of this host and
    these EngineArgs."""
    return calibration.removesuffix(".json") + ".probe.json"


@functools.cache
def code_digest() -> str:
    """A digest of the code a step's time comes from (the model, the runner, the native kernels' sources): kept
    samples from other code are stale (a faster gather halved a step of the floor, issue 54) and are probed again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for sub in ("model", "runner", "kernels"):
        for name in sorted(os.listdir(os.path.join(root, sub))):
            if name.endswith((".py", ".c", ".h")):
                with open(os.path.join(root, sub, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def save_probe(path: str, samples: list) -> None:
    """The probe's ((start, tokens, samples) rows, seconds) pairs for the next start on this host; an unwritable
    folder is a warning (the next start probes again)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    kept = {"host": host_key(), "code": code_digest(), "samples": [[[list(r) for r in rows], s] for rows, s in samples]}
    try:
        with open(tmp, "w") as f:
            json.dump(kept, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("step-time probe: could not keep its samples in %s (%s); the next start probes again", path, e)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def load_probe(path: str) -> list | None:
    """The samples save_probe kept, or None: none kept, or a file that is damaged, of another host or other code
    (ignored, never trusted: the caller probes again and rewrites it)."""
    try:
        with open(path) as f:
            d = json.load(f)
        if d["host"] != host_key() or d.get("code") != code_digest():
            return None
        out = []
        for rows, seconds in d["samples"]:
            rows = [tuple(int(x) for x in r) for r in rows]
            if not rows or any(len(r) != 3 or min(r) < 0 or r[1] < 1 for r in rows) or not 0 < float(seconds) < 3600:
                raise ValueError(f"a sample out of range: {rows} {seconds}")
            out.append((rows, float(seconds)))
        return out or None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("step-time probe: ignoring its cached samples in %s (%s); probing again", path, e)
        return None
