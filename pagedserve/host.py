"""What CPU this is: its model name and flags, read once from /proc/cpuinfo (plain Python). Code
paths and cached native builds are chosen by these flags; hosts of one machine kind differ."""
from __future__ import annotations

import functools


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
