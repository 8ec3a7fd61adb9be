"""Errors that name what was wrong. Plain Python: the scheduler and the server share them."""
from __future__ import annotations


# OpenAI's error code for a prompt (or a prompt + max_tokens) longer than the model's context
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ParamError(ValueError):
    """A request field is invalid. `param` names it; the server answers 400 with it, and with `code`
    where OpenAI has one for the error (CONTEXT_LENGTH_EXCEEDED)."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The engine can no longer step (its state is unknown after a fault outside a request's step).
    Every request in flight fails with it; a server reports unhealthy and exits so it is restarted."""
