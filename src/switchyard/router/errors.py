"""Errors the router answers itself, always in the OpenAI error shape."""

from __future__ import annotations

import orjson

from switchyard.core.errors import APIError


class RouterError(APIError):
    """Raised anywhere on the data path; turned into one JSON error response."""


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
