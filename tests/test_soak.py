"""A shortened soak (bench/soak.py) in the suite: ~100 requests at concurrency 16 against a
`pagedserve serve` with a pool small enough to preempt, by recompute and by swap."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode,requests", [("recompute", 100), ("swap", 60)])
def test_soak(tmp_path, mode, requests):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "soak.py"), "--requests", str(requests),
                        "--concurrency", "16", "--preemption-mode", mode, "--seed", str(requests),
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["lost"] == 0 and s["5xx"] == 0 and s["hung"] == 0 and s["leaked_blocks"] == 0 and s["healthy_after"]
    assert s["completed"] + s["client_cut"] + s["rejected_hostile"] == requests
    assert s["completed"] > requests // 2 and s["client_cut"] > 0
    assert s["preemptions"] > 0            # the pool was small enough to force preemption
