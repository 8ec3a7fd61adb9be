"""The host's process settings: glibc's malloc thresholds (issue 22). The soak in test_soak.py shows
the effect over requests; this shows the mechanism itself, on glibc, in a fresh process."""
import os
import subprocess
import sys

import pytest

# Allocate, touch and free a 20 MiB block five times, then print how far RSS stayed above where it
# began. Without fixed thresholds, glibc serves the first with mmap, then raises its threshold to 20
# MiB, serves the rest from the heap and keeps them (its trim threshold rises to 40 MiB with it).
PROBE = """
import ctypes, sys
from pagedserve.host import fix_malloc_thresholds
if sys.argv[1] == "fix":
    print(fix_malloc_thresholds(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
before = rss_mib()
for _ in range(5):
    p = libc.malloc(20 << 20)
    ctypes.memset(p, 1, 20 << 20)
    libc.free(p)
print(round(rss_mib() - before, 1))
"""


def probe(mode: str, **env) -> tuple[float, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "PAGEDSERVE_MALLOC"))}
    p = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env={**e, **env},
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return float(p.stdout), p.stderr.strip()


def glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


@pytest.mark.skipif(not glibc(), reason="the thresholds are glibc's")
def test_fixed_thresholds_give_a_freed_large_tensor_back():
    kept, _ = probe("leave")
    assert kept >= 15, f"glibc kept {kept} MiB without the fix: the premise of host.fix_malloc_thresholds changed"
    kept, said = probe("fix")
    assert said.startswith("mmap threshold fixed at 16 MiB") and kept < 2, (kept, said)


def test_thresholds_the_user_set_are_left_alone():
    _, said = probe("fix", MALLOC_MMAP_THRESHOLD_="1048576")
    assert said == "left as the environment sets them"
    _, said = probe("fix", PAGEDSERVE_MALLOC_THRESHOLDS="0")
    assert said.startswith("left as glibc sets them")


@pytest.mark.parametrize("before,env,expect", [
    ("", {}, "1000 spin"),                                         # set before torch loads libgomp
    ("import torch", {}, "None default"),                          # too late: left alone, and the log says so
    ("", {"GOMP_SPINCOUNT": "50"}, "50 environment"),              # the user's own setting wins
    ("", {"OMP_WAIT_POLICY": "PASSIVE"}, "None environment"),
])
def test_openmp_idle_threads_spin_briefly_unless_someone_else_decided(before, env, expect):
    """pagedserve sets GOMP_SPINCOUNT at import (idle OpenMP threads spinning for milliseconds starve
    whatever else wants the core), only where libgomp has not read its settings yet and the user has
    none of their own; host.openmp_wait() names the case for the load log."""
    code = (f"{before}\nimport os, pagedserve\nfrom pagedserve.host import openmp_wait\n"
            "w = openmp_wait()\nprint(os.environ.get('GOMP_SPINCOUNT'), w.split()[0], w)")
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env},
                         check=True).stdout.split()
    value, word = expect.split()
    assert out[0] == value
    assert {"spin": "spin", "default": "libgomp's", "environment": "from"}[word] == out[1]
