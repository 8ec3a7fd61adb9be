"""The packed weights as a host and a model file always make them, kept on disk (issue 56).

At load every packed weight is regrouped 8 rows at a time for int8 activations (PackedWeight.interleave:
~1-3.5 s for the default model on a 2-core host) and given a dense copy for many-row products
(add_dense_copies: ~0.5-1 s). Both are pure functions of the file's bytes, the load's settings, this
host (the dequantizing kernel is built for its ISA) and the engine's code, so the result is written
once, as safetensors, and read back on the next start (~0.1 s).

An entry is keyed by everything it depends on (`entry_key`):
  engine  pagedserve's version and a digest of the code that makes the bytes (quant.py, qmatmul.c)
  model   the file's size, mtime and a sha256 of three sampled 1 MiB spans (start, middle, end): not a
          hash of the whole file (reading 100 MB-10 GB each start would cost what the cache saves), so
          a rewrite that keeps size, mtime and those spans is not seen
  host    the CPU's flags
  load    compute dtype, int8 activations, which weights have dense copies, and each packed weight's format and shape
The file name is a digest of the key; the key itself is stored in the file and compared whole on read.
An entry that does not match (another version, a changed file, a truncated or garbled file, a tensor of
the wrong shape) is ignored and rebuilt, never trusted; a folder that cannot be written (read-only,
full) is a warning: the start pays the work and serves.
A hit is found before the file's packed tensors are read (the model is built on their shapes: gguf_packed.py),
so the entry replaces them without their ever being read.
The tensors read are mapped from the entry (safetensors), not copied: pages are shared between processes
serving the same file and read as first used. An entry is only ever replaced whole by a rename, never
rewritten in place, so a mapping keeps the bytes it was opened with (an outside tool truncating the file
in place while an engine runs would fault it). The folder is kept to a budget (pagedserve.disk_cache: least
recently used entries removed after each write; a hit marks its entry used): ~365 MB an entry for the
default model, one per engine version."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os

import torch

from pagedserve import disk_cache
from pagedserve.host import cache_root, cpu_info
from pagedserve.model.quant import FORMATS, Packed, PackedWeight, interleaves, leaves

log = logging.getLogger("pagedserve")

ENTRY_FORMAT = 1            # bump when the file's layout changes
SAMPLE_BYTES = 1 << 20      # each of the model file's three sampled spans


@functools.cache
def engine_version() -> str:
    """pagedserve's version and a digest of the code whose output an entry holds."""
    from pagedserve import __version__
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for rel in ("model/quant.py", "kernels/qmatmul.c"):
        with open(os.path.join(here, rel), "rb") as f:
            h.update(f.read())
    return f"{__version__}+{ENTRY_FORMAT}.{h.hexdigest()[:12]}"


def model_file_hash(path: str) -> str:
    """size:mtime_ns:sha256 of the first, middle and last SAMPLE_BYTES (see the module's note)."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for at in sorted({0, max(0, st.st_size // 2 - SAMPLE_BYTES // 2), max(0, st.st_size - SAMPLE_BYTES)}):
            f.seek(at)
            h.update(f.read(SAMPLE_BYTES))
    return f"{st.st_size}:{st.st_mtime_ns}:{h.hexdigest()[:32]}"


def entry_key(model_path: str, weights: list[Packed], dtype: torch.dtype, int8_act: bool,
              copies: list[bool]) -> str:
    """The whole key, as the JSON text stored in the entry (copies: which weights have a dense copy)."""
    return json.dumps({"engine": engine_version(), "model": model_file_hash(model_path),
                       "host": " ".join(sorted(cpu_info()[1])), "dtype": str(dtype), "int8_act": int8_act,
                       "dense": [j for j, on in enumerate(copies) if on],
                       "interleave": interleaves(True),
                       "weights": [[p.fmt, p.K, p.data.shape[0]] for p in leaves(weights)]}, sort_keys=True)


def entry_path(key: str) -> str:
    return os.path.join(cache_root(), "packed", hashlib.sha256(key.encode()).hexdigest()[:24] + ".safetensors")


def restore(key: str, weights: list[Packed], dtype: torch.dtype, copies: list[bool]) -> bool:
    """Put the entry's bytes into `weights` (each leaf's format and data, the dense copy of each weight whose
    `copies` entry is true) if there is a valid one; False (nothing changed) otherwise."""
    path = entry_path(key)
    if not os.path.isfile(path):
        return False
    try:
        tensors, fmts = _read(path, key)
        parts = leaves(weights)
        if len(fmts) != len(parts) or len(tensors) != len(parts) + sum(copies):
            raise ValueError(f"{len(tensors)} tensors for {len(parts)} packed weights")
        for i, (p, fmt) in enumerate(zip(parts, fmts)):
            _check_data(tensors[f"data.{i}"], fmt, p)
        for j, w in enumerate(weights):
            if copies[j]:
                d = tensors[f"dense.{j}"]
                if d.dtype != dtype or tuple(d.shape) != tuple(w.shape):
                    raise ValueError(f"dense.{j}: {d.dtype} {tuple(d.shape)}, not {dtype} {tuple(w.shape)}")
    except Exception as e:      # stale, truncated, garbled: rebuilt, never trusted
        log.warning("packed-weight cache entry %s ignored (%s: %s); rebuilding it", path, type(e).__name__, e)
        return False
    for i, (p, fmt) in enumerate(zip(parts, fmts)):
        p.data, p.fmt, p.deferred = tensors[f"data.{i}"], fmt, None     # the file's bytes never read
    for j, w in enumerate(weights):
        if copies[j]:
            w.dense = tensors[f"dense.{j}"]
    disk_cache.used(path)
    return True


def save(key: str, weights: list[Packed]) -> None:
    """Write the weights' bytes as the entry for `key` (a temporary file renamed: a reader never sees
    half of one). A folder that cannot be written is a warning."""
    from safetensors.torch import save_file
    path = entry_path(key)
    parts = leaves(weights)
    tensors = {f"data.{i}": p.data for i, p in enumerate(parts)}
    tensors.update({f"dense.{j}": w.dense for j, w in enumerate(weights) if w.dense is not None})
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(tensors, tmp, metadata={"key": key, "fmts": json.dumps([p.fmt for p in parts])})
        os.replace(tmp, path)
        disk_cache.prune(os.path.dirname(path), keep=path)
    except OSError as e:
        log.warning("packed-weight cache not written (%s: %s): the next start repeats this work",
                    os.path.dirname(path), e.strerror or e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _read(path: str, key: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("key") != key:
            raise ValueError("written for another key (engine version, model file, host or settings)")
        fmts = json.loads(meta["fmts"])
        return {name: f.get_tensor(name) for name in f.keys()}, fmts


def _check_data(data: torch.Tensor, fmt: str, like: PackedWeight) -> None:
    """The bytes of one leaf: a known format, uint8 rows of that format's width for K inputs."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    _, per_block, block_bytes = FORMATS[fmt]
    width = 4 + like.K if fmt in ("I8", "I8x8") else like.K // per_block * block_bytes
    if data.dtype != torch.uint8 or tuple(data.shape) != (like.data.shape[0], width):
        raise ValueError(f"{fmt} data {data.dtype} {tuple(data.shape)}, not ({like.data.shape[0]}, {width}) uint8")
