"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, for every failure the server
answers, including FastAPI's own (404, 405, validation) and unexpected exceptions (500)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a malformed or out-of-range parameter."""
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    """A 400 for a parameter this server refuses rather than silently ignores."""
    return APIError(400, message, param=param, code="unsupported_parameter")


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code).response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return bad_request(f"invalid request: {exc.errors()}").response()


async def _server_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("serve: unexpected error")
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error on ``app`` in the OpenAI shape (clients parse ``error.message``)."""
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _server_error)
