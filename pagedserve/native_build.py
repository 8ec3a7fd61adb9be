"""Compiling the native CPU kernels (pagedserve/kernels/*.c) with the system C compiler, cached on disk: plain
Python, no torch, so the CLI starts a cold start's builds before its imports (issue 56: gcc's ~10-30 s of
CPU for the three sources ran after the imports, qmatmul's alone and in the foreground). pagedserve.kernels
loads what is built here.

A build is cached under a key made of the source (with vec16.h), the compiler's version, the flags, the ISA
level and the host's CPU flags, so a cache directory shared between different hosts never hands one host
another's build. The flags are the builds' own: what is started early is byte for byte what a load would
build (the same arithmetic on every start).

Installed builds: `python -m pagedserve.native_build --install` (run by `make setup`, as a wheel's compiled
extension is built at install) compiles the host's best level into pagedserve/kernels/build/, under the
same names; a build found there is used before the cache's, so the first start after the install compiles
nothing. A host the install did not see (other flags, another compiler) finds no file of its key there and
builds into the cache as before; PAGEDSERVE_INSTALLED_KERNELS=0 ignores the installed builds (a start as
on such a host: bench/startup.py --cold-kernels)."""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time

from pagedserve.host import cache_root, cpu_info

log = logging.getLogger("pagedserve")
SOURCES = ("paged_attention", "qmatmul", "layer_ops")
KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
INSTALLED_DIR = os.path.join(KERNELS_DIR, "build")

# ISA level -> (CPU flags it needs, compiler flags); best first. The -vnni levels add the int8 dot-product
# instruction (vpdpbusd) that qmatmul_q8 uses; everything else in them is the level below.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma")
_AVX2 = ("avx2", "fma", "f16c", "bmi2")
LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512-vnni": ((*_AVX512, "avx512_vnni"), ("-march=x86-64-v4", "-mavx512vnni")),
    "avx512": (_AVX512, ("-march=x86-64-v4",)),
    "avx2-vnni": ((*_AVX2, "avx_vnni"), ("-march=x86-64-v3", "-mavxvnni")),
    "avx2": (_AVX2, ("-march=x86-64-v3",)),
    "generic": ((), ("-march=x86-64",) if platform.machine() in ("x86_64", "AMD64") else ()),
}
_build_locks: dict[str, threading.Lock] = {}      # build path -> held while it compiles (prebuild, load)
_locks_lock = threading.Lock()


def cpu_flags() -> frozenset[str]:
    return cpu_info()[1]


def host_levels() -> list[str]:
    """The ISA levels this host runs, best first."""
    have = cpu_flags()
    return [name for name, (need, _) in LEVELS.items() if all(f in have for f in need)]


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


@functools.cache
def _compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]


def build_path(level: str, cc: str, source: str = "paged_attention") -> tuple[str, list[str]]:
    """Where the build for `level` is (installed, else cached), and its compiler flags. The key covers the
    source (with vec16.h), the compiler's version, the flags, the level and this host's CPU flags
    (-mtune=native differs by host)."""
    out, flags = _cached_path(level, cc, source)
    installed = os.path.join(INSTALLED_DIR, os.path.basename(out))
    use = os.environ.get("PAGEDSERVE_INSTALLED_KERNELS", "1") != "0" and os.path.isfile(installed)
    return (installed if use else out), flags


def _cached_path(level: str, cc: str, source: str) -> tuple[str, list[str]]:
    flags = ["-O3", *LEVELS[level][1], "-mtune=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
             "-Wno-psabi"]
    host = " ".join(sorted(cpu_flags()))
    text = b""
    for name in (source + ".c", "vec16.h"):        # the source and the header every source includes
        with open(os.path.join(KERNELS_DIR, name), "rb") as f:
            text += f.read()
    key = hashlib.sha256(text + "|".join([_compiler_version(cc), *flags, level, host]).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "kernels", f"{source}-{level}-{key}.so"), flags


def build_lock(out: str) -> threading.Lock:
    with _locks_lock:
        return _build_locks.setdefault(out, threading.Lock())


