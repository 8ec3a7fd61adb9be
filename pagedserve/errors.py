"""Errors that name what was wrong. Plain Python: the scheduler and the server share them."""
from __future__ import annotations


class ParamError(ValueError):
    """A request field is invalid. `param` names it; the server answers 400 with it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The engine can no longer step (its state is unknown after a fault outside a request's step).
    Every request in flight fails with it; a server reports unhealthy and exits so it is restarted."""
