"""The simulator runs the real scheduler on a cost model: deterministic for a seed, monotone where
capacity planning relies on it, and its SLO search and cost fit behave."""
import pytest

from pagedserve.config import EngineArgs
from pagedserve.sim.cost_model import MODELS, PROFILES, FittedCost, RooflineCost, StepFeatures, fit, step_features
from pagedserve.sim.simulator import max_rate_meeting, parse_slo, poisson_workload, simulate, with_arrivals

SHAPE = MODELS["llama-3-8b"]
COST = RooflineCost(SHAPE, PROFILES["a10g"])
ARGS = EngineArgs(max_num_seqs=64, max_num_batched_tokens=2048)


def run(reqs, blocks=2000, args=ARGS):
    return simulate(reqs, SHAPE, COST, args, blocks, max_model_len=4096)


def test_deterministic_for_a_seed():
    a = run(poisson_workload(4.0, 120, seed=3)).summary()
    b = run(poisson_workload(4.0, 120, seed=3)).summary()
    c = run(poisson_workload(4.0, 120, seed=4)).summary()
    assert a == b and a != c


def test_more_kv_memory_never_lowers_throughput_when_preempting():
    reqs = with_arrivals(poisson_workload(1.0, 150, seed=1), None)
    results = [run(reqs, blocks) for blocks in (300, 450, 700, 1100, 2000)]
    assert results[0].preemptions > 0                              # the workload does preempt
    tput = [r.output_tok_s for r in results]
    assert all(b >= a * 0.999 for a, b in zip(tput, tput[1:])), tput
    assert results[-1].output_tokens == results[0].output_tokens   # every request ran to its length


def test_higher_rate_never_lowers_ttft_p99():
    reqs = poisson_workload(1.0, 150, seed=2)
    p99 = [run(with_arrivals(reqs, rate, seed=0)).pct("ttft_s", 99) for rate in (0.5, 1, 2, 4, 8, 16)]
    assert all(b >= a for a, b in zip(p99, p99[1:])), p99


def test_slo_bisection_finds_the_boundary():
    reqs = poisson_workload(1.0, 120, seed=5)
    slo = parse_slo("ttft_p99<1s,itl_p99<200ms")
    assert slo == {"ttft_p99_ms": 1000.0, "itl_p99_ms": 200.0}
    rate, at = max_rate_meeting(slo, lambda r: run(with_arrivals(reqs, r, seed=0)).summary(), iters=10)
    assert 0 < rate < 64 and at["ttft_p99_ms"] <= 1000 and at["itl_p99_ms"] <= 200
    beyond = run(with_arrivals(reqs, rate * 1.5, seed=0)).summary()
    assert beyond["ttft_p99_ms"] > 1000 or beyond["itl_p99_ms"] > 200
    with pytest.raises(ValueError, match="unknown metric"):
        parse_slo("latency<2s")


def test_roofline_terms():
    # one decode row reads every weight: memory-bound on any GPU profile
    f = StepFeatures(1, 1, 1, 2.0 * SHAPE.matmul_params, 0.0, 0.0)
    hw = PROFILES["h100"]
    t = RooflineCost(SHAPE, hw).step_time(f)
    assert t == pytest.approx(hw.step_overhead_s + hw.seq_overhead_s + SHAPE.weight_bytes / (hw.mem_bw * hw.bw_eff))
    assert 15e9 < SHAPE.weight_bytes < 17e9                         # Llama-3-8B in bf16


def test_fit_recovers_known_coefficients():
    import random
    true = FittedCost({"fixed": 0.03, "multirow": 0.01, "seqs": 1e-4, "gemm_flops": 5e-12, "attn_flops": 2e-12,
                       "kv_bytes": 1e-10})
    rng = random.Random(0)
    samples = []
    for _ in range(200):
        T = rng.choice([1, 1, 2, 5, 40, 300, 1024])
        f = StepFeatures(T, min(T, 8), rng.randint(1, 64), 2.7e8 * T, rng.uniform(0, 1e10), rng.uniform(0, 5e8))
        samples.append((f, true.step_time(f)))
    got = fit(samples)
    for k, v in true.coef.items():
        assert got.coef[k] == pytest.approx(v, rel=1e-3)
    assert got.rel_error_p50 < 1e-6


def test_features_follow_the_step():
    class Row:
        num_samples = 2
    class Seq:  # noqa: E306 - a ScheduledSeq stand-in: 10 cached tokens, a 4-token chunk that samples twice
        start, num_tokens, sampling = 10, 4, Row()
    f = step_features(SHAPE, [Seq])
    assert (f.tokens, f.sampled_rows, f.seqs) == (4, 2, 1)
    assert f.gemm_flops == 2.0 * SHAPE.matmul_params * 4 + 2.0 * SHAPE.hidden * SHAPE.vocab * 2
    assert f.kv_bytes == SHAPE.kv_bytes_per_token * 14
    assert f.attn_flops == 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * 4 * (10 + 2.5)


def test_fit_from_a_served_step_trace(tmp_path):
    """`serve --step-trace` writes one line per step; fit_trace() fits the same cost model to it."""
    import json

    from pagedserve.sim.calibrate import fit_trace
    kv = MODELS["smollm2-135m"]
    true = FittedCost({"fixed": 0.03, "multirow": 0.02, "seqs": 0.0, "gemm_flops": 4e-12, "attn_flops": 0.0,
                       "kv_bytes": 1e-10})
    path = tmp_path / "trace.jsonl"

    class Row:
        def __init__(self, n):
            self.num_samples = n

    class Seq:
        def __init__(self, start, n, k):
            self.start, self.num_tokens, self.sampling = start, n, Row(k) if k else None
    with open(path, "w") as f:
        for b in range(1, 40):
            seqs = [[100 + 37 * i + b, 1, 1] for i in range(b)] + ([[0, 256, 0]] if b % 3 == 0 else [])
            t = true.step_time(step_features(kv, [Seq(*s) for s in seqs]))
            f.write(json.dumps({"step_s": t, "seqs": seqs}) + "\n")
    got = fit_trace(str(path), kv)
    assert got.rel_error_p50 < 1e-3
    assert got.coef["fixed"] == pytest.approx(0.03, rel=1e-2) and got.coef["multirow"] == pytest.approx(0.02, rel=1e-2)
