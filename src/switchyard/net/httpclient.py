"""The HTTP/1.1 client for calls to workers: kept-alive connections per worker, parsed by
httptools.

A router call is one POST with a body already in memory, to a worker it talks to all
the time; its answer is relayed as bytes. The balancer's probes and scrapes are GETs to
the same workers. That needs far less than a general client:
no cookies, redirects, proxies, decompression or per-request header objects
(``docs/decisions/0002-http-client.md``).

Failures raise the classes of ``switchyard.net.errors``, which ``router.upstream.outcome_of``
maps to outcomes: refused or unresolvable is a ``ConnectError``; closed before the response
head is ``ServerDisconnected``; an answer that is not HTTP/1.1 we accept, or whose head
passes the cap, is a ``RemoteProtocolError``; broken after the head is ``PayloadCut``; a
deadline passed is a ``TransportTimeout`` (a ``TimeoutError``); a header with CR, LF or
NUL is an ``InvalidHeader``, raised before anything is written.

Interim answers (1xx but 101) are skipped for the final one (RFC 9110 15.2). A request is
written at most once: a kept connection is checked before it is written on, and a
connection that ends after the request went out raises (``maybe_started``) rather than
sending it again, since the worker may have read it and begun generating.
"""

from __future__ import annotations

import asyncio
import functools
import re
import select
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from switchyard.net.errors import (
    ConnectError,
    ConnectTimeout,
    InvalidHeader,
    InvalidURL,
    PayloadCut,
    PoolTimeout,
    ReadTimeout,
    RemoteProtocolError,
    ResponseHeadTooLarge,
    ServerDisconnected,
    TransportError,
    TransportTimeout,
)

# Body bytes buffered from a worker before its socket is no longer read (a slow client).
_HIGH_WATER_BYTES = 1 << 20
# Takes one piece of a body as it arrives; returns a future to wait for before the next
# (the reader is slow: the connection stops reading until it is done), or None.
PieceWriter = Callable[[bytes], "asyncio.Future[None] | None"]
# Above this, a request's head and body are handed to the transport apart (no copy).
_JOIN_BODY_BYTES = 64 * 1024
# Default cap on an answer's head (status line, headers, interim answers before it).
MAX_HEAD_BYTES = 64 * 1024
# An HTTP token (RFC 9110 5.6.2): what a header name may be.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


# Header names found to be tokens, so each distinct name is checked once: the router sends
# a handful. Past the cap a new name is checked each time it comes.
_TOKEN_NAMES: set[str] = set()
_MAX_TOKEN_NAMES = 1024


def _check_names(headers: dict[str, str]) -> None:
    for name in headers:
        if name not in _TOKEN_NAMES:
            if not _TOKEN.fullmatch(name):
                raise InvalidHeader(f"header name {name!r} is not an HTTP token")
            if len(_TOKEN_NAMES) < _MAX_TOKEN_NAMES:
                _TOKEN_NAMES.add(name)


def _header_lines(headers: dict[str, str]) -> bytes:
    """``headers`` as request head lines, each ended by CRLF; a value with CR, LF or NUL
    (it would end the header and start another, or a request) is refused. Built as one
    string and encoded once: with the names tokens, any CR or LF beyond the line ends, or
    any NUL, is a value's, so three scans of that string check every value."""
    if not headers:
        return b""
    if not _TOKEN_NAMES.issuperset(headers):
        _check_names(headers)
    text = "\r\n".join(map(": ".join, headers.items()))
    lines = len(headers) - 1
    if text.count("\r") != lines or text.count("\n") != lines or "\0" in text:
        bad = next(n for n, v in headers.items() if "\r" in v or "\n" in v or "\0" in v)
        raise InvalidHeader(f"header {bad!r}: CR, LF or NUL in its value")
    try:
        return (text + "\r\n").encode("latin-1")
    except UnicodeEncodeError as exc:
        raise InvalidHeader(f"header value not latin-1: {exc}") from None


