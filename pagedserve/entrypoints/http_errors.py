"""The errors every route answers with: RequestError (a 4xx/5xx naming the field at fault) and OpenAI's
error JSON. Kept apart from server.py (the app's life cycle) so that what routes and the CLI import
does not pull in the engine."""
from __future__ import annotations

from starlette.responses import JSONResponse   # (fastapi.responses re-exports it; starlette alone imports faster)


class RequestError(Exception):
    """An error answered to the client in OpenAI's error JSON; `param` names the field at fault, `code`
    is OpenAI's string code where it has one (else the body's code is the status)."""

    def __init__(self, param: str | None, message: str, status: int = 400, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.param, self.message, self.status, self.type, self.code = param, message, status, type_, code


def error_body(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status if code is None else code}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   headers: dict | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type_, code), status_code=status, headers=headers)
