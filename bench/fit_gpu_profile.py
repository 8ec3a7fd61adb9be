"""A device profile of the simulator (sim/cost_model.py PROFILES) fitted to a measured step trace.

    python bench/fit_gpu_profile.py bench/results/gpu_check/step_trace.jsonl [--profile h200] [--model-shape llama-3-8b]

The roofline keeps the datasheet's FLOP/s and bandwidth and the measured bandwidth efficiency; what a datasheet
cannot know is fitted: the fixed cost of a step, the cost per sequence in it (host-side preparation, sampling,
output) and the matmul efficiency. Fitted on the even steps (a grid, median relative error), tested on the odd
ones: the held-out error is the figure to quote. bench/gpu_check.py calls fit() on its own trace. The trace is
read by the simulator's own reader (sim/calibrate.read_trace, as `simulate --calibrate-from` reads it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedserve.sim.calibrate import read_trace                                                  # noqa: E402
from pagedserve.sim.cost_model import MODELS, PROFILES, Hardware, RooflineCost                  # noqa: E402

STEP_OVERHEAD_S = [i * 5e-4 for i in range(0, 41)]          # 0 .. 20 ms
SEQ_OVERHEAD_S = [i * 1e-5 for i in range(0, 101, 2)]       # 0 .. 1 ms
MATMUL_EFF = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]


def median_error(shape, hw: Hardware, samples) -> float:
    cost = RooflineCost(shape, hw)
    return statistics.median(abs(cost.step_time(f) / t - 1) for f, t in samples)


def fit(shape, base: Hardware, samples) -> dict:
    """samples: (StepFeatures, measured seconds), as sim/calibrate.read_trace gives them. The fitted profile, its
    error on the held-out half, on all steps, and the error of `base` (the profile it starts from) on all steps."""
    train, test = samples[0::2], samples[1::2]
    best = min(((median_error(shape, hw, train), hw) for hw in
                (dataclasses.replace(base, step_overhead_s=a, seq_overhead_s=b, matmul_eff=m)
                 for a in STEP_OVERHEAD_S for b in SEQ_OVERHEAD_S for m in MATMUL_EFF)), key=lambda x: x[0])[1]
    return dict(step_overhead_s=best.step_overhead_s, seq_overhead_s=best.seq_overhead_s, matmul_eff=best.matmul_eff,
                held_out_median_rel_error=round(median_error(shape, best, test), 3),
                all_steps_median_rel_error=round(median_error(shape, best, samples), 3),
                profile_median_rel_error=round(median_error(shape, base, samples), 3), steps=len(samples))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--model-shape", default="llama-3-8b")
    ns = ap.parse_args()
    shape = MODELS[ns.model_shape]
    print(json.dumps(fit(shape, PROFILES[ns.profile], read_trace(ns.trace, shape))))


if __name__ == "__main__":
    main()
