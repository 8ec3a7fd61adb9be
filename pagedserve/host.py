"""What CPU this is: its model name and flags, read once from /proc/cpuinfo (plain Python). Code
paths and cached native builds are chosen by these flags; hosts of one machine kind differ."""
from __future__ import annotations

import functools
import os


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
