"""Client connections: HTTP/1.1 parsed by httptools, each request one ASGI call, bounded in
time and number.

The router's own protocol in place of uvicorn's httptools one; uvicorn still owns the
listening sockets, the processes, lifespan and shutdown (it makes this protocol through
``Config(http=...)``, and shuts connections down through ``shutdown``). uvicorn's
protocol costs about twice the CPU of a bare httptools protocol a request, and was the
largest piece of the router's own Python after the two loopback sends
(``docs/decisions/0001-http-server-protocol.md``). What it does for each request here
and no more: the scope, the body as it arrives, the response head held back and
written with the first body bytes (one send where there would be two),
``Content-Length`` or chunked framing, keep-alive, pipelining in order, write flow
control, and a client-gone callback (``CLIENT_GONE``) so the router needs no
task a request that waits for ``http.disconnect``.

Bounds (uvicorn has a keep-alive timeout but no deadline for a request's head or body:
a client that connects and sends nothing, or trickles its headers, would hold a file
descriptor for ever):

- the request head must be complete within ``header_timeout_s`` of the connection
  opening (or of the request's first byte on a kept-alive connection), else 408 and close;
- the body must be complete within ``body_timeout_s`` of the head, else the
  connection is closed (the router sees the client gone and aborts the request);
- a connection idle ``keep_alive_s`` after an answer is closed;
- beyond ``max_connections`` open connections, each request is answered 503
  (``too_many_connections``) and its connection closed;
- a request head (request line and headers together) beyond ``max_header_bytes`` is
  answered 414 (its URL alone is beyond it) or 431, and its connection closed, as the
  bytes arrive: httptools holds a header's bytes until the header ends, so a huge header
  left to the app would be held whole in memory and answered only once it had all arrived.

No protocol upgrades: a request with ``Upgrade`` is answered in HTTP/1.1 and the
connection goes on in HTTP/1.1 (httptools stops at an upgrade request's head, so parsing
resumes after it; one that declares a body is refused 400, because httptools leaves that
body unparsed).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote

import httptools
from starlette.types import ASGIApp, Message, Scope

from switchyard.core.errors import error_body
from switchyard.net.httpclient import PieceWriter

log = logging.getLogger("switchyard.router.connections")

# How long a refused connection's remaining bytes are read and dropped before it closes.
_LINGER_S = 2.0
# Request body bytes buffered before reading pauses until the app takes them.
_BODY_HIGH_WATER = 64 * 1024
# The scope's ``extensions`` key of ``Exchange.when_gone``: register a callback run once if
# the client goes away before its response is complete.
CLIENT_GONE = "switchyard.client_gone"
# The scope's ``extensions`` key of ``Exchange.stream_writer``: a relay's way to write the
# pieces of a streamed body from the upstream protocol's callback (``switchyard.relay``).
STREAM_WRITER = "switchyard.stream_writer"

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_STATUS_LINES = {
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in http.HTTPStatus
}
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
# Response header names found valid, each with its lowered form: the app's answers repeat
# a handful of names, so each is checked and lowered once. Past the cap a new name is
# checked each time it comes.
_VALID_NAMES: dict[bytes, bytes] = {}
_MAX_VALID_NAMES = 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# A request line's bytes besides its method and URL: two spaces, ``HTTP/1.1`` and CRLF.
_REQUEST_LINE_REST = 12


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head already answered 414/431."""


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int  # 0: unbounded
    max_header_bytes: int
    keep_alive_s: float
    retry_after_s: int = 1


