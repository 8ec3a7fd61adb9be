"""Native CPU kernels, built with the system C compiler on first use and cached on disk.

paged_attention.c: decode and prefill attention that read K/V in place through the block tables,
in every KV cache format (float32, bfloat16, int8 + per-token scales). One source is compiled per
ISA level the host runs (avx512 = x86-64-v4, avx2 = x86-64-v3, generic); the best one is loaded.
A build is cached under a key made of the source, the compiler, the flags, the level and the
host's CPU flags, so a cache directory shared between different hosts never hands one host
another's build. Without a compiler (or with PAGEDSERVE_ATTENTION=torch) the torch paths in
pagedserve.model.attention are used instead; tests run every level the host supports against them."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

from pagedserve.host import cpu_info

log = logging.getLogger("pagedserve")
_SRC = os.path.join(os.path.dirname(__file__), "paged_attention.c")

# ISA level -> (CPU flags it needs, compiler flags); best first
LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma"), ("-march=x86-64-v4",)),
    "avx2": (("avx2", "fma", "f16c", "bmi2"), ("-march=x86-64-v3",)),
    "generic": ((), ("-march=x86-64",) if platform.machine() in ("x86_64", "AMD64") else ()),
}
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_libs: dict[str, ctypes.CDLL | None] = {}
_default: str | None = None          # the level load() gives when none is named (resolved once)


def cpu_flags() -> frozenset[str]:
    return cpu_info()[1]


def host_levels() -> list[str]:
    """The ISA levels this host runs, best first."""
    have = cpu_flags()
    return [name for name, (need, _) in LEVELS.items() if all(f in have for f in need)]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def build_path(level: str, cc: str) -> tuple[str, list[str]]:
    """Where the build for `level` is cached, and its compiler flags. The key covers the source, the
    compiler's version, the flags, the level and this host's CPU flags (-mtune=native differs by host)."""
    flags = ["-O3", *LEVELS[level][1], "-mtune=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
             "-Wno-psabi"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    host = " ".join(sorted(cpu_flags()))
    with open(_SRC, "rb") as f:
        key = hashlib.sha256(f.read() + "|".join([version, *flags, level, host]).encode()).hexdigest()[:16]
    root = os.environ.get("PAGEDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve"))
    return os.path.join(root, "kernels", f"paged_attention-{level}-{key}.so"), flags


def _build(level: str) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: attention uses the (slower) torch gather path")
        return None
    out, flags = build_path(level, cc)
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
        os.close(fd)
        r = subprocess.run([cc, *flags, _SRC, "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("building the %s attention kernels failed, using the torch path:\n%s", level, r.stderr[-2000:])
            os.unlink(tmp)
            return None
        os.replace(tmp, out)
    # our OpenMP runtime is not torch's: let its threads sleep, not spin, between calls
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    lib = ctypes.CDLL(out)
    args = [ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 6 + [ctypes.c_float]
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = args
    lib.paged_prefill_attention.restype = None
    lib.paged_prefill_attention.argtypes = args[:8] + [ctypes.c_void_p] + args[8:]
    lib.paged_attention_isa.restype = ctypes.c_char_p
    lib.paged_attention_set_threads.argtypes = [ctypes.c_int]
    lib.paged_attention_set_threads(torch.get_num_threads())
    return lib


def load(level: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for `level` (default: PAGEDSERVE_KERNEL_ISA, else the host's best level)."""
    global _default
    if level is None and _default is not None:
        return _libs[_default]
    name = level or os.environ.get("PAGEDSERVE_KERNEL_ISA") or host_levels()[0]
    if name not in host_levels():
        raise ValueError(f"PAGEDSERVE_KERNEL_ISA / level {name!r}: this CPU runs {host_levels()} "
                         f"(of {list(LEVELS)})")
    if name not in _libs:
        lib = None
        if os.environ.get("PAGEDSERVE_ATTENTION", "native") != "torch":
            try:
                lib = _build(name)
            except OSError as e:
                log.warning("cannot load the %s attention kernels (%s): using the torch path", name, e)
        _libs[name] = lib
    if level is None:
        _default = name
        if _libs[name] is not None:
            log.info("attention kernels: %s build (%s)", name, os.path.basename(_libs[name]._name))
    return _libs[name]


def set_threads(n: int) -> None:
    for lib in _libs.values():
        if lib is not None:
            lib.paged_attention_set_threads(n)


def supports(head_dim: int, n_heads: int, n_kv: int) -> bool:
    """Shapes the kernels take: head_dim a multiple of 16 up to 256, whole GQA groups."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 256 and n_heads % n_kv == 0


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q: (D, n_heads, hd) float32 contiguous; caches (num_blocks, bs, n_kv, hd) float32 | bfloat16 | int8
    (int8 with (num_blocks, bs, n_kv) float32 scales); block_tables (D, max_blocks) int64;
    context_lens (D,) int64 -> out (D, n_heads, hd), written in place when given."""
    lib = lib or load()
    D, nh, hd = q.shape
    _, bs, n_kv, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    lib.paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _ptr(k_scale), _ptr(v_scale),
                               KV_CODES[k_cache.dtype], block_tables.data_ptr(), context_lens.data_ptr(),
                               out.data_ptr(), D, nh, n_kv, hd, bs, block_tables.shape[1], scale)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_tables: torch.Tensor,
                            cu_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Every prefill chunk of a step in one call. q: (T, n_heads, hd) float32 contiguous, chunk p in rows
    cu_q[p]:cu_q[p+1] (int64, P+1), the last rows of its context_lens[p] positions; block_tables (P, max_blocks)."""
    lib = lib or load()
    T, nh, hd = q.shape
    _, bs, n_kv, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    lib.paged_prefill_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _ptr(k_scale), _ptr(v_scale),
                                KV_CODES[k_cache.dtype], block_tables.data_ptr(), cu_q.data_ptr(),
                                context_lens.data_ptr(), out.data_ptr(), block_tables.shape[0], nh, n_kv, hd, bs,
                                block_tables.shape[1], scale)
    return out
