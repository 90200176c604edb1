"""Client connections bounded in time and number, on top of uvicorn's httptools protocol.

uvicorn closes a connection idle after a response (``timeout_keep_alive``) and can
refuse over a concurrency limit with a plain-text 503, but it has no deadline for a
request's head or body: a client that connects and sends nothing, or trickles its
headers, holds a file descriptor for ever. This protocol adds both deadlines and a
connection cap answered in the OpenAI error shape:

- the request head must be complete within ``header_timeout_s`` of the connection
  opening (or of the request's first byte on a kept-alive connection), else 408 and close;
- the body must be complete within ``body_timeout_s`` of the head, else the
  connection is closed (the router sees the client gone and aborts the request);
- beyond ``max_connections`` open connections, each request is answered 503
  (``too_many_connections``) and its connection closed;
- a request head still incomplete after ``max_header_bytes`` is answered 431 and its
  connection closed as the bytes arrive. httptools has no head limit of its own (nor do
  uvicorn's options for it: ``h11_max_incomplete_event_size`` applies to h11 only), and it
  holds a header's bytes until the header ends, so the app's own 431 came only after the
  whole head was buffered. Measured 2026-12-01 (one 64 MiB header over a raw socket): before,
  431 after 18 s, peak RSS 90 -> 222 MB and 156 MB after; now 431 in 0.3 s, peak 91 MB.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from switchyard.errors import error_body

# How long a refused connection's remaining bytes are read and dropped before it closes.
_LINGER_S = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int  # 0: unbounded
    max_header_bytes: int
    retry_after_s: int = 1


def _raw_error(status: int, reason: bytes, message: str, code: str) -> bytes:
    body = error_body(status, message, code=code)
    return b"".join(
        (
            b"HTTP/1.1 %d %s\r\n" % (status, reason),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-switchyard-worker: none\r\n",
            b"connection: close\r\n\r\n",
            body,
        )
    )


async def _over_capacity(retry_after_s: int, scope: Any, receive: Any, send: Any) -> None:
    body = error_body(
        503, "The router has too many open connections; retry later", code="too_many_connections"
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after_s).encode()),
        (b"x-switchyard-worker", b"none"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _HeadWithBody:
    """The transport as one response's cycle sees it: the response head is held back and
    written with the first body bytes, one send where uvicorn makes two. On loopback a send
    costs the receiver's TCP work too; measured 2026-12-03 (py-spy, wrk against nginx
    through one router process) uvicorn's ``send`` was half the busy time, all but a
    sliver of it in its two writes."""

    __slots__ = ("transport", "held")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self.held
        if held is None:
            head = data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 ")
            if head and not self.transport.is_closing():
                self.held = data  # the head: it waits for the body's first write
                return
            self.transport.write(data)
            return
        self.held = b""
        self.transport.write(held + data if held else data)

    def close(self) -> None:
        if self.held:
            self.transport.write(self.held)
            self.held = b""
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines and a connection cap; each
    response's head goes out with its first body bytes (``_HeadWithBody``)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        # Bytes received since the current request head began (None: its head is complete;
        # -1: refused as too large).
        # Counted per read, so a read that also carries body bytes may count them: only a
        # head still incomplete after the read is refused.
        self._head_bytes: int | None = 0

    def _arm(self, seconds: float, expired: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._head_too_slow)

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is None:
            super().data_received(data)
            return
        if self._head_bytes < 0:  # refused: the rest is read and dropped while we linger
            return
        self._head_bytes += len(data)
        super().data_received(data)
        if self._head_bytes is not None and self._head_bytes > self.limits.max_header_bytes:
            self._head_too_large()

    def _head_too_large(self) -> None:
        """431, then a lingering close: our side is shut at once, the client's bytes are
        read and dropped for ``_LINGER_S`` (closing with them unread would reset the
        connection, and the client could lose the 431)."""
        self._head_bytes = -1
        if self.transport.is_closing():
            return
        self.transport.write(
            _raw_error(
                431,
                b"Request Header Fields Too Large",
                f"Request headers exceed {self.limits.max_header_bytes} bytes",
                "headers_too_large",
            )
        )
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(_LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:
            self._arm(self.limits.header_timeout_s, self._head_too_slow)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._arm(self.limits.body_timeout_s, self._body_too_slow)
        cap = self.limits.max_connections
        if not cap or len(self.connections) <= cap:
            super().on_headers_complete()
        else:
            app = self.app
            self.app = functools.partial(_over_capacity, self.limits.retry_after_s)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        if self.cycle is not None:
            self.cycle.transport = _HeadWithBody(self.transport)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        self._disarm()
        self._head_bytes = 0
        super().on_message_complete()

    def _head_too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.write(
                _raw_error(
                    408,
                    b"Request Timeout",
                    f"The request head did not arrive within {self.limits.header_timeout_s:g} s",
                    "request_timeout",
                )
            )
            self.transport.close()

    def _body_too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
