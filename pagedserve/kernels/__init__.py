"""Native CPU kernels, built with the system C compiler on first use and cached on disk.

paged_attention.c: decode and prefill attention that read K/V in place through the block tables,
in every KV cache format (float32, bfloat16, int8 + per-token scales).
qmatmul.c: products with quantized weights (GGUF blocks, per-channel int8), see pagedserve.model.quant.
layer_ops.c: a float32 decoder layer's work between its products (RMSNorm with the residual add, RoPE with
the K/V write, SiLU x up), one call each.
Each source is compiled per ISA level the host runs (avx512 = x86-64-v4, avx2 = x86-64-v3, generic);
the best one is loaded. The builds and their cache key are pagedserve.native_build's (no torch there: the
CLI starts a cold start's builds before its imports). Without a compiler (or with
PAGEDSERVE_ATTENTION=torch) the torch paths in pagedserve.model.attention are used instead; tests run every
level the host supports against them."""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from pagedserve.native_build import (LEVELS, SOURCES, build_lock, build_path, compile_source,  # noqa: F401
                                     compiler, cpu_flags, host_levels, prebuild)    # (LEVELS.. prebuild: re-exported)

log = logging.getLogger("pagedserve")
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
KV_BF16_DOT = 3      # a bf16 cache whose prefill attention multiplies in bf16 (bf16_dots)
_libs: dict[tuple[str, str], ctypes.CDLL | None] = {}     # (source, level) -> library
_default: str | None = None          # the level load() gives when none is named (resolved once)


def _declare(lib: ctypes.CDLL, source: str) -> None:
    """ctypes signatures of a library's entry points."""
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    if source == "paged_attention":
        args = [p] * 5 + [i] + [p] * 3 + [i] * 6 + [f, i]
        lib.paged_decode_attention.argtypes = args
        lib.paged_prefill_attention.argtypes = args[:8] + [p] + args[8:]
    elif source == "qmatmul":
        lib.qmatmul.argtypes = lib.qmatmul_q8.argtypes = [p, i, i, i, p, i, i, i64, p, i]
        lib.qmatmul_q8_isa.restype = ctypes.c_char_p
        lib.qdequant.argtypes = [p, i, i, i64, p, i, p, i]
    else:
        lib.add_rms_norm.argtypes = [p] * 5 + [i, i, f]
        lib.rope_kv.argtypes = [p, i, p, p, i, p, p, p, p, p, i, p, i, i, i, i]
        lib.silu_mul.argtypes = [p, i, p, i, i]
        lib.decode_layers.argtypes = [p, p, i, p, p, i, p, p, i, p, i, p]
        lib.decode_layers.restype = i
    for name in ("paged_decode_attention", "paged_prefill_attention", "qmatmul", "qmatmul_q8", "qdequant",
                 "add_rms_norm", "rope_kv", "silu_mul"):
        if hasattr(lib, name):
            getattr(lib, name).restype = None
    getattr(lib, f"{source}_isa").restype = ctypes.c_char_p
    lib.set_threads = getattr(lib, f"{source}_set_threads")
    lib.set_threads.argtypes = [i]
    lib.set_threads(torch.get_num_threads())


def _build(level: str, source: str) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: %s uses the (slower) torch path", source)
        return None
    out, flags = build_path(level, cc, source)
    with build_lock(out):              # a build started by prebuild: wait for it rather than build twice
        if not compile_source(cc, out, flags, level, source):
            return None
    # -fopenmp links libgomp.so.1, which torch has already loaded: the kernels share torch's OpenMP pool
    # (and its wait policy, read when torch was imported; setting OMP_WAIT_POLICY here would only reach
    # child processes: PASSIVE made a one-row step 1.45x slower on 2 cores)
    lib = ctypes.CDLL(out)
    _declare(lib, source)
    return lib


