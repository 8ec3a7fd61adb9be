"""Fit the step-time cost model to this machine: run the real engine on a calibration workload,
record each step's features and wall time, fit (`cost_model.fit`). Cached per host, model and dtype."""
from __future__ import annotations

import json
import logging
import os
import time

from pagedserve.config import EngineArgs
from pagedserve.sim.cost_model import (FittedCost, ModelShape, StepFeatures, cache_path, fit, host_key, row_features,
                                       shape_of_engine)
from pagedserve.sim.simulator import SimRequest, poisson_workload

log = logging.getLogger("pagedserve")


def calibration_workload() -> list[list[SimRequest]]:
    """Waves run one after the other, so batches of every size appear: a big mixed batch (prompts of
    8..1024 tokens), then 1, 2, 4 and 8 sequences decoding (not the validation workloads)."""
    big = poisson_workload(1.0, 40, seed=123, input_len=(5.0, 0.9, 8, 1024), output_len=(4.2, 0.7, 8, 256))
    waves = [[SimRequest(0.0, r.prompt_token_ids, min(128, max(8, r.output_len // 2))) for r in big]]
    for k, n in enumerate((1, 2, 4, 8)):
        small = poisson_workload(1.0, n, seed=200 + k, input_len=(5.0, 0.9, 8, 1024), output_len=(4.0, 0.1, 48, 64))
        waves.append(list(small))
    return waves


def measure(args: EngineArgs, waves: list[list[SimRequest]]) -> tuple[list, ModelShape]:
    """(features, step seconds) of every step of the real engine; each wave arrives at once and
    runs to completion before the next."""
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.sampling_params import SamplingParams
    eng = LLMEngine(args)
    shape = shape_of_engine(eng.core)           # (the calibration measures the core itself)
    eng.add_request("warm-up", list(range(100, 164)), SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    samples = []
    for w, wave in enumerate(waves):
        for i, r in enumerate(wave):
            eng.add_request(f"c{w}.{i}", list(r.prompt_token_ids),
                            SamplingParams(n=r.n, max_tokens=r.output_len, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
            samples.append((row_features(shape, eng.last_step().rows), eng.last_step().step_s))
    return samples, shape


class StepTrace:
    """One JSON line per engine step: its sequences (start, tokens, samples) and its wall time. A
    server started with --step-trace writes one; fit_trace() fits the cost model to it, so the fit
    includes what serving adds (the HTTP thread shares the cores)."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)

    def record(self, engine) -> None:
        s = engine.last_step()
        if not s.rows:                   # nothing ran (a step that only told the runner which sequences ended)
            return
        self.file.write(json.dumps({"step_s": s.step_s, "seqs": [list(r) for r in s.rows]}) + "\n")


def read_trace(path: str, shape: ModelShape) -> list[tuple[StepFeatures, float]]:
    """A step trace's (features, seconds), one per step that ran sequences (StepTrace's lines)."""
    samples = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if d["seqs"]:
                samples.append((row_features(shape, map(tuple, d["seqs"])), d["step_s"]))
    return samples


def fit_trace(path: str, shape: ModelShape) -> FittedCost:
    samples = read_trace(path, shape)
    model = fit(samples, host_key())
    log.info("fitted %d served steps from %s (median relative error %.1f%%)", len(samples), path,
             100 * model.rel_error_p50)
    return model


def calibrate(args: EngineArgs, waves: list[list[SimRequest]] | None = None, use_cache: bool = True) -> FittedCost:
    path = cache_path(args)
    if use_cache and os.path.exists(path):
        return FittedCost.load(path)
    t0 = time.perf_counter()
    samples, _ = measure(args, waves or calibration_workload())
    model = fit(samples, host_key())
    model.save(path)
    log.info("calibrated on %d steps in %.0f s (median relative error %.1f%%): %s", len(samples),
             time.perf_counter() - t0, 100 * model.rel_error_p50, path)
    return model
