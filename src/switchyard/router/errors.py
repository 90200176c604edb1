"""Errors the router answers itself: in the OpenAI error shape, or Anthropic's on the
Messages route, so each SDK surfaces the message as its own error class."""

from __future__ import annotations

import orjson

from switchyard.core.errors import APIError


class RouterError(APIError):
    """Raised anywhere on the data path; turned into one JSON error response."""

    def anthropic_body(self) -> bytes:
        return anthropic_error_body(self.status, self.message)


# Anthropic's error types by status (``{"type": "error", "error": {"type", "message"}}``).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    """The Anthropic error shape; a 5xx without a type of its own is an ``api_error``."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def engine_error_body(body: bytes) -> bytes:
    """An engine's JSON error with its ``code`` typed as OpenAI types it (string or null).

    vLLM answers ``"code": 400`` (the HTTP status as a number), which OpenAI clients do
    not expect; anything that is not such an error passes unchanged.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or "code" not in error:
        return body
    code = error["code"]
    if code is None or isinstance(code, str):
        return body
    error["code"] = str(code)
    return orjson.dumps(data)