class _HeadDone(Exception):
    """Raised from the parser's callback to stop it at the end of a HEAD answer's head
    (httptools cannot be told that such an answer has no body)."""


@functools.lru_cache(maxsize=4096)
def _target(url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
    """(origin, Host header, request path) of ``url``; the router calls few distinct URLs."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidURL(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return (parts.scheme, parts.hostname, port), parts.netloc.encode("idna"), path.encode()


class Response:
    """A worker's answer: its head, then its body as it arrives (``readany``)."""

    __slots__ = (
        "status",
        "raw_headers",
        "_conn",
        "_chunks",
        "_size",
        "_done",
        "_error",
        "_waiter",
        "_idle_s",
        "_fed_at",
        "_timer",
        "_sink",
        "_loop",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._conn: _Connection | None = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._idle_s: float | None = None
        self._fed_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._sink: PieceWriter | None = None
        # The pool's loop: asyncio.get_running_loop() is a getpid() syscall on Python 3.11,
        # and ``_feed`` runs once a chunk.
        self._loop = conn.pool.loop

    def idle_timeout(self, idle_s: float) -> None:
        """From now on ``readany`` raises ``ReadTimeout`` once no body bytes came for
        ``idle_s``. One timer serves the whole body: it is made when a read has to wait and
        none is pending, and where bytes came since, it moves on instead of firing. An
        ``asyncio.timeout`` moved on every chunk would cost a timer a chunk, measurable on
        the SSE path."""
        self._idle_s = idle_s
        self._fed_at = self._loop.time()

    @property
    def ready(self) -> bool:
        """``readany`` would answer at once (body bytes waiting, the end, or the failure)."""
        return bool(self._chunks) or self._done or self._error is not None

    @property
    def finished(self) -> bool:
        """The whole body has arrived."""
        return self._done

    @property
    def content_type(self) -> bytes:
        for name, value in self.raw_headers:
            if name.lower() == b"content-type":
                return value
        return b""

    async def readany(self) -> bytes:
        """What has arrived of the body since the last read (waiting for some); b"" at its end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        data = self._take()
        if self._conn is not None:
            self._conn.resume()
        return data

    async def pipe(self, write: PieceWriter) -> None:
        """Hand the rest of the body to ``write``, piece by piece, from the connection's own
        callback as each arrives; return at its end. Raises as ``readany`` does (the
        connection's error, ``ReadTimeout`` once idle for the ``idle_timeout``).

        A relay through ``readany`` woke its task, made a future and an ASGI message for
        every piece (an SSE chunk, about a token), which put our cost a chunk above smg's
        on the multi-turn replay (``docs/decisions/0002-http-client.md``)."""
        if self._chunks:
            self._hand(write, self._take())
        self._sink = write
        try:
            while self._error is None and not self._done:
                await self._wait()
            if self._error is not None:
                raise self._error
        finally:
            self._sink = None

    def fail(self, error: BaseException) -> None:
        """End the body with ``error``: its reader found the rest unusable (an engine's
        error event in a stream that goes on elsewhere), so ``pipe`` and ``readany`` raise
        it and ``close`` drops the connection."""
        self._finish(error)

    def _take(self) -> bytes:
        """The body bytes buffered so far, as one piece."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        return data

    async def _wait(self) -> None:
        """Until the connection wakes us (bytes, the end, a failure) or the idle timer fires."""
        loop = self._loop
        self._waiter = loop.create_future()
        if self._idle_s is not None and self._timer is None:
            self._timer = loop.call_at(self._fed_at + self._idle_s, self._idle_check)
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _hand(self, write: PieceWriter, data: bytes) -> None:
        slow = write(data)
        conn = self._conn
        if slow is not None and conn is not None:
            conn.pause()
            slow.add_done_callback(lambda _: conn.resume())

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Done with the answer: an unfinished one closes its connection (not reusable)."""
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is not None and not self._done:
            conn.abort()

    def _feed(self, data: bytes) -> None:
        if self._idle_s is not None:
            self._fed_at = self._loop.time()
        if self._sink is not None:
            self._hand(self._sink, data)
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER_BYTES and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
            self._conn = None
        else:
            self._error = error
        self._stop_timer()
        self._wake()

    def _idle_check(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next read that waits makes the timer again
        assert self._idle_s is not None
        loop = self._loop
        due = self._fed_at + self._idle_s
        if loop.time() >= due:
            waiter.set_exception(ReadTimeout(f"no body bytes for {self._idle_s}s"))
        else:
            self._timer = loop.call_at(due, self._idle_check)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One kept-alive connection to one origin, answering one request at a time."""

    def __init__(self, pool: ConnectionPool, origin: tuple[str, str, int]) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self.awaiting_head = False  # the final answer's head is not complete yet
        self.head_left = 0  # bytes the head may still take before the cap
        self.interim = False  # the message being parsed is a 1xx interim answer
        self.head_only = False  # the request was HEAD: its answer has no body
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.poller: select.poll | None = None  # the socket's, polled before reuse

    def send(self, head: bytes, body: bytes, head_only: bool = False) -> asyncio.Future[Response]:
        """Write a request; the future resolves with its response at the head."""
        assert self.transport is not None
        self.response = Response(self)
        self.awaiting_head = True
        self.head_left = self.pool.max_head_bytes
        self.head_only = head_only
        self.head = self.pool.loop.create_future()
        if len(body) > _JOIN_BODY_BYTES:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head + body)
        return self.head

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.pool._lost(self)

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def unread(self) -> bool:
        """Bytes or an EOF wait unread in the socket of this idle connection, so it cannot
        take a request: a worker that closed it (its keep-alive timer, a restart) sent a
        FIN the loop has not read yet. One poll, not ``select`` (which fails past fd 1024);
        it is what lets the pool never resend a request."""
        poller = self.poller
        if poller is None:
            return True
        try:
            return bool(poller.poll(0))  # a closed fd reports POLLNVAL: unusable too
        except (OSError, ValueError):
            return True

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # registered once: ``unread`` runs before every request on the connection
                self.poller = select.poll()
                self.poller.register(sock.fileno(), select.POLLIN)
            except (OSError, ValueError):
                self.poller = None

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is not reusable
            self.abort()
            return
        if self.awaiting_head:
            left = self.head_left
            if len(data) > left:  # the head ends within the cap or the call fails
                if left and not self._parse(data[:left]):
                    return
                if self.awaiting_head:
                    cap = self.pool.max_head_bytes
                    self._fail(ResponseHeadTooLarge(f"answer head over {cap} bytes"))
                    self.abort()
                    return
                data = data[left:]
                if self.closed or not data:
                    return
            else:
                self.head_left = left - len(data)
        self._parse(data)

    def _parse(self, data: bytes) -> bool:
        """Feed ``data`` to the parser; False when that ended the connection."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _HeadDone):
                return self._head_answered(data)
            self._fail(cause if isinstance(cause, TransportError) else RemoteProtocolError(exc))
            self.abort()
            return False
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(RemoteProtocolError(f"malformed answer: {exc}"))
            self.abort()
            return False
        return True

    def _head_answered(self, data: bytes) -> bool:
        """A HEAD answer ended at its head: the connection is kept when nothing followed
        it (the parser, stopped mid-message, is replaced)."""
        response = self.response
        keep = self.parser.should_keep_alive() and data.endswith(b"\r\n\r\n")
        self.response = None
        self.parser = httptools.HttpResponseParser(self)
        if response is not None:
            response._finish()
        if keep and not self.closed:
            self.pool._release(self)
            return True
        self.abort()
        return False

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None and not response._done:
            if self.head is not None and self.head.done() and _ends_at_close(response):
                response._finish()
            else:
                reason = f"connection lost: {exc}" if exc else "connection closed by the worker"
                self._fail(ServerDisconnected(reason))
        self.response = None
        self.pool._lost(self)

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response, head = self.response, self.head
        if response is None or head is None:
            raise RemoteProtocolError("an answer to no request")
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                raise RemoteProtocolError("101 Switching Protocols, to no upgrade asked for")
            self.interim = True  # 100 Continue, 103 Early Hints...: the final one follows
            response.raw_headers.clear()
            return
        self.awaiting_head = False
        response.status = status
        if not head.done():
            head.set_result(response)
        if self.head_only:
            raise _HeadDone

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        response = self.response
        if response is None:
            return
        keep = self.parser.should_keep_alive()
        self.response = None
        response._finish()
        self.resume()
        if keep and not self.closed:
            self.pool._release(self)
        else:
            self.abort()

    def _fail(self, error: TransportError) -> None:
        """``error`` for the waiting head; once the head came, the body is ``PayloadCut``."""
        head, response = self.head, self.response
        if head is not None and not head.done():
            head.set_exception(error)
        elif response is not None:
            response._finish(error if isinstance(error, PayloadCut) else PayloadCut(str(error)))


def _expire(answer: asyncio.Future[Response]) -> None:
    if not answer.done():
        answer.set_exception(ReadTimeout("no response head by the deadline"))


def _ends_at_close(response: Response) -> bool:
    """A body with neither a length nor chunks runs until the connection closes."""
    for name, value in response.raw_headers:
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            return False
    return True


class ConnectionPool:
    """Kept-alive connections per origin (scheme, host, port), at most ``max_per_origin``
    open at once (0: unbounded); an idle one is closed after ``keepalive_s``. An answer's
    head may take ``max_head_bytes`` at most; ``https`` origins are reached with
    ``ssl_context`` (default: ``ssl.create_default_context()``)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        max_per_origin: int = 0,
        keepalive_s: float = 60.0,
        max_head_bytes: int = MAX_HEAD_BYTES,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_per_origin = max_per_origin
        self.keepalive_s = keepalive_s
        self.max_head_bytes = max_head_bytes
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: dict[tuple[str, str, int], set[_Connection]] = {}
        self._waiters: dict[tuple[str, str, int], deque[asyncio.Future[None]]] = {}
        self._ssl = ssl_context

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> Response:
        """POST ``body`` with ``headers`` (plus Host and Content-Length); the response at its
        head, within ``timeout_s`` (else ``ReadTimeout``). Written once: a worker that
        closes the connection before answering is a ``ServerDisconnected``."""
        origin, host, path = _target(url)
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            path,
            host,
            len(body),
            _header_lines(headers),
        )
        return await self._request(origin, head, body, timeout_s)

    async def delete(
        self, url: str, headers: dict[str, str], timeout_s: float | None = None
    ) -> Response:
        """DELETE ``url`` with ``headers``; the response at its head (as ``post``)."""
        return await self.request("DELETE", url, b"", headers, timeout_s)

    async def get(self, url: str, timeout_s: float | None = None) -> Response:
        """GET ``url``; the response at its head, within ``timeout_s`` (as ``post``)."""
        origin, host, path = _target(url)
        head = b"GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path, host)
        return await self._request(origin, head, b"", timeout_s)

    async def head(
        self, url: str, headers: dict[str, str] | None = None, timeout_s: float | None = None
    ) -> Response:
        """HEAD ``url``: the response at its head, with no body whatever it announces."""
        return await self.request("HEAD", url, b"", headers, timeout_s)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        """Any method, as ``post``; Content-Length is sent where there is a body, or a
        method that expects one (POST, PUT, PATCH, DELETE)."""
        if not _TOKEN.fullmatch(method):
            raise InvalidHeader(f"method {method!r} is not an HTTP token")
        origin, host, path = _target(url)
        lines = [method.encode("ascii"), b" ", path, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
        if body or method in ("POST", "PUT", "PATCH", "DELETE"):
            lines.append(b"Content-Length: %d\r\n" % len(body))
        if headers:
            lines.append(_header_lines(headers))
        lines.append(b"\r\n")
        return await self._request(origin, b"".join(lines), body, timeout_s, method == "HEAD")

    async def _request(
        self,
        origin: tuple[str, str, int],
        head: bytes,
        body: bytes,
        timeout_s: float | None,
        head_only: bool = False,
    ) -> Response:
        """One exchange on one connection, never repeated: a kept connection the worker
        closed is found out before writing (``_take_idle``), not by resending."""
        deadline = None if timeout_s is None else self.loop.time() + timeout_s
        conn = await self._acquire(origin, deadline)
        return await self._exchange(conn, head, body, deadline, head_only)

    async def _exchange(
        self,
        conn: _Connection,
        head: bytes,
        body: bytes,
        deadline: float | None,
        head_only: bool = False,
    ) -> Response:
        """Send on ``conn`` and wait for the answer's head; a timer, not an
        ``asyncio.timeout`` (one object and a reschedule less a request)."""
        answer = conn.send(head, body, head_only)
        timer = None if deadline is None else self.loop.call_at(deadline, _expire, answer)
        try:
            return await answer
        except BaseException:
            conn.abort()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def close(self) -> None:
        for conns in list(self._open.values()):
            for conn in list(conns):
                conn.abort()
        self._idle.clear()

    async def _acquire(self, origin: tuple[str, str, int], deadline: float | None) -> _Connection:
        """A connection to ``origin``; connecting or waiting for a free one ends at
        ``deadline`` (loop time) with ``PoolTimeout`` (connecting itself, within the
        connect timeout, else ``ConnectTimeout``)."""
        conn = self._take_idle(origin)
        if conn is not None:  # the usual case: no timeout context entered
            return conn
        try:
            async with asyncio.timeout_at(deadline):
                return await self._wait_or_connect(origin)
        except TransportTimeout:
            raise
        except TimeoutError:
            raise PoolTimeout("no connection by the deadline") from None

    def _take_idle(self, origin: tuple[str, str, int]) -> _Connection | None:
        """The latest idle connection still open and within ``keepalive_s``; older ones
        found on the way are closed, as is one whose socket holds an unread EOF (or
        bytes): nothing was written on it."""
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s and not conn.unread():
                return conn
            conn.abort()
        return None

    async def _wait_or_connect(self, origin: tuple[str, str, int]) -> _Connection:
        while True:
            conn = self._take_idle(origin)
            if conn is not None:
                return conn
            opened = self._open.setdefault(origin, set())
            if not self.max_per_origin or len(opened) < self.max_per_origin:
                return await self._connect(origin, opened)
            waiter = self.loop.create_future()
            self._waiters.setdefault(origin, deque()).append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake(origin)  # pass on the turn it was given
                raise

    async def _connect(self, origin: tuple[str, str, int], opened: set[_Connection]) -> _Connection:
        scheme, host, port = origin
        conn = _Connection(self, origin)
        opened.add(conn)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.loop.create_connection(
                    lambda: conn, host, port, ssl=self._tls() if scheme == "https" else None
                )
        except TimeoutError:
            conn.abort()
            raise ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            conn.abort()
            raise ConnectError(str(exc)) from exc
        except BaseException:
            conn.abort()
            raise
        return conn

    def _tls(self) -> ssl.SSLContext:
        """The pool's context, else the default one (verifying against the system CAs)."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)
        self._wake(conn.origin)

    def _lost(self, conn: _Connection) -> None:
        opened = self._open.get(conn.origin)
        if opened is not None and conn in opened:
            opened.discard(conn)
            self._wake(conn.origin)

    def _wake(self, origin: tuple[str, str, int]) -> None:
        waiters = self._waiters.get(origin)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
