"""The native builds started early (issue 56's cold start: pagedserve/native_build.py, before torch's import)
are the builds a load makes: the same file name (key) and the same bytes, whoever compiles them and however
many compile at once; the module imports no torch; what a start builds follows its flags."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve import kernels, native_build
from pagedserve.native_build import sources_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_module_imports_no_torch():
    r = subprocess.run([sys.executable, "-c", "import sys, pagedserve.native_build; print('torch' in sys.modules)"],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler")
def test_builds_started_at_once_make_the_loads_file(tmp_path, monkeypatch):
    """layer_ops (the quickest to compile) into an empty cache: prebuild twice at once (one compiles, the other
    finds it under way), then another process's compile of the same file waits on the lock file and finds it
    built; the result is the file a load names, byte for byte the suite's own build of it."""
    level = kernels.host_levels()[0]
    cc = native_build.compiler()
    theirs, _ = native_build.build_path(level, cc, "layer_ops")
    kernels.load(level, "layer_ops")                 # the suite's cache has (or now builds) it
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    out, _ = native_build.build_path(level, cc, "layer_ops")
    assert os.path.basename(out) == os.path.basename(theirs)
    threads = native_build.prebuild(("layer_ops",), level) + native_build.prebuild(("layer_ops",), level)
    assert len(threads) == 1
    probe = ("from pagedserve import native_build as b; cc = b.compiler(); "
             f"out, flags = b.build_path({level!r}, cc, 'layer_ops'); "
             f"print(b.compile_source(cc, out, flags, {level!r}, 'layer_ops'))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    for t in threads:
        t.join()
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
    with open(out, "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()
    assert [f for f in os.listdir(tmp_path / "kernels") if not f.endswith(".lock")] == [os.path.basename(out)]


def test_what_a_start_builds_follows_its_flags():
    every = ("qmatmul", "paged_attention", "layer_ops")
    assert sources_for("gguf", "auto", "auto", 1) == every
    assert sources_for("gguf", "gguf", "float32", 1) == every           # asked for: packed
    for dense in (("gguf", "none", "auto", 1), ("gguf", "auto", "float32", 1), ("gguf", "auto", "auto", 2),
                  ("hf", "auto", "auto", 1)):
        assert sources_for(*dense) == ("paged_attention", "layer_ops"), dense
    assert sources_for("hf", "int8", "auto", 1) == every
