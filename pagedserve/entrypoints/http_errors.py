"""The errors every route answers with: RequestError (a 4xx/5xx naming the field at fault) and OpenAI's
error JSON. Kept apart from server.py (the app's life cycle) so that what routes and the CLI import
does not pull in the engine."""
from __future__ import annotations

from starlette.responses import JSONResponse   # (fastapi.responses re-exports it; starlette alone imports faster)


class RequestError(Exception):
    """An error answered to the client in OpenAI's error JSON; `param` names the field at fault."""

    def __init__(self, param: str | None, message: str, status: int = 400, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.message, self.status, self.type = param, message, status, type_


def error_body(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type_), status_code=status, headers=headers)
