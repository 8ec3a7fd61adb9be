"""pagedserve: a readable LLM inference and serving engine built on PagedAttention and continuous batching.

The names below load on first use, so `import pagedserve.core` (plain Python: scheduler, KV-cache
manager) never imports torch or transformers."""
from __future__ import annotations

import importlib

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
