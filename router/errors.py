"""Errors the router answers itself, always in the OpenAI error shape."""

from __future__ import annotations

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class RouterError(Exception):
    """Raised anywhere on the data path; turned into one JSON error response."""

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


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(
                    status, "server_error" if status >= 500 else "invalid_request_error"
                ),
                "param": param,
                "code": code if code is not None else status,
            }
        }
    )