def _raw_error(status: int, message: str, code: str) -> bytes:
    body = error_body(status, message, code=code)
    return b"".join(
        (
            _STATUS_LINES[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-switchyard-worker: none\r\n",
            b"connection: close\r\n\r\n",
            body,
        )
    )


async def _over_capacity(retry_after_s: int, scope: Scope, receive: Any, send: Any) -> None:
    body = error_body(
        503, "The router has too many open connections; retry later", code="too_many_connections"
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"retry-after", b"%d" % retry_after_s),
        (b"x-switchyard-worker", b"none"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Exchange:
    """One request and its response: the ASGI ``receive`` and ``send`` of one call."""

    __slots__ = (
        "conn",
        "scope",
        "body",
        "more_body",
        "body_taken",
        "event",
        "disconnected",
        "started",
        "complete",
        "keep_alive",
        "expect_100",
        "chunked",
        "length_left",
        "head",
        "gone",
    )

    def __init__(
        self, conn: ClientConnection, scope: Scope, keep_alive: bool, expect_100: bool
    ) -> None:
        self.conn = conn
        self.scope = scope
        self.body = bytearray()
        self.more_body = True  # more request body is to come from the client
        self.body_taken = False  # the app was handed the end of the body
        self.event: asyncio.Event | None = None  # made when a receive has to wait
        self.disconnected = False
        self.started = False
        self.complete = False
        self.keep_alive = keep_alive
        self.expect_100 = expect_100
        self.chunked: bool | None = None
        self.length_left = 0
        self.head = b""  # the response head, held until the first body bytes
        self.gone: Callable[[], None] | None = None

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()

    def when_gone(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once if the client goes away before the response is complete
        (at once if it has already gone)."""
        if self.disconnected:
            callback()
        elif not self.complete:
            self.gone = callback

    def lost(self) -> None:
        if self.complete:
            return
        self.disconnected = True
        self.wake()
        gone, self.gone = self.gone, None
        if gone is not None:
            gone()

    async def receive(self) -> Message:
        if self.expect_100:
            self.expect_100 = False
            if not self.conn.transport.is_closing():
                self.conn.transport.write(_CONTINUE)
        while not (self.disconnected or self.complete):
            if not self.body_taken and (self.body or not self.more_body):
                body, more = bytes(self.body), self.more_body
                self.body.clear()
                self.body_taken = not more
                return {"type": "http.request", "body": body, "more_body": more}
            self.conn.resume_reading()
            if self.event is None:
                self.event = asyncio.Event()
            self.event.clear()
            await self.event.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        conn = self.conn
        if conn.write_paused is not None and not self.disconnected:
            await asyncio.shield(conn.write_paused)
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected 'http.response.start', got {kind!r}")
            self.expect_100 = False
            # Started only once the head is built: a head refused here (a header with CR or
            # LF) is then answered 500 instead of a bare close.
            self.head = self._head(message["status"], message.get("headers", ()))
            self.started = True
            return
        if self.complete:
            raise RuntimeError(f"Unexpected {kind!r} after the response completed")
        if kind != "http.response.body":
            raise RuntimeError(f"Expected 'http.response.body', got {kind!r}")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            data = b""
        elif self.chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.length_left:
                raise RuntimeError("Response content longer than Content-Length")
            self.length_left -= len(body)
            data = body
        self._write(data)
        if not more:
            if self.length_left and self.scope["method"] != "HEAD":
                raise RuntimeError("Response content shorter than Content-Length")
            self.complete = True
            self.gone = None
            self.wake()
            conn.answered(self)

    def stream_writer(self) -> PieceWriter | None:
        """A synchronous writer of the next pieces of a started chunked response (None for
        any other): a relay hands each upstream piece to it from the upstream protocol's
        callback, without a task switch and an ASGI message each. The response still ends
        with a ``send`` of its last body message."""
        if not self.started or self.complete or not self.chunked or self.scope["method"] == "HEAD":
            return None
        return self._write_piece

    def _write_piece(self, body: bytes) -> asyncio.Future[None] | None:
        if self.disconnected or self.complete or not body:
            return None
        self._write(b"%x\r\n%s\r\n" % (len(body), body))
        return self.conn.write_paused

    def _write(self, data: bytes) -> None:
        """Response bytes to the client, after the head if it has not gone yet (one send)."""
        if self.head:
            data, self.head = self.head + data, b""
        if data:
            self.conn.transport.write(data)

    def _head(self, status: int, headers: Any) -> bytes:
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        closing = False
        if not isinstance(headers, list):
            headers = list(headers)
        # One scan of every value joined, not one per header: the check is per byte.
        if _BAD_VALUE.search(b"".join([value for _, value in headers])):
            bad = next(name for name, value in headers if _BAD_VALUE.search(value))
            raise RuntimeError(f"Invalid response header {bad!r}")
        valid = _VALID_NAMES
        for name, value in headers:
            lowered = valid.get(name)
            if lowered is None:
                if _BAD_NAME.search(name):
                    raise RuntimeError(f"Invalid response header {name!r}")
                lowered = name.lower()
                if len(valid) < _MAX_VALID_NAMES:
                    valid[name] = lowered
            name = lowered
            if name == b"content-length":
                if self.chunked is None:
                    self.length_left = int(value)
                    self.chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.length_left = 0
                self.chunked = True
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                closing = True
            parts.append(b"%s: %s\r\n" % (name, value))
        if not self.keep_alive and not closing:
            parts.append(b"connection: close\r\n")
        if self.chunked is None and self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def send_500(self) -> None:
        self.chunked, self.length_left, self.head = None, 0, b""  # a refused head's framing
        body = error_body(500, "Internal router error", code="internal_error")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})


class ClientConnection(asyncio.Protocol):
    """One client connection (``http=`` of a ``uvicorn.Config``, ``limits`` bound)."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app: ASGIApp = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.limits = limits
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.app_state = app_state
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100 = False
        self.reading: Exchange | None = None  # the request the parser is filling
        self.answering: Exchange | None = None  # the request whose app call runs
        self.pipeline: deque[tuple[Exchange, ASGIApp]] = deque()
        self.reading_paused = False
        self.write_paused: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline_kind = ""  # "": none; head, body, idle or linger
        self._due = 0.0
        self._expired: Callable[[], None] = self._close_now
        # Bytes received since the current request head began (None: its head is complete;
        # -1: refused, the rest is dropped). Counted per read, so a read that also carries
        # body bytes may count them: only a head still incomplete after the read is refused
        # on this count; one that completes is measured when the read could hold too many.
        self._head_bytes: int | None = 0
        self._measure_head = False
        # A refusal held until the answers owed before it are written.
        self._last_words: tuple[bytes, bool] | None = None

    # -- deadlines ---------------------------------------------------------------------

    def _arm(self, kind: str, seconds: float, expired: Callable[[], None]) -> None:
        """Set the connection's one deadline. Its timer is made only when none is pending
        or the new deadline comes first; one that fires early re-arms for the current one.
        Three timers a request (head, body, idle) showed in the router's profile on the
        fixed backend."""
        due = self.loop.time() + seconds
        self._deadline_kind, self._due, self._expired = kind, due, expired
        timer = self._timer
        if timer is None or due < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(due, self._expire)

    def _disarm(self) -> None:
        self._deadline_kind = ""

    def _expire(self) -> None:
        self._timer = None
        if not self._deadline_kind:
            return
        if self.loop.time() < self._due:
            self._timer = self.loop.call_at(self._due, self._expire)
            return
        self._deadline_kind = ""
        self._expired()

    def _head_too_slow(self) -> None:
        timeout = self.limits.header_timeout_s
        message = f"The request head did not arrive within {timeout:g} s"
        self._refuse(_raw_error(408, message, "request_timeout"), linger=False)

    def _refuse(self, error: bytes, *, linger: bool) -> None:
        """End the connection with ``error``, once the answers still owed to requests
        before it are written (pipelined answers go out in order); bytes that arrive from
        now on are dropped."""
        self._head_bytes = -1
        if self.transport.is_closing():
            return
        broken = self.reading
        if broken is not None and broken.more_body and not broken.complete:
            # In a request's body: that request will never be whole, so it is not owed an
            # answer of its own (one already begun is cut by the close).
            if broken is self.answering:
                if broken.started:
                    self.transport.close()
                else:
                    self._say(error, linger)
                return
            if self.pipeline and self.pipeline[-1][0] is broken:
                self.pipeline.pop()
                broken.scope["extensions"] = None  # the cycle ``_run`` would have broken
        if self.answering is not None:
            self._disarm()  # no head deadline now: a 408 would replace these last words
            self._last_words = (error, linger)
        else:
            self._say(error, linger)

    def _say(self, error: bytes, linger: bool) -> None:
        """``error``, then a close: at once, or lingering: our side is shut at once, the
        client's bytes are read and dropped for ``_LINGER_S`` (closing with them unread
        would reset the connection, and the client could lose the answer)."""
        self.transport.write(error)
        if not linger:
            self.transport.close()
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.resume_reading()  # paused while pipelined requests waited
        self._arm("linger", _LINGER_S, self.transport.close)

    def _close_now(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.connections.add(self)
        self.server = _address(self.transport.get_extra_info("sockname"))
        self.client = _address(self.transport.get_extra_info("peername"))
        self._arm("head", self.limits.header_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for exchange in (self.answering, self.reading):
            if exchange is not None:
                exchange.lost()
        for exchange, _ in self.pipeline:
            exchange.lost()
        self.answering = self.reading = None
        self.pipeline.clear()
        if self.write_paused is not None and not self.write_paused.done():
            self.write_paused.set_result(None)
        self.write_paused = None
        self.parser = None  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        head = self._head_bytes
        cap = self.limits.max_header_bytes
        if head is None:  # a head that starts in this read has at most its bytes
            self._measure_head = len(data) > cap
        else:
            if head < 0:  # refused: the rest is read and dropped while we linger
                return
            head += len(data)
            self._head_bytes = head
            self._measure_head = head > cap
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._declined_upgrade(data, upgrade.args[0])
        except (httptools.HttpParserError, _HeadRefused):
            self._invalid()
            return
        head = self._head_bytes
        if head is not None and head > cap:
            self._head_too_large()

    def _declined_upgrade(self, data: bytes, offset: int) -> None:
        """No protocol upgrades: httptools stopped after an upgrade request's head, and
        what follows it is more HTTP/1.1, unless the connection ends with this answer (as
        it does for an upgrade request with a body, which httptools leaves unparsed): then
        the rest is dropped."""
        while True:
            exchange = self.reading
            if exchange is None or not exchange.keep_alive:
                self._head_bytes = -1
                return
            data = data[offset:]
            if not data:
                return
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                offset = upgrade.args[0]
            except (httptools.HttpParserError, _HeadRefused):
                self._invalid()
                return

    def _invalid(self) -> None:
        if self._head_bytes != -1:  # not refused already
            self._refuse(_raw_error(400, "Invalid HTTP request", "invalid_request"), linger=False)

    def _head_size(self) -> int:
        """The bytes of the head just parsed: request line and headers."""
        size = len(self.url) + len(self.parser.get_method()) + _REQUEST_LINE_REST
        for name, value in self.headers:
            size += len(name) + len(value) + 4  # ": " and CRLF
        return size

    def _head_too_large(self) -> None:
        """414 if the URL alone is past the cap, else 431, and a lingering close."""
        limit = self.limits.max_header_bytes
        if len(self.url) > limit:
            message = f"The request URL exceeds {limit} bytes"
            error = _raw_error(414, message, "url_too_long")
        else:
            message = f"Request headers exceed {limit} bytes"
            error = _raw_error(431, message, "headers_too_large")
        self._refuse(error, linger=True)

    def pause_writing(self) -> None:
        if self.write_paused is None:
            self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        paused, self.write_paused = self.write_paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)

    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and not self.pipeline:
            self.reading_paused = False
            self.transport.resume_reading()

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.expect_100 = False
        if self._deadline_kind != "head":
            self._arm("head", self.limits.header_timeout_s, self._head_too_slow)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace (RFC 9110 5.5)
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100 = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._measure_head and self._head_size() > self.limits.max_header_bytes:
            self._head_too_large()
            raise _HeadRefused
        self._head_bytes = None
        self._arm("body", self.limits.body_timeout_s, self._close_now)
        parser = self.parser
        version = parser.get_http_version()
        url = self.url
        if b"?" in url or b"%" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
            path = raw_path.decode("ascii")
            path = unquote(path) if "%" in path else path
        else:
            raw_path, query, path = url, b"", url.decode("ascii")
        exchange = Exchange(
            self,
            {},
            keep_alive=version != "1.0" and parser.should_keep_alive(),
            expect_100=self.expect_100,
        )
        exchange.scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "extensions": {
                CLIENT_GONE: exchange.when_gone,
                STREAM_WRITER: exchange.stream_writer,
            },
        }
        cap = self.limits.max_connections
        app: ASGIApp = self.app
        if cap and len(self.connections) > cap:
            app = _bound_over_capacity(self.limits.retry_after_s)
        elif parser.should_upgrade() and self._declares_body():
            exchange.keep_alive = False
            app = _refuse_upgrade_with_body
        self.reading = exchange
        if self.answering is None:
            self._start(exchange, app)
        else:  # pipelined: answered in order, reading waits until this one's turn
            self.pipeline.append((exchange, app))
            self.pause_reading()

    def _declares_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return True
        return False

    def on_body(self, body: bytes) -> None:
        exchange = self.reading
        if exchange is None or exchange.complete:
            return
        exchange.body += body
        if len(exchange.body) > _BODY_HIGH_WATER:
            self.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        if self._deadline_kind == "body":
            self._disarm()
        self._head_bytes = 0
        exchange = self.reading
        if exchange is None:
            return
        if exchange.complete:  # answered before its body ended: the rest was dropped
            if self.answering is None and not self.pipeline:
                self._arm("idle", self.limits.keep_alive_s, self._close_now)
            return
        exchange.more_body = False
        exchange.wake()

    # -- requests ----------------------------------------------------------------------

    def _start(self, exchange: Exchange, app: ASGIApp) -> None:
        self.answering = exchange
        task = self.loop.create_task(self._run(exchange, app))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, exchange: Exchange, app: ASGIApp) -> None:
        try:
            await app(exchange.scope, exchange.receive, exchange.send)
        except BaseException:
            log.exception("error in the router's ASGI app")
            if not exchange.started:
                await exchange.send_500()
            elif not exchange.complete:
                self.transport.close()
        else:
            if exchange.complete or exchange.disconnected:
                return
            log.error("the ASGI app returned without completing its response")
            if not exchange.started:
                await exchange.send_500()
            else:
                self.transport.close()
        finally:
            # The scope holds ``when_gone``, bound to the exchange that holds the scope: left
            # as a cycle, each request's objects waited for the collector, whose young
            # collections then freed many requests' objects at once, in pauses long enough
            # to show in the latency tail.
            exchange.scope["extensions"] = None

    def answered(self, exchange: Exchange) -> None:
        """``exchange``'s response is written: close, start the next pipelined request,
        or wait for one."""
        self.answering = None
        if not exchange.keep_alive:
            self.transport.close()
            return
        if self.transport.is_closing():
            return
        if self.pipeline:
            self._start(*self.pipeline.popleft())
            self.resume_reading()
        elif self._last_words is not None:
            self._say(*self._last_words)
        else:
            self.resume_reading()
            if self._head_bytes == 0 and not self._deadline_kind:
                self._arm("idle", self.limits.keep_alive_s, self._close_now)

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close when idle, else after the current answer."""
        if self.answering is None:
            self.transport.close()
        else:
            self.answering.keep_alive = False
            for exchange, _ in self.pipeline:
                exchange.keep_alive = False


async def _refuse_upgrade_with_body(scope: Scope, receive: Any, send: Any) -> None:
    body = error_body(
        400, "An Upgrade request with a body is not supported", code="invalid_request"
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _bound_over_capacity(retry_after_s: int) -> ASGIApp:
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        await _over_capacity(retry_after_s, scope, receive, send)

    return app


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None
