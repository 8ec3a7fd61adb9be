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
    monkeypatch.setenv("PAGEDSERVE_INSTALLED_KERNELS", "0")      # the cache's builds, not make setup's
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


def test_installed_builds_are_used_first_under_the_same_name(tmp_path, monkeypatch):
    """`python -m pagedserve.native_build --install` (make setup): each source for the host's best level into
    INSTALLED_DIR under the cache's own file name (the same key: the same flags, source, compiler, host);
    build_path names the installed file while it exists (PAGEDSERVE_INSTALLED_KERNELS=0: the cache's), and
    an install removes builds of older sources or other hosts found there. gcc replaced by a copy of a
    marker file (the compile itself is tested above)."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(native_build, "INSTALLED_DIR", str(tmp_path / "installed"))
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    compiled = []

    def fake_compile(cc, out, flags, level, source):
        compiled.append(source)
        with open(out, "w") as f:
            f.write(source)
        return True
    monkeypatch.setattr(native_build, "_compile", fake_compile)
    os.makedirs(native_build.INSTALLED_DIR)
    stale = os.path.join(native_build.INSTALLED_DIR, "qmatmul-avx2-0000000000000000.so")
    open(stale, "w").close()
    paths = native_build.install()
    assert sorted(compiled) == sorted(native_build.SOURCES) and not os.path.exists(stale)
    assert sorted(os.listdir(native_build.INSTALLED_DIR)) == sorted(os.path.basename(p) for p in paths)
    level, cc = native_build.host_levels()[0], native_build.compiler()
    for source in native_build.SOURCES:
        out, _ = native_build.build_path(level, cc, source)
        assert out in paths
        monkeypatch.setenv("PAGEDSERVE_INSTALLED_KERNELS", "0")
        cached, _ = native_build.build_path(level, cc, source)
        monkeypatch.delenv("PAGEDSERVE_INSTALLED_KERNELS")
        assert cached.startswith(str(tmp_path / "cache")) and os.path.basename(cached) == os.path.basename(out)
    assert native_build.install() == paths and len(compiled) == len(native_build.SOURCES)   # built: a no-op
