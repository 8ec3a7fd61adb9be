"""bench/gpu_check.py (issue 28's one command for an H200) at toy sizes on the CPU, so the script a GPU
session runs once is not first run there: every section but `unit` (which is the Triton test module, run
here by make test itself) must report ok, and the step trace must be what `pagedserve simulate
--calibrate-from` reads."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_runs_every_section_at_toy_sizes(tmp_path):
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--out", str(tmp_path),
                        "--sections", "env,reference,bandwidth,mixed64", "--profile"], cwd=ROOT, capture_output=True,
                       text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in open(tmp_path / "gpu_check.jsonl")]
    by = {d["section"]: d for d in lines}
    assert set(by) == {"env", "reference", "bandwidth", "mixed64-pagedserve", "mixed64", "done"}
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
    assert "aten::" in (tmp_path / "profile_decode_steps.txt").read_text()
    assert sum(1 for _ in open(tmp_path / "steps.jsonl")) == ours["steps"]
    from pagedserve.sim.calibrate import fit_trace
    from pagedserve.sim.cost_model import ModelShape
    fit_trace(m["pagedserve"]["trace"], ModelShape(2, 64, 4, 2, 16, 128, 49152))
