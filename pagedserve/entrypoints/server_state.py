"""What every route shares, apart from the app that serves them: one ServerState per app
(app.state.server). The routes import this module, never server.py (which builds the app and imports
the routes), so the entrypoints have no import cycle."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.metrics import ServerMetrics


@dataclass(slots=True)
class ServerState:
    """What the routes share: one per app (app.state.server)."""

    engine: LLMEngine
    aengine: AsyncLLMEngine
    metrics: ServerMetrics
    model_name: str               # the first served name: the one responses report
    draining: bool = False        # SIGTERM received: new requests get 503, in-flight ones finish
    chat_template: str | None = None      # --chat-template: replaces the model's own
    tool_call_parser: str | None = None   # --tool-call-parser with --enable-auto-tool-choice: tool_choice "auto"
    reasoning_parser: str | None = None   # --reasoning-parser: <think>...</think> -> reasoning_content
    recorder: object = None               # the dashboard's StateRecorder (steps, latencies)
    responses: object = None              # /v1/responses' bounded ResponseStore (made on first use)
    system_fingerprint: str = ""          # OpenAI's field on chat and text completions (system_fingerprint())
    served_model_names: tuple[str, ...] = ()   # --served-model-name: every name a request's `model` may give


def served_names(names, default: str) -> tuple[str, ...]:
    """--served-model-name as vLLM takes it: one name or several (aliases; the first is the one responses
    report and /v1/models lists first), None or empty: `default` (the model's name). ValueError names the
    field on an empty name."""
    if names is None or isinstance(names, str):
        names = [] if not names else [names]
    out: list[str] = []
    for n in names:
        if not isinstance(n, str) or not n.strip():
            raise ValueError(f"served_model_name: {n!r} is not a model name")
        if n not in out:
            out.append(n)
    return tuple(out) or (default,)


def system_fingerprint(engine: LLMEngine) -> str:
    """What OpenAI's `system_fingerprint` stands for: the backend configuration that decides the outputs.
    Stable across restarts of the same version on the same model and numeric flags; any of them changing
    changes it (a client comparing fingerprints learns that outputs may differ)."""
    from pagedserve import __version__
    a = engine.args
    key = "|".join(map(str, (__version__, engine.info.model_name, engine.info.model_path, a.dtype, a.quantization,
                              a.kv_cache_dtype, a.tensor_parallel_size)))
    return "fp_pagedserve-" + hashlib.sha256(key.encode()).hexdigest()[:10]
