"""The OpenAI error shape, for every error a Switchyard service answers itself.

``{"error": {"message", "type", "param", "code"}}`` with ``code`` a string or null,
so OpenAI clients surface the message whichever service (router, balancer, kvstore)
refused the request. ``type`` is one of OpenAI's: any 5xx is a ``server_error``.
"""

from __future__ import annotations

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


class APIError(Exception):
    """An error answered in the OpenAI shape, with its status and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> Response:
        return Response(
            self.body(),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def install_error_handlers(app: FastAPI) -> None:
    """Answer FastAPI's own errors (unknown route, bad body) and ``APIError`` in one shape.

    A body or parameter that fails validation is a 400, as OpenAI answers it.
    """

    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return APIError(exc.status_code, str(exc.detail), headers=headers).response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(400, f"Invalid request: {first.get('msg', exc)}", param=param).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
