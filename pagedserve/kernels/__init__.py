"""Native CPU kernels, built with the system C compiler on first use and cached on disk.

Only one for now: decode attention that reads K/V through the block tables without gathering a
copy of each context. Without a compiler (or with PAGEDSERVE_ATTENTION=torch) the torch path in
pagedserve.model.attention is used instead; both are tested against each other."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

log = logging.getLogger("pagedserve")
_SRC = os.path.join(os.path.dirname(__file__), "paged_attention.c")
_lib = None
_tried = False


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: decode attention uses the (slower) torch gather path")
        return None
    src = open(_SRC, "rb").read()
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]
    key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    root = os.environ.get("PAGEDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve"))
    out = os.path.join(root, "kernels", f"paged_attention-{key}.so")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
        os.close(fd)
        r = subprocess.run([cc, *flags, _SRC, "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            log.warning("building the paged attention kernel failed, using the torch path:\n%s", r.stderr[-2000:])
            os.unlink(tmp)
            return None
        os.replace(tmp, out)
    # our OpenMP runtime is not torch's: let its threads sleep, not spin, between calls
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    lib = ctypes.CDLL(out)
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float]
    return lib


def native_lib() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("PAGEDSERVE_ATTENTION", "native") != "torch":
            try:
                _lib = _build()
            except OSError as e:
                log.warning("cannot load the paged attention kernel (%s): using the torch path", e)
    return _lib


def decode_scratch(num_seqs: int, n_heads: int, max_blocks: int, block_size: int) -> torch.Tensor:
    """Softmax scratch for one step's decode attention; every layer of the step reuses it."""
    return torch.empty(num_seqs * n_heads * max_blocks * block_size, dtype=torch.float32)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> torch.Tensor:
    """q: (D, n_heads, hd) fp32 contiguous -> out (D, n_heads, hd), written in place when given."""
    lib = _lib
    D, nh, hd = q.shape
    nb, bs, n_kv, _ = k_cache.shape
    maxb = block_tables.shape[1]
    out = torch.empty_like(q) if out is None else out
    scores = decode_scratch(D, nh, maxb, bs) if scores is None else scores
    lib.paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                               context_lens.data_ptr(), out.data_ptr(), scores.data_ptr(), D, nh, n_kv, hd, bs,
                               maxb, scale)
    return out