def load(level: str | None = None, source: str = "paged_attention") -> ctypes.CDLL | None:
    """The `source` kernels built for `level` (default: PAGEDSERVE_KERNEL_ISA, else the host's best
    level, resolved once for every source)."""
    global _default
    if level is None and (source, _default) in _libs:        # the per-call path: one dict lookup
        return _libs[(source, _default)]
    name = level or _default or os.environ.get("PAGEDSERVE_KERNEL_ISA") or host_levels()[0]
    if name not in host_levels():
        raise ValueError(f"PAGEDSERVE_KERNEL_ISA / level {name!r}: this CPU runs {host_levels()} "
                         f"(of {list(LEVELS)})")
    if (source, name) not in _libs:
        lib = None
        if source != "paged_attention" or os.environ.get("PAGEDSERVE_ATTENTION", "native") != "torch":
            try:
                lib = _build(name, source)
            except OSError as e:
                log.warning("cannot load the %s %s kernels (%s): using the torch path", name, source, e)
        _libs[(source, name)] = lib
        if level is None and lib is not None:
            log.info("%s kernels: %s build (%s)", source, name, os.path.basename(lib._name))
    if level is None:
        _default = name
    return _libs[(source, name)]


def native_prefill_pays() -> bool:
    """Whether prefill chunks take the native kernel (else SDPA over each gathered context). Its tiles
    keep 48 query lanes in 16-float vectors: one register each with AVX-512, two and spills below it.
    Measured on an AVX2 host (2 cores, 9 heads of 64, float32 KV): 256 queries over 256 keys 17.5 ms
    native vs 2.4 ms SDPA per layer, 1 query over 300 keys 2.8 vs 0.5 ms. PAGEDSERVE_PREFILL_ATTENTION=
    native|torch decides instead."""
    forced = os.environ.get("PAGEDSERVE_PREFILL_ATTENTION")
    if forced in ("native", "torch"):
        return forced == "native"
    return (_default or host_levels()[0]).startswith("avx512")


def bf16_dots(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the prefill attention kernel multiplies in bf16 when asked (KV_BF16_DOT): an AVX-512 build
    on a host with AVX512-BF16 (vdpbf16ps: 32 multiply-adds an instruction, a float32 FMA's 16). It rounds
    the queries and the softmax's probabilities to bf16, so it is asked for only where the model computes
    in bf16 (the runner's choice); a float32 model keeps the float32 kernel and its exactness."""
    lib = lib or load()
    return lib is not None and bool(lib.paged_attention_bf16_dots())


def prefill_kv_code(cache_dtype: torch.dtype, dots: bool) -> int:
    """The format code prefill attention gets for a cache of this dtype (KV_BF16_DOT: bf16 products)."""
    return KV_BF16_DOT if dots and cache_dtype == torch.bfloat16 else KV_CODES[cache_dtype]


def set_threads(n: int) -> None:
    for lib in _libs.values():
        if lib is not None:
            lib.set_threads(n)


def supports(head_dim: int, n_heads: int, n_kv: int) -> bool:
    """Shapes the kernels take: head_dim a multiple of 16 up to 256, whole GQA groups."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 256 and n_heads % n_kv == 0


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           lib: ctypes.CDLL | None = None, window: int = 0) -> torch.Tensor:
    """q: (D, n_heads, hd) float32 contiguous; caches (num_blocks, bs, n_kv, hd) float32 | bfloat16 | int8
    (int8 with (num_blocks, bs, n_kv) float32 scales); block_tables (D, max_blocks) int64;
    context_lens (D,) int64 -> out (D, n_heads, hd), written in place when given. window > 0: each query
    sees only the last `window` positions (a sliding-window layer)."""
    lib = lib or load()
    D, nh, hd = q.shape
    _, bs, n_kv, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    lib.paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _ptr(k_scale), _ptr(v_scale),
                               KV_CODES[k_cache.dtype], block_tables.data_ptr(), context_lens.data_ptr(),
                               out.data_ptr(), D, nh, n_kv, hd, bs, block_tables.shape[1], scale, window)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, block_tables: torch.Tensor,
                            cu_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, lib: ctypes.CDLL | None = None,
                            window: int = 0, bf16_dots: bool = False) -> torch.Tensor:
    """Every prefill chunk of a step in one call. q: (T, n_heads, hd) float32 contiguous, chunk p in rows
    cu_q[p]:cu_q[p+1] (int64, P+1), the last rows of its context_lens[p] positions; block_tables (P, max_blocks).
    bf16_dots: with a bf16 cache, the products in bf16 where the host has them (see bf16_dots())."""
    lib = lib or load()
    T, nh, hd = q.shape
    _, bs, n_kv, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    lib.paged_prefill_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _ptr(k_scale), _ptr(v_scale),
                                prefill_kv_code(k_cache.dtype, bf16_dots), block_tables.data_ptr(), cu_q.data_ptr(),
                                context_lens.data_ptr(), out.data_ptr(), block_tables.shape[0], nh, n_kv, hd, bs,
                                block_tables.shape[1], scale, window)
    return out


def add_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, y: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (T, H) contiguous: r = x + y (or x when y is None) and w * rmsnorm(r); returns (r, normed)."""
    lib = lib or load(source="layer_ops")
    T, H = x.shape
    r = x if y is None else torch.empty_like(x)
    out = torch.empty_like(x)
    lib.add_rms_norm(x.data_ptr(), _ptr(y), _ptr(None if y is None else r), w.data_ptr(), out.data_ptr(), T, H, eps)
    return r, out


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, k_cache: torch.Tensor,
            v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            slot_mapping: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
            lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """qkv (T, (n_heads + 2 n_kv) x head_dim) float32 with unit column stride; cos, sin (T, 1, rot) float32
    (None: no RoPE); caches (num_blocks, bs, n_kv, head_dim) in KV_CODES' formats. RoPE on q and k, k and v
    written to slot_mapping's slots; returns q rotated, (T, n_heads, head_dim) contiguous."""
    lib = lib or load(source="layer_ops")
    T = qkv.shape[0]
    q = torch.empty(T, n_heads, head_dim, dtype=torch.float32)
    rot = 0 if cos is None else cos.shape[-1]
    lib.rope_kv(qkv.data_ptr(), qkv.stride(0), _ptr(cos), _ptr(sin), rot, q.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), _ptr(k_scale), _ptr(v_scale), KV_CODES[k_cache.dtype], slot_mapping.data_ptr(),
                T, n_heads, n_kv, head_dim)
    return q


def silu_mul(gate_up: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """(T, 2 I) float32, unit column stride -> silu(gate) * up, (T, I)."""
    lib = lib or load(source="layer_ops")
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=torch.float32)
    lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), T, I2 // 2)
    return out


# ---------------------------------------------------------------- layer_ops.decode_layers' structures
class PackedProduct(ctypes.Structure):
    """packed_t: one packed product (model/quant.PackedWeight) and its bias."""
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("fmt", ctypes.c_int32), ("N", ctypes.c_int32), ("next", ctypes.c_void_p)]