def compile_source(cc: str, out: str, flags: list[str], level: str, source: str) -> bool:
    """The build at `out` (compiled now unless cached); False: the compiler failed (logged). One process
    compiles a file at a time: another (the engine's own process beside the CLI's, servers sharing a cache)
    waits for its build on a lock file rather than compiling it again beside it."""
    if os.path.isfile(out):
        return True
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)         # released when closed, or when its process dies
        return os.path.isfile(out) or _compile(cc, out, flags, level, source)


def _compile(cc: str, out: str, flags: list[str], level: str, source: str) -> bool:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    t0 = time.perf_counter()
    r = subprocess.run([cc, *flags, os.path.join(KERNELS_DIR, source + ".c"), "-o", tmp, "-lm"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        log.warning("building the %s %s kernels failed, using the torch path:\n%s", level, source, r.stderr[-2000:])
        os.unlink(tmp)
        return False
    os.replace(tmp, out)
    log.info("%s kernels: %s built in %.1f s (%s)", source, level, time.perf_counter() - t0, " ".join(flags))
    return True


def prebuild(sources: tuple[str, ...] = ("qmatmul", "paged_attention", "layer_ops"),
             level: str | None = None) -> list[threading.Thread]:
    """Compile the builds of `sources` for `level` (default: the host's best) that are not cached yet, each
    on a daemon thread of its own, from now (the compiler runs outside the GIL: cold builds run beside each
    other and beside the imports and the model load, issue 56); nothing to do when all are cached or a build
    is under way. kernels.load() of a source whose build is under way waits for it. The compiled file is
    the one load() would build: the same flags, the same key. Nothing with PAGEDSERVE_KERNEL_ISA set (the
    level is the caller's to choose then) or without a compiler."""
    cc = compiler()
    if cc is None or os.environ.get("PAGEDSERVE_KERNEL_ISA"):
        return []
    level = level or host_levels()[0]
    threads = []
    for source in sources:
        out, flags = build_path(level, cc, source)
        lock = build_lock(out)
        if os.path.isfile(out) or not lock.acquire(blocking=False):    # built, or a build under way
            continue

        def compile_one(out=out, flags=flags, source=source, lock=lock):
            try:
                compile_source(cc, out, flags, level, source)
            except OSError:
                pass                    # load() tries again and reports it
            finally:
                lock.release()
        t = threading.Thread(target=compile_one, name=f"pagedserve-build-{source}", daemon=True)
        t.start()
        threads.append(t)
    return threads


def sources_for(model_kind: str, quantization: str, dtype: str, tp_size: int) -> tuple[str, ...]:
    """The sources a CPU start on this kind of model ("gguf" | "hf") loads, from its flags alone (before the
    model is read; quant.choose_quantization decides: qmatmul for a GGUF's packed products unless the
    products are dense: --quantization none, --dtype float32 or tensor parallelism under auto)."""
    dense = quantization == "none" or (quantization == "auto" and (model_kind != "gguf" or dtype == "float32"
                                                                   or tp_size > 1))
    return ("paged_attention", "layer_ops") if dense else ("qmatmul", "paged_attention", "layer_ops")


def install() -> list[str]:
    """Build every source for the host's best level into INSTALLED_DIR (what `make setup` runs); builds of
    older sources or other hosts found there are removed. Returns the installed paths."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler: the native kernels cannot be installed (the torch path runs)")
        return []
    level, paths = host_levels()[0], []
    for source in SOURCES:
        out, flags = _cached_path(level, cc, source)
        out = os.path.join(INSTALLED_DIR, os.path.basename(out))
        if compile_source(cc, out, flags, level, source):
            paths.append(out)
    for name in os.listdir(INSTALLED_DIR) if os.path.isdir(INSTALLED_DIR) else []:
        path = os.path.join(INSTALLED_DIR, name)
        if path not in paths:           # older sources' or other hosts' builds, and the build locks
            os.unlink(path)
    return paths


if __name__ == "__main__":
    import sys
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if sys.argv[1:] != ["--install"]:
        raise SystemExit("usage: python -m pagedserve.native_build --install")
    for p in install():
        print(p)
