"""The cache folder's size kept bounded: least recently used entries removed (plain Python).

The folders under cache_root() that hold whole models' bytes (packed/: one entry per model file, host,
load settings and engine version; weights/: a dequantized copy per model file) gain an entry whenever one
of those keys changes: an upgrade, another file, a model written to a new temporary path. Nothing removed
them (one day of this project's test runs left 45 GB). After each new entry, the folder is pruned to its
budget, oldest use first: an entry's mtime is its last use (`used` on every hit), so what runs today
stays. The entry just written is never removed, even when it alone is over the budget.

Removal is safe beside a process using an entry: an engine maps or reads an entry whole at load (a
mapping keeps an unlinked file's pages), and an entry that vanishes between the existence check and the
read is a miss, rebuilt (packed_cache.restore, loader._read_gguf_cached). A folder that cannot be listed
or an entry that cannot be removed is a warning, never a failure.

PAGEDSERVE_CACHE_MAX_GB sets each folder's budget (default 10; 0 keeps only the newest entry)."""
from __future__ import annotations

import logging
import os
import shutil
import time

log = logging.getLogger("pagedserve.cache")

DEFAULT_BUDGET_GB = 10.0
TMP_GRACE_S = 3600          # a writer's temporary file younger than this is in use; older ones are debris


def budget_bytes() -> int:
    """Each pruned folder's budget in bytes: PAGEDSERVE_CACHE_MAX_GB, or DEFAULT_BUDGET_GB."""
    raw = os.environ.get("PAGEDSERVE_CACHE_MAX_GB", "")
    try:
        gb = float(raw) if raw else DEFAULT_BUDGET_GB
    except ValueError:
        raise ValueError(f"PAGEDSERVE_CACHE_MAX_GB must be a number of GB, got {raw!r}") from None
    if gb < 0:
        raise ValueError(f"PAGEDSERVE_CACHE_MAX_GB must not be negative, got {raw!r}")
    return int(gb * 2**30)


def used(path: str) -> None:
    """Mark an entry (file or folder) as used now: pruning removes the least recently used first."""
    try:
        os.utime(path)
    except OSError:
        pass            # read-only cache: its entries age, which only matters to a writer


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.lstat(path).st_size
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)


def prune(folder: str, keep: str, budget: int | None = None) -> list[str]:
    """Remove `folder`'s least recently used entries until the rest fit `budget` bytes (budget_bytes());
    `keep` (the entry just written or read) stays. Returns the paths removed."""
    budget = budget_bytes() if budget is None else budget
    now, entries = time.time(), []
    try:
        names = os.listdir(folder)
    except OSError as e:
        log.warning("cache folder %s not pruned (%s)", folder, e.strerror or e)
        return []
    for name in names:
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if ".tmp" in name and now - st.st_mtime < TMP_GRACE_S:
                continue                        # another process is writing it
            entries.append((st.st_mtime, path, _size(path)))
        except OSError:
            continue                            # removed beside us
    total = sum(size for _, _, size in entries)
    removed = []
    for _, path, size in sorted(entries):       # oldest use first
        if total <= budget:
            break
        if os.path.realpath(path) == os.path.realpath(keep):
            continue
        try:
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        except OSError as e:
            log.warning("cache entry %s not removed (%s)", path, e.strerror or e)
            continue
        total -= size
        removed.append(path)
    if removed:
        log.info("cache folder %s: removed %d least recently used entries (budget %.1f GB, "
                 "PAGEDSERVE_CACHE_MAX_GB)", folder, len(removed), budget / 2**30)
    return removed
