"""bench/gpu_check.py (issue 28's one command for an H200) at toy sizes on the CPU, so the script a GPU
session runs once is not first run there: every section but `unit` (which is the Triton test module, run
here by make test itself) must report ok, and the step trace must be what `pagedserve simulate
--calibrate-from` reads. One run of the script serves the module's tests (its imports and its toy
8B-shaped model, which three sections share, are made once)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("env", "reference", "bandwidth", "decode", "mixed64", "traffic")      # all but `unit`


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    """(the finished process, its --out folder, {section: its JSON line}) of one --cpu-smoke run of SECTIONS."""
    out = tmp_path_factory.mktemp("gpu_check")
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--out", str(out),
                        "--sections", ",".join(SECTIONS), "--profile"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [json.loads(line) for line in open(out / "gpu_check.jsonl")] if (out / "gpu_check.jsonl").exists() else []
    return r, out, {d["section"]: d for d in lines}


def test_gpu_check_runs_every_section_at_toy_sizes(gpu_check):
    r, out, by = gpu_check
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(by) == {*SECTIONS, "mixed64-pagedserve", "done"}
    for name in ("env", "reference", "bandwidth", "mixed64"):
        assert by[name]["ok"], by[name]
    assert set(by["reference"]["families"]) == {"llama", "qwen3", "gemma2", "mistral"}
    m = by["mixed64"]
    assert m["pagedserve"]["token_counts_ok"] and m["hf_cb"]["token_counts_ok"] and m["ratio"] > 0
    trace = [json.loads(line) for line in open(m["pagedserve"]["trace"])]
    assert len(trace) == m["pagedserve"]["steps"] and all(t["step_s"] > 0 and t["seqs"] for t in trace)
    ours = m["pagedserve"]          # the warm pass, the sampler A/B, the profile and the h200 refit (--profile)
    assert ours["warm_output_tok_s"] > 0 and ours["host_sampling_output_tok_s"] > 0
    assert ours["h200_profile_refit"]["steps"] == ours["steps"] and ours["compiles_during_first_pass"] >= 0
    assert "aten::" in (out / "profile_decode_steps.txt").read_text()
    assert sum(1 for _ in open(out / "steps.jsonl")) == ours["steps"]
    from pagedserve.sim.calibrate import fit_trace
    from pagedserve.sim.cost_model import ModelShape
    fit_trace(m["pagedserve"]["trace"], ModelShape(2, 64, 4, 2, 16, 128, 49152))


# ------------------------------------------------------------------ the decode and traffic sections (issues 53, 54)

def test_decode_roofline_and_its_record_on_known_numbers():
    from bench.gpu_decode import DecodeSample, decode_point, roofline_s, verdict
    assert roofline_s(16e9, 4e9, 4e12) == 5e-3            # (weights + K/V) / bandwidth
    samples = [DecodeSample(0.010, 0.006, 3e9), DecodeSample(0.012, 0.007, 4e9), DecodeSample(0.011, 0.008, 5e9)]
    p = decode_point(64, samples, 16e9, 4e12)
    # medians: step 11 ms, forward 7 ms, K/V 4e9 bytes (roofline 5 ms); host per step 4, 5, 3 ms, of the step
    # 0.4, 0.417, 0.273
    assert p == dict(rows=64, steps=3, kv_bytes=4e9, step_ms=11.0, forward_ms=7.0, host_ms=4.0, host_share=0.4,
                     roofline_ms=5.0, ratio=2.2, forward_ratio=1.4)
    assert verdict([dict(rows=1, ratio=9.0), dict(rows=64, ratio=1.5)]) == dict(
        aim="64 rows <= 1.5x the roofline", ratio_at_aim=1.5, aim_met="met")
    assert verdict([dict(rows=64, ratio=1.51)])["aim_met"] == "not met"
    assert verdict([dict(rows=32, ratio=1.0)]) == dict(aim="64 rows <= 1.5x the roofline", ratio_at_aim=None,
                                                       aim_met="not met")


def test_forward_clock_marks_the_model_and_lm_head_and_restores_them():
    from bench.gpu_decode import ForwardClock

    class Model:
        def forward(self, x):
            return x + 1

        def compute_logits(self, h):
            return h * 2

    class Graphs:
        def run(self, x):
            return x - 1

    class Runner:
        device = type("Device", (), {"type": "cpu"})()
        model, graphs = Model(), Graphs()

    r = Runner()
    clock = ForwardClock(r)
    assert clock.take() is None                     # no forward in the step
    assert r.model.compute_logits(r.model.forward(1)) == 4
    t = clock.take()
    assert t is not None and t >= 0 and not clock.graphed
    assert r.model.compute_logits(r.graphs.run(3)) == 4
    assert clock.take() >= 0 and clock.graphed
    assert clock.marks == []
    clock.close()
    assert "forward" not in vars(r.model) and "run" not in vars(r.graphs)
    r.model.compute_logits(r.model.forward(1))
    assert clock.marks == []                        # closed: nothing marks any more


def test_traffic_targets_and_verdict_on_known_numbers():
    from bench.gpu_traffic import class_targets, pct_ms, verdict
    assert pct_ms([i / 1000 for i in range(1, 101)], 99) == 99.0 and pct_ms([], 99) is None
    idle = dict(itl_p99_ms=10.0, ttft_p99_ms=100.0)
    assert class_targets(idle) == [{"name": "interactive", "priority": 0, "itl_p99_ms": 15.0, "ttft_p99_ms": 200.0},
                                   {"name": "batch", "priority": 10}]
    alone = dict(batch_computed_tok_s=1000.0)
    v = verdict(idle, alone, dict(itl_p99_ms=15.0, ttft_p99_ms=200.0, batch_computed_tok_s=800.0))   # each at its bound
    assert (v["itl_p99_vs_idle"], v["ttft_p99_vs_idle"], v["batch_vs_alone"], v["aim_met"]) == (1.5, 2.0, 0.8, "met")
    v = verdict(idle, alone, dict(itl_p99_ms=16.0, ttft_p99_ms=150.0, batch_computed_tok_s=790.0))
    assert v["parts"] == {"itl_p99": "not met", "ttft_p99": "met", "batch_throughput": "not met"}
    assert v["aim_met"] == "not met" and v["itl_p99_vs_idle"] == 1.6 and v["batch_vs_alone"] == 0.79


def test_gpu_check_decode_and_traffic_sections_at_toy_sizes(gpu_check):
    """The two sections' code paths on the CPU (a 2-layer model of the 8B's vocabulary): every row count and
    every run measured, the records' arithmetic consistent (no timing is judged)."""
    r, _, by = gpu_check
    assert r.returncode == 0, r.stderr[-3000:]
    assert set(by) == {*SECTIONS, "mixed64-pagedserve", "done"} and by["decode"]["ok"] and by["traffic"]["ok"], by
    from bench.gpu_decode import ROWS
    from pagedserve.sim.cost_model import ModelShape
    d = by["decode"]
    shape = ModelShape(2, 64, 4, 2, 16, 128, 49152)          # the toy model in bf16
    assert d["weight_bytes"] == shape.weight_bytes and d["kv_bytes_per_token"] == shape.kv_bytes_per_token
    assert [p["rows"] for p in d["points"]] == list(ROWS) and all(p["steps"] == 3 for p in d["points"])
    for p in d["points"]:
        # every row reads its whole context: the prompt and at least one generated token
        assert p["rows"] * (d["context"] + 1) <= p["kv_bytes"] / d["kv_bytes_per_token"] <= p["rows"] * 2 * d["context"]
        roof_ms = (d["weight_bytes"] + p["kv_bytes"]) / d["copy_bytes_per_s"] * 1e3
        assert abs(p["roofline_ms"] - roof_ms) <= 1e-3 * max(1.0, roof_ms)
        # the record's times are rounded to 3 decimals of a ms: a tiny roofline's rounding moves the ratio
        lo, hi = (p["step_ms"] - 5e-4) / (p["roofline_ms"] + 5e-4), (p["step_ms"] + 5e-4) / max(p["roofline_ms"] - 5e-4, 1e-9)
        assert lo - 0.01 <= p["ratio"] <= hi + 0.01
        assert 0 < p["forward_ms"] <= p["step_ms"] and p["host_ms"] >= 0 and 0 <= p["host_share"] < 1
    at = next(p for p in d["points"] if p["rows"] == 64)
    assert d["ratio_at_aim"] == at["ratio"] and d["aim_met"] == ("met" if at["ratio"] <= 1.5 else "not met")
    t = by["traffic"]
    idle, alone, prio, mixed = t["idle"], t["batch_alone"], t["priorities_only"], t["with_classes"]
    assert idle["ttft_samples"] >= 2 and idle["itl_samples"] > 0 and idle["batch_computed_tok_s"] == 0
    assert alone["interactive_requests"] == 0 and alone["batch_sampled_tok_s"] > 0
    assert alone["batch_computed_tok_s"] >= alone["batch_sampled_tok_s"]     # prompts are computed, not sampled
    for run in (prio, mixed):
        assert run["ttft_samples"] >= 2 and run["itl_samples"] > 0 and run["batch_computed_tok_s"] > 0
    inter = t["classes"][0]
    assert inter["name"] == "interactive" and inter["itl_p99_ms"] == round(1.5 * idle["itl_p99_ms"], 2)
    assert inter["ttft_p99_ms"] == round(2 * idle["ttft_p99_ms"], 2)
    assert t["itl_p99_vs_idle"] == round(mixed["itl_p99_ms"] / idle["itl_p99_ms"], 2)
    assert t["batch_vs_alone"] == round(mixed["batch_computed_tok_s"] / alone["batch_computed_tok_s"], 3)
    assert t["aim_met"] == ("met" if set(t["parts"].values()) == {"met"} else "not met")
    assert t["priorities_only_verdict"]["itl_p99_vs_idle"] == round(prio["itl_p99_ms"] / idle["itl_p99_ms"], 2)
