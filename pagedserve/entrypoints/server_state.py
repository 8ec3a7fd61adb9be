"""What every route shares, apart from the app that serves them: one ServerState per app
(app.state.server). The routes import this module, never server.py (which builds the app and imports
the routes), so the entrypoints have no import cycle."""
from __future__ import annotations

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
    model_name: str
    draining: bool = False        # SIGTERM received: new requests get 503, in-flight ones finish
    chat_template: str | None = None      # --chat-template: replaces the model's own
    tool_call_parser: str | None = None   # --tool-call-parser with --enable-auto-tool-choice: tool_choice "auto"
    reasoning_parser: str | None = None   # --reasoning-parser: <think>...</think> -> reasoning_content
    recorder: object = None               # the dashboard's StateRecorder (steps, latencies)
    responses: object = None              # /v1/responses' bounded ResponseStore (made on first use)