class LoRAProduct(ctypes.Structure):
    """lora_t: one product's LoRA slots (model/lora.py LoRASlots): A, each part's B and width."""
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p * 3), ("out", ctypes.c_int32 * 3),
                ("parts", ctypes.c_int32)]


class DecodeLayer(ctypes.Structure):
    """dlayer_t: one layer's norm weights, products and K/V planes, and its products' LoRA slots."""
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", PackedProduct),
                ("o", PackedProduct), ("gate_up", PackedProduct), ("down", PackedProduct),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("window", ctypes.c_int32), ("pad_", ctypes.c_int32),
                ("lora", ctypes.c_void_p * 4)]


class DecodeStack(ctypes.Structure):
    """dstack_t: the layers, the product and attention kernels (function pointers), the model's shape."""
    _fields_ = [("layers", ctypes.c_void_p), ("qmm", ctypes.c_void_p), ("attn", ctypes.c_void_p),
                *((name, ctypes.c_int32) for name in ("L", "H", "nh", "nkv", "hd", "I", "block_size", "kv")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("prof", ctypes.c_void_p),
                ("row_slot", ctypes.c_void_p), ("max_loras", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("pattn", ctypes.c_void_p)]


class Chunks(ctypes.Structure):
    """chunks_t: a step's prefill chunks for decode_layers (AttentionMetadata's prefill_* tensors)."""
    _fields_ = [("block_tables", ctypes.c_void_p), ("cu_q", ctypes.c_void_p), ("context_lens", ctypes.c_void_p),
                ("n", ctypes.c_int32), ("max_blocks", ctypes.c_int32), ("kv", ctypes.c_int32),
                ("pad_", ctypes.c_int32)]


def function_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of a library's C function, to pass to another library's kernel."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
