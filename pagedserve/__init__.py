"""pagedserve: a readable LLM inference and serving engine built on PagedAttention and continuous batching.

The names below load on first use, so `import pagedserve.core` (plain Python: scheduler, KV-cache
manager) never imports torch or transformers."""
from __future__ import annotations

import importlib
import os
import sys

# How long an idle OpenMP thread (torch's libgomp, which the native kernels share) spins before it
# sleeps: libgomp's default of 300,000 rounds holds a core for milliseconds after each parallel region,
# and when anything else wants that core (a second engine, a client, the server's own threads) a
# kernel waits whole scheduler slices for its spinning partner (a decode attention call: 36 us alone,
# 20 ms beside a second such process; 1,000 rounds: 22 us and 0.2 ms; BENCHMARKS.md). libgomp reads
# it once, when torch loads it: so it is set only before torch is imported, never over the user's own.
GOMP_SPINCOUNT = "1000"
OPENMP_WAIT_SET = ("torch" not in sys.modules and "GOMP_SPINCOUNT" not in os.environ
                   and "OMP_WAIT_POLICY" not in os.environ)
if OPENMP_WAIT_SET:
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT

_EXPORTS = {
    "EngineArgs": "pagedserve.config", "LLM": "pagedserve.engine.llm", "LLMEngine": "pagedserve.engine.llm_engine",
    "CompletionOutput": "pagedserve.engine.outputs", "RequestOutput": "pagedserve.engine.outputs",
    "SamplingParams": "pagedserve.sampling_params", "BeamSearchParams": "pagedserve.sampling_params",
    "PoolingParams": "pagedserve.sampling_params", "EmbeddingRequestOutput": "pagedserve.engine.outputs",
    "LoRARequest": "pagedserve.lora_request",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
