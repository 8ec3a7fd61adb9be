"""What CPU this is: its model name and flags, read once from /proc/cpuinfo (plain Python). Code
paths and cached native builds are chosen by these flags; hosts of one machine kind differ."""
from __future__ import annotations

import functools
import os


def cache_root() -> str:
    """Where pagedserve keeps what it derives on this host (native builds, converted tokenizers, packed
    weights): ~/.cache/pagedserve, or PAGEDSERVE_CACHE."""
    return os.environ.get("PAGEDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve"))


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags); ("unknown", {}) where /proc/cpuinfo is missing."""
    name, flags = "unknown", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == "unknown":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:   # x86, arm64
                    flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, flags


def bf16_flags() -> list[str]:
    """The CPU flags by which this host multiplies bfloat16 natively (AMX tiles, AVX512-BF16 dot
    products); empty where bf16 would be emulated and slower than float32."""
    return [f for f in ("amx_bf16", "avx512_bf16") if f in cpu_info()[1]]


def auto_dtype(device: str) -> tuple[str, str]:
    """What `--dtype auto` means here, and why (logged at start-up)."""
    if device != "cpu":
        return "bfloat16", f"{device}"
    have = bf16_flags()
    if have:
        return "bfloat16", f"the CPU multiplies bf16 natively ({', '.join(have)})"
    return "float32", "the CPU has neither amx_bf16 nor avx512_bf16"


def auto_kv_cache_dtype(device: str, dtype_asked: str, dtype_name: str) -> tuple[str, str]:
    """What `--kv-cache-dtype auto` means here, and why (logged at start-up): the model's dtype, except where
    `--dtype auto` chose float32 only because the CPU has no bf16 arithmetic (an AVX2-only host). There the
    cache is stored in bfloat16, as llama.cpp keeps an f16 cache while it multiplies in float32: half the
    bytes per token (the pool holds twice the tokens, a long context reads half the memory) and the
    attention kernels widen each value as they read it. That path is held to the closeness rule, as the
    int8-rounded activations of its packed products already are; `--dtype float32` asked for keeps a
    float32 cache (the exact path)."""
    if device == "cpu" and dtype_asked == "auto" and dtype_name == "float32":
        return "bfloat16", "--dtype auto is float32 here for want of bf16 arithmetic; the cache is stored in " \
                           "bf16 (half the bytes; --kv-cache-dtype float32 keeps it float32)"
    return dtype_name, "as --dtype"


def describe() -> str:
    """One line naming the host for benchmark outputs: model, cores, vector and matrix flags."""
    name, flags = cpu_info()
    return f"{name}; {os.cpu_count()} cores; " + " ".join(sorted(f for f in flags if f.startswith(("avx", "amx"))))


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping); free pages where it is
    missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# glibc's malloc serves a block of at least its mmap threshold with its own mmap, returned to the
# system when freed; but on each such free it raises the threshold to that block's size (up to 32
# MiB), so from then on blocks of that size come from the heap arenas and stay there, fragmented
# between smaller ones. A step's transient tensors (logits and their softmax, sort and mask copies,
# prompt logprobs, a prefill's activations) come in ever-new sizes; issue 22 measured the result as a
# high-water mark that climbs in steps for thousands of requests (+92.6 MiB by request 3,250 of a
# float32 soak) and RSS samples that swing by 50 MiB. A fixed threshold (glibc stops moving it once
# it is set) keeps every block of 16 MiB or more on mmap, so it goes back when freed, and leaves the
# smaller ones (a 1,024-token step's per-layer activations) in the heap, reused step after step: RSS
# flat within a few MiB over the same soak, no slower (BENCHMARKS.md, "Memory over many requests").
# The trim threshold is raised with it so the heap's top is not returned and refaulted every step.
MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3       # glibc's <malloc.h>


@functools.cache
def fix_malloc_thresholds() -> str:
    """Fix glibc's mmap and trim thresholds for this process (once; before the model loads). Left
    alone where the user set either by glibc's own environment variables, where
    PAGEDSERVE_MALLOC_THRESHOLDS=0, or where the C library is not glibc. Returns what was done, for
    the start-up log."""
    if os.environ.get("PAGEDSERVE_MALLOC_THRESHOLDS", "1") == "0":
        return "left as glibc sets them (PAGEDSERVE_MALLOC_THRESHOLDS=0)"
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return "left as the environment sets them"
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version          # glibc only
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return "left alone (not glibc)"
    return (f"mmap threshold fixed at {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
            if ok else "left alone (mallopt refused)")


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). A model load
    frees hundreds of MB of blocks below the mmap threshold (the file's tensors, replaced by their packed
    or cached forms) that stay resident between live ones: the 0.5B Q4_K_M file's RSS after load was
    1,198 MB before a trim and 478 MB after it (AMD, 2026-12-06)."""
    import ctypes
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def openmp_wait() -> str:
    """How idle OpenMP threads wait between parallel regions in this process, and who decided (logged at load)."""
    import pagedserve
    if pagedserve.OPENMP_WAIT_SET:
        return f"spin {pagedserve.GOMP_SPINCOUNT} rounds, then sleep (GOMP_SPINCOUNT, set by pagedserve before torch loaded)"
    own = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    if own:
        return "from the environment: " + ", ".join(f"{k}={v}" for k, v in own.items())
    return (f"libgomp's default (torch was imported before pagedserve; GOMP_SPINCOUNT={pagedserve.GOMP_SPINCOUNT} "
            "in the environment keeps idle threads from holding cores other work needs)")
