"""The errors every route answers with: RequestError (a 4xx/5xx naming the field at fault) and OpenAI's
error JSON, or Anthropic's on its Messages API's paths. Kept apart from server.py (the app's life
cycle) so that what routes and the CLI import does not pull in the engine."""
from __future__ import annotations

from starlette.responses import JSONResponse   # (fastapi.responses re-exports it; starlette alone imports faster)


class RequestError(Exception):
    """An error answered to the client in OpenAI's error JSON; `param` names the field at fault, `code`
    is OpenAI's string code where it has one (else null: OpenAI's spec types it string or null)."""

    def __init__(self, param: str | None, message: str, status: int = 400, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.param, self.message, self.status, self.type, self.code = param, message, status, type_, code


def error_body(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    # `status` is the HTTP status; OpenAI's error code is a string or null, never the status
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's error types by HTTP status (its SDK picks the exception class by the status)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   headers: dict | None = None, code: str | None = None, path: str = "") -> JSONResponse:
    """`path`: the request's; on the Messages API's, the body is Anthropic's error shape."""
    body = anthropic_error_body(status, message) if path.startswith(ANTHROPIC_PATHS) else \
        error_body(status, message, param, type_, code)
    return JSONResponse(body, status_code=status, headers=headers)
