"""How long one engine step takes, from what the step computes. Plain Python.

A step is described by its features (`StepFeatures`, computed from the scheduler's own output):
  - GEMM FLOPs: 2 x (matmul weights) x (tokens in the step), plus 2 x hidden x vocab per sampled row
    (the LM head runs only on rows that sample);
  - weight bytes: every weight is read once per step, whatever the batch;
  - attention FLOPs: 4 x layers x heads x head_dim x (query tokens x keys each attends to);
  - KV bytes: each sequence reads its whole context's K and V once per layer, and writes its new tokens';
  - the number of sequences (per-sequence bookkeeping: input preparation, sampling, output).

`RooflineCost` turns them into seconds on a named device: compute and memory overlap, so each part
costs the larger of its FLOPs at the achievable FLOP/s and its bytes at the achievable bandwidth,
plus a fixed per-step and per-sequence overhead. `FittedCost` is the same features with
coefficients fitted to step times measured on this machine (`calibrate.py`); on a CPU compute and
memory traffic do not overlap much, so there the parts add."""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pagedserve.host import cpu_info


@dataclass(slots=True, frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    weight_bytes_per_param: float = 2.0       # 2: fp16/bf16, 4: fp32, ~0.56: Q4
    kv_bytes_per_value: float = 2.0

    @property
    def matmul_params(self) -> int:
        """q/k/v/o projections and the gated MLP, all layers (the LM head is counted per sampled row)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return self.layers * (qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate)

    @property
    def weight_bytes(self) -> float:
        return (self.matmul_params + self.hidden * self.vocab) * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_value

    @classmethod
    def from_model_config(cls, c, weight_bytes: float = 2.0, kv_bytes: float = 2.0) -> ModelShape:
        return cls(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                   c.vocab_size, weight_bytes, kv_bytes)


# Published shapes for projections (no weights needed).
MODELS = {
    "llama-3-8b": ModelShape(32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelShape(80, 8192, 64, 8, 128, 28672, 128256),
    "smollm2-135m": ModelShape(30, 576, 9, 3, 64, 1536, 49152),
}


@dataclass(slots=True, frozen=True)
class StepFeatures:
    tokens: int
    sampled_rows: int
    seqs: int
    gemm_flops: float
    attn_flops: float
    kv_bytes: float


def step_features(shape: ModelShape, seqs) -> StepFeatures:
    """seqs: ScheduledSeq records of one step (start, num_tokens, sampling)."""
    return row_features(shape, ((s.start, s.num_tokens, s.sampling.num_samples if s.sampling is not None else 0)
                                for s in seqs))


def row_features(shape: ModelShape, rows: Iterable[tuple[int, int, int]]) -> StepFeatures:
    """The same from plain (start, tokens, samples) tuples (what the scheduler has before a step exists)."""
    T = R = S = 0
    attn = kvb = 0.0
    per_token_attn = 4 * shape.layers * shape.heads * shape.head_dim
    for start, q, samples in rows:
        T += q
        R += samples
        S += 1
        attn += per_token_attn * q * (start + (q + 1) / 2)        # causal: query i sees start + i + 1 keys
        kvb += shape.kv_bytes_per_token * (start + q)
    gemm = 2.0 * shape.matmul_params * T + 2.0 * shape.hidden * shape.vocab * R
    return StepFeatures(T, R, S, gemm, attn, kvb)


@dataclass(slots=True, frozen=True)
class Hardware:
    """A device as the roofline sees it. Efficiencies are the fractions of peak that real kernels
    reach; the defaults are typical of vLLM-class engines, not measurements of ours."""

    name: str
    matmul_flops: float             # peak dense FLOP/s at the weights' dtype
    mem_bw: float                   # peak memory bandwidth, bytes/s
    matmul_eff: float = 0.6
    attn_eff: float = 0.3
    bw_eff: float = 0.8
    step_overhead_s: float = 0.002  # scheduling, input preparation, launches
    seq_overhead_s: float = 2e-5    # per sequence in the step: sampling, detokenization


PROFILES = {
    "h100": Hardware("h100", 989e12, 3.35e12),              # SXM, bf16 dense
    # measured: bench/gpu_check.py's mixed64 trace of a Llama-3-8B-shaped bf16 model (2026-12-04, CUDA graphs,
    # Triton attention), bench/fit_gpu_profile.py on its even steps: 10.6 % median error on the odd ones (the
    # datasheet's defaults: 46 %). The per-sequence cost was then mostly host-side sampling of every row's
    # logits, which the sampler no longer does for plain greedy rows: the next GPU run re-fits it.
    "h200": Hardware("h200", 989e12, 4.8e12, matmul_eff=0.5, step_overhead_s=0.003, seq_overhead_s=4.6e-4),
    "a100": Hardware("a100", 312e12, 2.0e12),
    "a10g": Hardware("a10g", 70e12, 600e9),                  # approximate dense fp16 tensor peak
    "l4": Hardware("l4", 121e12, 300e9),
    "cpu": Hardware("cpu", 300e9, 23e9, matmul_eff=0.7, attn_eff=0.05, bw_eff=0.6, step_overhead_s=0.003,
                    seq_overhead_s=2e-4),                   # a 2-core AMX host of the project machine kind
}


class RooflineCost:
    def __init__(self, shape: ModelShape, hw: Hardware):
        self.shape, self.hw = shape, hw

    def step_time(self, f: StepFeatures) -> float:
        hw, flops, bw = self.hw, self.hw.matmul_flops, self.hw.mem_bw * self.hw.bw_eff
        dense = max(f.gemm_flops / (flops * hw.matmul_eff), self.shape.weight_bytes / bw)
        attention = max(f.attn_flops / (flops * hw.attn_eff), f.kv_bytes / bw)
        return hw.step_overhead_s + hw.seq_overhead_s * f.seqs + dense + attention


FIT_TERMS = ("fixed", "multirow", "seqs", "gemm_flops", "attn_flops", "kv_bytes")


@dataclass(slots=True)
class FittedCost:
    """t = fixed + m*[tokens > 1] + a*seqs + b*gemm_flops + c*attn_flops + d*kv_bytes, fitted on
    measured steps. `fixed` holds the per-step weight read, which does not change with the batch;
    `multirow` is what a step of several rows pays on top of a one-row step (a one-row step is a
    GEMV, several rows go through a GEMM path with its own fixed cost: large on some CPUs, ~0 on GPUs)."""

    coef: dict[str, float]
    host: str = ""
    rel_error_p50: float = 0.0       # of the fit on its own samples

    def step_time(self, f: StepFeatures) -> float:
        x = _row(f)
        return sum(self.coef[k] * v for k, v in zip(FIT_TERMS, x))

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(asdict(self), fh, indent=1)

    @classmethod
    def load(cls, path: str) -> FittedCost:
        with open(path) as fh:
            return cls(**json.load(fh))


def _row(f: StepFeatures) -> list[float]:
    return [1.0, float(f.tokens > 1), float(f.seqs), f.gemm_flops, f.attn_flops, f.kv_bytes]


def fit(samples: list[tuple[StepFeatures, float]], host: str = "") -> FittedCost:
    """Non-negative least squares on relative error (every step counts alike, short or long), by
    an active set: solve, drop the most negative term, solve again."""
    import numpy as np
    return fit_arrays(np.array([_row(f) for f, _ in samples]).reshape(-1, len(FIT_TERMS)),
                      np.array([t for _, t in samples], dtype=float), host)


def fit_arrays(X, y, host: str = "") -> FittedCost:
    """fit() on the feature rows (_row) and seconds as arrays, without a Python loop over the samples (the
    live model refits on a serving engine's step path: 2,048 samples took 5.7 ms through the lists)."""
    import numpy as np
    w = 1.0 / np.maximum(y, 1e-6)
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
    active = list(range(X.shape[1]))
    while True:
        A = (X[:, active] / scale[active]) * w[:, None]
        sol, *_ = np.linalg.lstsq(A, y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(sol)))
    c = np.zeros(X.shape[1])
    c[active] = np.maximum(0.0, sol / scale[active])
    model = FittedCost(dict(zip(FIT_TERMS, map(float, c))), host)
    ok = y > 0
    model.rel_error_p50 = float(np.sort(np.abs(X[ok] @ c - y[ok]) / y[ok])[ok.sum() // 2]) if ok.any() else math.nan
    return model


class LiveCost:
    """The fitted model kept current while serving: each step's (features, seconds) goes into a window of
    the last WINDOW steps (the bound on what it holds: one array row each), fitted first after MIN_SAMPLES
    steps, again each time the samples double, then every REFIT steps. Seeded with a cached calibration of
    this host when there is one; before any fit it predicts by `prior` (the engine gives the device's roofline
    profile: issue 54 measured what predicting 0 s costs, the first 16 steps of a flood uncut, 1-6 s each
    beside an interactive decode) times the most a step has run past it so far, or 0 s without one. Called with a step's rows, (start, tokens, samples)
    each: predicted seconds."""

    WINDOW = 2048
    REFIT = 128
    MIN_SAMPLES = 16

    def __init__(self, shape: ModelShape, model: FittedCost | None = None, prior: RooflineCost | None = None):
        import numpy as np
        self.shape, self.model, self.prior = shape, model, prior
        self.X, self.y = np.zeros((self.WINDOW, len(FIT_TERMS))), np.zeros(self.WINDOW)
        self.count = 0              # steps observed (the window holds the last min(count, WINDOW))
        self._since_fit = 0
        # the p99 of measured / predicted over the window at the last fit (None before one): how far a step
        # may run past its prediction on this host now (the scheduler keeps that much headroom, issue 54)
        self.ratio_p99: float | None = None
        # before the first fit: the prior scaled by the most any step so far ran past it (a roofline assumes an
        # idle device; on a shared 2-core host steps ran 2-4x its prediction, issue 54)
        self.prior_scale = 1.0

    def observe(self, rows: Iterable[tuple[int, int, int]], seconds: float) -> None:
        import numpy as np
        i = self.count % self.WINDOW
        f = row_features(self.shape, rows)
        if self.model is None and self.prior is not None:
            self.prior_scale = max(self.prior_scale, seconds / max(self.prior.step_time(f), 1e-6))
        self.X[i], self.y[i] = _row(f), seconds
        self.count += 1
        self._since_fit += 1
        n = min(self.count, self.WINDOW)
        due = min(self.REFIT, max(self.MIN_SAMPLES, n // 2))
        if n >= self.MIN_SAMPLES and self._since_fit >= due:
            self.model = fit_arrays(self.X[:n], self.y[:n], self.model.host if self.model is not None else "")
            self._since_fit = 0
            pred = np.maximum(self.X[:n] @ np.array([self.model.coef[k] for k in FIT_TERMS]), 1e-4)
            self.ratio_p99 = float(np.quantile(self.y[:n] / pred, 0.99))

    def __call__(self, rows: list[tuple[int, int, int]]) -> float:
        if self.model is not None:
            return self.model.step_time(row_features(self.shape, rows))
        return 0.0 if self.prior is None else self.prior.step_time(row_features(self.shape, rows)) * self.prior_scale


# Where a host's calibration is cached, and the shape of a running engine: used by the engine (its
# live cost model starts from the cache) and by `simulate --calibrate` (which writes it).
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}


def host_key() -> str:
    """CPU model and flags: fits are not portable between hosts of one machine kind."""
    model, flags = cpu_info()
    return f"{model} [{hashlib.sha1(' '.join(sorted(flags)).encode()).hexdigest()[:8]}, {os.cpu_count()} cpus]"


def cache_path(args) -> str:
    """The calibration file of this host for these EngineArgs (model, dtypes, weight format, block size)."""
    key = hashlib.sha1(f"{host_key()}|{args.model}|{args.dtype}|{args.quantization}|{args.kv_cache_dtype}|"
                       f"{args.block_size}".encode()).hexdigest()[:16]
    d = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "calibration")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:                       # a read-only home: nothing cached is found, a save warns
        pass
    return os.path.join(d, f"{key}.json")


def shape_of_engine(eng) -> ModelShape:
    b = DTYPE_BYTES.get(str(eng.runner.dtype).removeprefix("torch."), 4.0)
    c = eng.model_config
    kv = eng.kv_cache_bytes_per_token / (2 * c.num_layers * c.num_kv_heads * c.head_dim)   # scales included
    return ModelShape.from_model_config(c, weight_bytes=b, kv_bytes=kv)
