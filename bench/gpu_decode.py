"""bench/gpu_check.py's decode section (issue 53 item 5): decode steps at 1 / 8 / 32 / 64 / 128 running rows
against the weight-read roofline, and how much of each step is the host's.

For each row count, that many requests with distinct prompts of `context` tokens are prefilled, then every step
in which all of them decode (no prefill beside them) is timed after a few warm-up ones:
  step      the engine's step as a caller sees it (`LLMEngine.step`: schedule, inputs, forward, sampling,
            outputs), by the host clock
  forward   the model and its LM head alone: CUDA events recorded before the forward (the CUDA graph's replay or
            the eager model) and after the LM head, so it is the device's time; on the CPU the host clock
  host      step - forward: scheduling, input preparation, launches, sampling and output processing
  roofline  (weight bytes read per step + KV bytes read per step) / the bandwidth a device copy reaches in the
            same run; the weight bytes are the matmuls' and the LM head's (`ModelShape.weight_bytes`: the input
            embedding is gathered, not read), the KV bytes every row's whole context (`row_features`)
Aim (issue 53): a decode step at 64 rows <= 1.5x its roofline.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

ROWS = (1, 8, 32, 64, 128)
AIM_ROWS, AIM_RATIO = 64, 1.5


@dataclass(slots=True, frozen=True)
class DecodeSample:
    step_s: float           # the engine's step, host clock
    forward_s: float        # the forward and LM head, device time
    kv_bytes: float         # K/V read by the step's rows


def roofline_s(weight_bytes: float, kv_bytes: float, bytes_per_s: float) -> float:
    """The least time a decode step can take: every weight and every row's K/V read once at `bytes_per_s`."""
    return (weight_bytes + kv_bytes) / bytes_per_s


def decode_point(rows: int, samples: list[DecodeSample], weight_bytes: float, bytes_per_s: float) -> dict:
    """One row count's record: medians over its timed steps, the roofline of the median step's K/V reads, the
    step's and the forward's ratio to it, and the host's part (step - forward) in ms and as a share of the step."""
    med = statistics.median
    step, fwd = med(s.step_s for s in samples), med(s.forward_s for s in samples)
    kv = med(s.kv_bytes for s in samples)
    roof = roofline_s(weight_bytes, kv, bytes_per_s)
    return dict(rows=rows, steps=len(samples), kv_bytes=kv, step_ms=round(step * 1e3, 3),
                forward_ms=round(fwd * 1e3, 3),
                host_ms=round(med(s.step_s - s.forward_s for s in samples) * 1e3, 3),
                host_share=round(med((s.step_s - s.forward_s) / s.step_s for s in samples), 3),
                roofline_ms=round(roof * 1e3, 3), ratio=round(step / roof, 2), forward_ratio=round(fwd / roof, 2))


def verdict(points: list[dict]) -> dict:
    """The aim read off the records: the step at AIM_ROWS rows within AIM_RATIO x its roofline."""
    at = next((p for p in points if p["rows"] == AIM_ROWS), None)
    met = at is not None and at["ratio"] <= AIM_RATIO
    return dict(aim=f"{AIM_ROWS} rows <= {AIM_RATIO}x the roofline",
                ratio_at_aim=at["ratio"] if at else None, aim_met="met" if met else "not met")


class ForwardClock:
    """The forward's time in each step: marks before the model runs (a CUDA graph's replay or the eager model)
    and after the LM head, patched onto the runner's objects for as long as the clock is open."""

    def __init__(self, runner):
        import torch
        self.cuda = runner.device.type == "cuda"
        self._torch = torch
        self.marks: list = []
        self.graphed = False            # the last step taken replayed a CUDA graph
        self._restore = []
        model, graphs = runner.model, runner.graphs
        self._wrap(model, "forward", before=True)
        self._wrap(model, "compute_logits", before=False)
        if graphs is not None:
            self._wrap(graphs, "run", before=True, graph=True)

    def _wrap(self, obj, name: str, before: bool, graph: bool = False) -> None:
        orig = getattr(obj, name)

        def wrapped(*a, **k):
            if before:
                self.marks.append(("start", self._mark(), graph))
            out = orig(*a, **k)
            if not before:
                self.marks.append(("end", self._mark(), False))
            return out
        setattr(obj, name, wrapped)
        self._restore.append((obj, name))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = self._torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def take(self) -> float | None:
        """Seconds from the step's first start mark to its last end mark (None: no forward); the marks reset."""
        marks, self.marks = self.marks, []
        starts = [m for kind, m, _ in marks if kind == "start"]
        ends = [m for kind, m, _ in marks if kind == "end"]
        self.graphed = any(graph for _, _, graph in marks)
        if not starts or not ends:
            return None
        if not self.cuda:
            return ends[-1] - starts[0]
        ends[-1].synchronize()
        return starts[0].elapsed_time(ends[-1]) / 1e3

    def close(self) -> None:
        for obj, name in self._restore:
            delattr(obj, name)          # the instance attribute goes: the class's method shows again


def measure_rows(eng, rows: int, context: int, warm: int, timed: int, max_tokens: int, clock: ForwardClock, shape,
                 rng: random.Random) -> tuple[list[DecodeSample], int]:
    """`rows` requests prefilled, then `timed` of their all-decode steps timed after `warm` (the requests then
    aborted): the samples, and how many of them replayed a CUDA graph. max_tokens covers the prefill steps
    (the first prompts decode while the last ones prefill) and the warm and timed steps."""
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.sim.cost_model import step_features
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"decode{rows}-{i}" for i in range(rows)]
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": [rng.randrange(200, 40000) for _ in range(context)]}, params)
    samples, seen, graphed = [], 0, 0
    while len(samples) < timed and eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        step_s = time.perf_counter() - t0
        forward_s = clock.take()
        seqs = eng.core.last_schedule.seqs
        if forward_s is None or len(seqs) != rows or not all(s.is_decode for s in seqs):
            continue
        seen += 1
        if seen > warm:
            samples.append(DecodeSample(step_s, forward_s, step_features(shape, seqs).kv_bytes))
            graphed += clock.graphed
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished_requests():         # one more step tells the runner they ended
        eng.step()
        clock.take()
    return samples, graphed


def run(model_dir: str, device: str, smoke: bool, bytes_per_s: float) -> dict:
    """Every row count through one engine (CUDA graphs up to 128 rows), then the aim's verdict."""
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.sim.cost_model import shape_of_engine
    context, warm, timed, budget = (512, 3, 20, 8192) if not smoke else (24, 1, 3, 512)
    max_tokens = warm + timed + -(-max(ROWS) * context // budget) + 2
    eng = LLMEngine(EngineArgs(model=model_dir, dtype="bfloat16", device=device, max_num_seqs=max(ROWS),
                               max_num_batched_tokens=budget, max_model_len=context + max_tokens,
                               gpu_memory_utilization=0.85))
    shape = shape_of_engine(eng.core)
    clock, rng, points = ForwardClock(eng.core.runner), random.Random(53), []
    try:
        for rows in ROWS:
            samples, graphed = measure_rows(eng, rows, context, warm, timed, max_tokens, clock, shape, rng)
            points.append(decode_point(rows, samples, shape.weight_bytes, bytes_per_s) | dict(graph_steps=graphed))
    finally:
        clock.close()
        eng.core.shutdown()
    return dict(context=context, weight_bytes=shape.weight_bytes, kv_bytes_per_token=shape.kv_bytes_per_token,
                copy_bytes_per_s=bytes_per_s, copy_gb_s=round(bytes_per_s / 1e9, 1),
                graphs=eng.core.runner.graphs_note, points=points, **verdict(points))
