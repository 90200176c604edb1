"""The mock engine's raw-ASGI plumbing: reading bodies, answering, client errors, lifespan.

The mock speaks ASGI without a framework so it is never a benchmark's bottleneck. It
shares no protocol code with the router or the kvstore on purpose: an independent
implementation keeps a wire mismatch between them from hiding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from switchyard.mock import openai_shapes as shapes

JSON = b"application/json"
SSE = b"text/event-stream"
TEXT = b"text/plain"


class ClientError(Exception):
    """A request the engine refuses: answered with ``status`` in the OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        parts.append(message.get("body", b""))
    return b"".join(parts)


async def json_body(receive: Receive) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 ``ClientError``."""
    raw = await read_body(receive)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ClientError(400, f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ClientError(400, "request body must be a JSON object")
    return data


async def respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = JSON,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send one complete (non-streamed) response."""
    all_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        all_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def respond_error(
    send: Send, exc: ClientError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = shapes.error_body(exc.status, str(exc), exc.param)
    await respond(send, exc.status, body, JSON, headers)


async def guard(send: Send, work: Callable[[], Awaitable[tuple[int, bytes]]]) -> None:
    """Run a JSON endpoint's ``work`` and answer its result, or its ``ClientError``."""
    try:
        status, body = await work()
    except ClientError as exc:
        await respond_error(send, exc)
        return
    await respond(send, status, body)


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def not_found(scope: Scope, send: Send, status: int = 404) -> None:
    await respond(send, status, shapes.error_body(status, f"{scope['path']}: not found"))


async def lifespan(receive: Receive, send: Send) -> None:
    """Engines are started by the launcher, so lifespan only acknowledges."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
