"""OpenAI-style errors: one exception type carrying status, message, param and code, rendered as

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Errors from workers arrive as an `ErrorCode` on the final TokenEvent and map to an HTTP status here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.protocol.messages import ErrorCode

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "is not supported by this server") -> APIError:
    return APIError(400, f"'{param}' {detail}", param=param, code="unsupported_parameter")


def too_many_requests(limit: int) -> APIError:
    return APIError(429, f"the gateway already has {limit} requests in flight; retry shortly",
                    type="rate_limit_error", code="rate_limit_exceeded", retry_after=1)


def service_unavailable(message: str, code: str = "service_unavailable", retry_after: int = 1) -> APIError:
    return APIError(503, message, type="service_unavailable", code=code, retry_after=retry_after)


# ErrorCode from a worker → (HTTP status, error type, code string, Retry-After)
_WORKER_ERRORS: dict[ErrorCode, tuple[int, str, str, int | None]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error", "bad_request", None),
    ErrorCode.OVERLOADED: (503, "service_unavailable", "overloaded", 1),
    ErrorCode.KV_TRANSFER_FAILED: (500, "server_error", "kv_transfer_failed", None),
    ErrorCode.WORKER_LOST: (503, "service_unavailable", "worker_lost", 1),
    ErrorCode.TIMEOUT: (504, "timeout_error", "timeout", None),
    ErrorCode.CANCELLED: (500, "server_error", "cancelled", None),
    ErrorCode.INTERNAL: (500, "server_error", "internal_error", None),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable", "unavailable", 1),
}


def from_error_code(code: ErrorCode, message: str) -> APIError:
    status, type_, code_str, retry_after = _WORKER_ERRORS.get(code, (500, "server_error", "internal_error", None))
    return APIError(status, message or code_str, type=type_, code=code_str, retry_after=retry_after)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's first complaint as a 400 naming the field: param = the top-level field, the
    message shows the full path (union branch tags such as 'list[str]' left out)."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    loc = [p for p in loc if isinstance(p, int) or not (p in _TYPE_TAGS or "[" in p or "-" in p)]
    param = str(loc[0]) if loc else None
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc))
    if first.get("type") == "missing":
        message = f"'{path}' is required"
    elif path:
        message = f"'{path}': {str(first.get('msg', 'invalid value')).removeprefix('Value error, ')}"
    else:
        message = str(first.get("msg", "invalid request body"))
    return bad_request(message, param=param)


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the server in the OpenAI shape, whoever raised it."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error",
                        code="internal_error").response()
