"""A scriptable OpenAI-ish backend for router tests, a few lines of HTTP/1.1 on asyncio.

The mock engine is the realistic backend; this one exists to control exactly what
the router sees (status codes, hangs, slow streams, connections cut midway) and to
timestamp when the router closed a connection. It runs in the test's own event loop
(``async with StubBackend() as stub``), so a router app tested in-process reaches it
over loopback with no thread, or in a thread of its own (``start``/``stop``) for tests
whose router is a process and whose test body blocks.

A ``route`` makes it any other HTTP peer a test needs (an engine's health and metrics, a
Kubernetes API, a balancer service): it answers the requests it knows and leaves the rest,
by returning None, to the scripted answers. Closed, the stub refuses connections; opened
again, it listens on the same port, as a restarted engine does.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

import orjson


@dataclass
class StubState:
    status: int = 200
    hang: bool = False
    delay_s: float = 0.0  # before answering
    # Close the connection after this many chunks (streams) or half the body (others).
    cut_after_chunks: int | None = None
    chunk_interval_s: float = 0.05
    chunks: int = 100_000  # a stream ends after this many chunks
    models: list[str] = field(default_factory=lambda: ["stub-model"])
    requests: int = 0
    last_headers: dict[str, str] = field(default_factory=dict)
    last_body: bytes = b""
    disconnected_at: list[float] = field(default_factory=list)


@dataclass
class StubRequest:
    method: str
    path: str  # decoded, without the query
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class StubReply:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain"
    stream: AsyncIterator[bytes] | None = None  # sent chunked, instead of ``body``
    raw: bytes | None = None  # written as is, instead of any head and body

    @classmethod
    def verbatim(cls, raw: bytes) -> StubReply:
        """An answer written byte for byte (interim answers, broken heads)."""
        return cls(raw=raw)

    @classmethod
    def json(cls, value: object, status: int = 200) -> StubReply:
        return cls(status, orjson.dumps(value), "application/json")

    @classmethod
    def text(cls, text: str, status: int = 200) -> StubReply:
        return cls(status, text.encode())


Route = Callable[[StubRequest], Awaitable[StubReply | None]]
"""A test's own answers; None leaves a request to the scripted ones."""

_COMPLETIONS = {"/v1/completions", "/v1/chat/completions", "/v1/embeddings"}


class _Cut(Exception):
    """The stub closed the connection on purpose."""


class StubBackend:
    def __init__(
        self, route: Route | None = None, port: int = 0, tls: ssl.SSLContext | None = None
    ) -> None:
        """``tls``: serve HTTPS with this server context."""
        self.state = StubState()
        self.route = route
        self.port = port  # 0 until first opened, then the same port on every reopening
        self.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.url = f"{self.scheme}://127.0.0.1:{port}" if port else ""
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- in the test's event loop ------------------------------------------------------

    async def __aenter__(self) -> StubBackend:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        self._server = await asyncio.start_server(
            self._connection, "127.0.0.1", self.port, ssl=self.tls
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"

    async def close(self) -> None:
        """Close the listener and every connection; safe to call twice."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()

    # -- in a thread of its own --------------------------------------------------------

    def start(self) -> StubBackend:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.open(), self._loop).result(10)
        return self

    def stop(self) -> None:
        """Close the listener and every connection; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._server is None:
            return
        asyncio.run_coroutine_threadsafe(self.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

    # -- HTTP --------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._requests(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, _Cut):
            pass
        finally:
            self._connections.discard(task)
            writer.close()  # after what was written, as a cut connection is

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        carry = b""  # a byte of the next request, read while watching for a disconnect
        while True:
            head = carry + await reader.readuntil(b"\r\n\r\n")
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, target, _ = request_line.split(" ", 2)
            path, _, query = target.partition("?")
            headers = {}
            for line in lines:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            request = StubRequest(
                method, unquote(path), dict(parse_qsl(query, keep_blank_values=True)), headers, body
            )
            answer = asyncio.create_task(self._answer(request, writer))
            gone = asyncio.create_task(reader.read(1))
            try:
                await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
                answered = answer.done() and not isinstance(answer.exception(), ConnectionError)
                ahead = gone.result() if gone.done() and gone.exception() is None else None
            finally:
                for task in (answer, gone):
                    task.cancel()  # a no-op once done
                await asyncio.wait({answer, gone})  # the reader is free again
            if not answered:  # the client went away before its answer was complete
                self.state.disconnected_at.append(time.monotonic())
                return
            answer.result()
            if ahead == b"" or headers.get("connection", "").lower() == "close":
                return  # closed after its answer
            carry = ahead or b""

    async def _answer(self, request: StubRequest, out: asyncio.StreamWriter) -> None:
        if self.route is not None:
            reply = await self.route(request)
            if reply is not None:
                return await _send_reply(out, reply)
        method, path, headers, body = request.method, request.path, request.headers, request.body
        s = self.state
        if method == "GET" and path == "/health":
            return await _send_json(out, 200, {"status": "ok"})
        if method == "GET" and path == "/v1/models":
            data = [{"id": m, "object": "model", "owned_by": "stub"} for m in s.models]
            return await _send_json(out, 200, {"object": "list", "data": data})
        if method != "POST" or path not in _COMPLETIONS:
            return await _send_json(out, 404, {"detail": "Not Found"})
        s.requests += 1
        s.last_headers = headers
        s.last_body = body
        if s.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(s.delay_s)
        if s.status != 200:
            error = {"message": "stub failure", "type": "server_error", "code": s.status}
            return await _send_json(out, s.status, {"error": error})
        sent = orjson.loads(body)
        if not sent.get("stream"):
            answer = {"id": "cmpl-stub", "object": "text_completion", "echo": sent}
            if s.cut_after_chunks is None:
                return await _send_json(out, 200, answer)
            payload = orjson.dumps(answer)  # announced whole, half sent, then cut
            out.write(_head(200, "application/json", len(payload)) + payload[: len(payload) // 2])
            await out.drain()
            raise _Cut
        out.write(_head(200, "text/event-stream", None))
        for i in range(s.chunks):
            if i == s.cut_after_chunks:
                await out.drain()
                raise _Cut
            piece = b'data: {"i": %d}\n\n' % i
            out.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await out.drain()
            await asyncio.sleep(s.chunk_interval_s)
        out.write(b"0\r\n\r\n")
        await out.drain()


def _head(status: int, content_type: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        f"Content-Type: {content_type}\r\n{framing}\r\n\r\n"
    ).encode("latin-1")


async def _send_json(out: asyncio.StreamWriter, status: int, value: object) -> None:
    payload = orjson.dumps(value)
    out.write(_head(status, "application/json", len(payload)) + payload)
    with contextlib.suppress(ConnectionError):
        await out.drain()


async def _send_reply(out: asyncio.StreamWriter, reply: StubReply) -> None:
    if reply.raw is not None:
        out.write(reply.raw)
        await out.drain()
        return
    if reply.stream is None:
        out.write(_head(reply.status, reply.content_type, len(reply.body)) + reply.body)
        await out.drain()
        return
    out.write(_head(reply.status, reply.content_type, None))
    async for piece in reply.stream:
        if piece:  # an empty chunk would end the body
            out.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await out.drain()
    out.write(b"0\r\n\r\n")
    await out.drain()
