"""The router's HTTP/1.1 server protocol held to the cases of uvicorn's own protocol tests.

Every case runs against two protocols through one fixture: ours (``ClientConnection``) and
uvicorn's ``HttpToolsProtocol``, the reference it replaced. Both are driven with a mock
transport and a mock loop (no socket, no sleep: a test fires timers by moving the loop's
clock). Where the two differ on purpose, the case names the expected value of each in a
``{"ours": ..., "uvicorn": ...}`` dict, and ``docs/decisions/0001-http-server-protocol.md``
says why. The last tests send two of the cases through a router app over a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from switchyard.router.connections import CLIENT_GONE, ClientConnection, ConnectionLimits
from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend

# -- requests ---------------------------------------------------------------------------

SIMPLE_GET = b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n"
SIMPLE_HEAD = b"HEAD / HTTP/1.1\r\nHost: example.org\r\n\r\n"
SIMPLE_POST = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nContent-Type: application/json\r\n"
    b'Content-Length: 18\r\n\r\n{"hello": "world"}'
)
START_POST = b"POST / HTTP/1.1\r\nHost: example.org\r\nContent-Length: 18\r\n\r\n"
FINISH_POST = b'{"hello": "world"}'
CONNECTION_CLOSE_GET = b"GET / HTTP/1.1\r\nHost: example.org\r\nConnection: close\r\n\r\n"
HTTP10_GET = b"GET / HTTP/1.0\r\nHost: example.org\r\n\r\n"
HTTP10_KEEP_ALIVE_GET = b"GET / HTTP/1.0\r\nHost: example.org\r\nConnection: keep-alive\r\n\r\n"
CHUNKED_POST = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n"
)
BAD_CHUNK_SIZE_POST = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nhello\r\n0\r\n\r\n"
)
EXPECT_100_HEAD = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nExpect: 100-continue\r\nContent-Length: 18\r\n\r\n"
)
UPGRADE_H2C = (
    b"GET / HTTP/1.1\r\nHost: example.org\r\nConnection: Upgrade, HTTP2-Settings\r\n"
    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
)
UPGRADE_WEBSOCKET = (
    b"GET / HTTP/1.1\r\nHost: example.org\r\nConnection: upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
)
UPGRADE_H2C_WITH_BODY = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
    b"Content-Length: 18\r\n\r\n" + FINISH_POST
)
SECOND_GET = b"GET /second HTTP/1.1\r\nHost: example.org\r\n\r\n"
INVALID_REQUEST_TEMPLATE = b"%s\r\nHost: example.org\r\n\r\n"
# A 64 KiB cookie in two reads, as in uvicorn's suite: past our 32 KiB head cap.
HUGE_HEADERS = (
    b"GET / HTTP/1.1\r\nHost: example.org\r\nCookie: " + b"x" * 32 * 1024,
    b"x" * 32 * 1024 + b"\r\n\r\n",
)
LONG_URL_GET = b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: example.org\r\n\r\n"
CL_AND_TE_POST = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
)
DUPLICATE_CL_POST = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
)
SAME_DUPLICATE_CL_POST = (
    b"POST / HTTP/1.1\r\nHost: example.org\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"
)
OBS_FOLD_GET = b"GET / HTTP/1.1\r\nHost: example.org\r\nX-Folded: one\r\n two\r\n\r\n"
NUL_IN_HEADER_GET = b"GET / HTTP/1.1\r\nHost: example.org\r\nX-Nul: a\x00b\r\n\r\n"
BARE_LF_GET = b"GET / HTTP/1.1\nHost: example.org\n\n"
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# A case that hangs is a failure, not a wait for the suite's own timeout.
pytestmark = pytest.mark.timeout(20)

HEADER_CAP = 32 * 1024
KEEP_ALIVE_S = 5.0  # uvicorn's default ``timeout_keep_alive``
HEADER_TIMEOUT_S = 10.0


# -- a transport and a loop the test drives ----------------------------------------------


class MockTransport:
    """Records what the protocol writes; a write after close is a protocol bug."""

    def __init__(self) -> None:
        self.buffer = b""
        self.closed = False
        self.eof_written = False
        self.read_paused = False
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 8001)}.get(name)

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.buffer += data

    def close(self) -> None:
        """As asyncio's transports do, the protocol hears of the close on the next turn."""
        if not self.closed and self.protocol is not None:
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def pause_reading(self) -> None:
        self.read_paused = True

    def resume_reading(self) -> None:
        self.read_paused = False

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        pass


class MockTimerHandle:
    def __init__(self, loop: MockLoop, when: float, callback: Callable[..., None], args: Any):
        self.loop = loop
        self._when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        self.cancelled = True


class MockTask:
    def add_done_callback(self, callback: Callable[..., None]) -> None:
        pass


class MockLoop:
    """Tasks wait until the test runs them (``run_one``); timers fire when the test moves
    the clock (``advance``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.coroutines: list[Coroutine[Any, Any, None]] = []
        self.timers: list[tuple[float, int, MockTimerHandle]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self.now

    def create_task(self, coroutine: Coroutine[Any, Any, None], **_: Any) -> MockTask:
        self.coroutines.append(coroutine)
        return MockTask()

    def create_future(self) -> asyncio.Future[None]:
        return asyncio.get_running_loop().create_future()

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> MockTimerHandle:
        handle = MockTimerHandle(self, when, callback, args)
        heapq.heappush(self.timers, (when, next(self._order), handle))
        return handle

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Any:
        return self.call_at(self.now + delay, callback, *args)

    def advance(self, seconds: float) -> None:
        """Move the clock, firing each timer that falls due on the way in order."""
        until = self.now + seconds
        while self.timers and self.timers[0][0] <= until:
            when, _, handle = heapq.heappop(self.timers)
            self.now = max(self.now, when)
            if not handle.cancelled:
                handle.callback(*handle.args)
        self.now = until

    async def run_one(self) -> None:
        """Run the oldest waiting request task to its end."""
        await self.coroutines.pop(0)


App = Callable[[Scope, Receive, Send], Awaitable[None]]


class Connection:
    """One protocol instance on a mock transport and loop."""

    def __init__(self, kind: str, protocol: Any, loop: MockLoop, transport: MockTransport):
        self.kind = kind
        self.protocol = protocol
        self.loop = loop
        self.transport = transport

    def feed(self, *reads: bytes) -> None:
        for data in reads:
            self.protocol.data_received(data)

    async def run_all(self) -> None:
        while self.loop.coroutines:
            await self.loop.run_one()

    @property
    def sent(self) -> bytes:
        return self.transport.buffer

    @property
    def closed(self) -> bool:
        return self.transport.closed

    def status_lines(self) -> list[bytes]:
        """Each response's status line, in order (bodies here never hold one)."""
        return re.findall(rb"HTTP/1\.1 \d\d\d[^\r\n]*", self.sent)

    def statuses(self) -> list[int]:
        return [int(line[9:12]) for line in self.status_lines()]

    def expect(self, per_protocol: dict[str, Any]) -> Any:
        return per_protocol[self.kind]


Connect = Callable[[App], Connection]


def ours(app: App, loop: MockLoop) -> Any:
    config = Config(app=app, proxy_headers=False, lifespan="off", log_config=None)
    limits = ConnectionLimits(
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=60.0,
        max_connections=0,  # uvicorn's limit_concurrency: None
        max_header_bytes=HEADER_CAP,
        keep_alive_s=KEEP_ALIVE_S,
    )
    return ClientConnection(config, ServerState(), {}, loop, limits=limits)  # type: ignore[arg-type]


def uvicorn_httptools(app: App, loop: MockLoop) -> Any:
    config = Config(
        app=app,
        http="httptools",
        ws="none",  # the router serves no WebSocket: both see the same unsupported upgrade
        proxy_headers=False,
        lifespan="off",
        log_config=None,
        timeout_keep_alive=int(KEEP_ALIVE_S),
    )
    return HttpToolsProtocol(config, ServerState(), {}, loop)  # type: ignore[arg-type]


FACTORIES = {"ours": ours, "uvicorn": uvicorn_httptools}


@pytest.fixture(params=sorted(FACTORIES))
def connect(request: pytest.FixtureRequest) -> Iterator[Connect]:
    """A connected protocol of each kind for an app: the same case runs against both."""
    kind: str = request.param
    made: list[Connection] = []

    def make(app: App) -> Connection:
        loop, transport = MockLoop(), MockTransport()
        protocol = FACTORIES[kind](app, loop)
        transport.protocol = protocol
        protocol.connection_made(transport)
        made.append(Connection(kind, protocol, loop, transport))
        return made[-1]

    yield make
    for conn in made:  # never-run request tasks would warn as never awaited
        for coroutine in conn.loop.coroutines:
            coroutine.close()


# -- apps -------------------------------------------------------------------------------


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        assert message["type"] == "http.request"
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def respond(
    send: Send, body: bytes, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    if headers is None:
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers without reading the request body."""
    await respond(send, b"Hello, world")


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    body = await read_body(receive)
    await respond(send, b"Body: " + body)


async def echo_path(scope: Scope, receive: Receive, send: Send) -> None:
    await read_body(receive)
    await respond(send, scope["path"].encode())


def empty(status: int, headers: list[tuple[bytes, bytes]] | None = None) -> App:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers or []})
        await send({"type": "http.response.body", "body": b""})

    return app


# -- framing ----------------------------------------------------------------------------


async def test_a_get_is_answered_and_the_connection_kept(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert conn.sent.startswith(b"HTTP/1.1 200 OK\r\n")
    assert conn.sent.endswith(b"\r\n\r\nHello, world")
    assert not conn.closed


async def test_a_post_body_reaches_the_app(connect: Connect) -> None:
    conn = connect(echo)
    conn.feed(SIMPLE_POST)
    await conn.run_all()
    assert conn.sent.startswith(b"HTTP/1.1 200 OK\r\n")
    assert conn.sent.endswith(b'Body: {"hello": "world"}')


async def test_a_body_in_two_reads_reaches_the_app_whole(connect: Connect) -> None:
    conn = connect(echo)
    conn.feed(START_POST)
    running = asyncio.ensure_future(conn.run_all())
    await asyncio.sleep(0)  # the app now waits for the body
    conn.feed(FINISH_POST)
    await running
    assert conn.sent.endswith(b'Body: {"hello": "world"}')


async def test_a_kept_alive_connection_serves_a_second_request(connect: Connect) -> None:
    conn = connect(echo_path)
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    conn.feed(SECOND_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"] * 2
    assert conn.sent.endswith(b"/second") and not conn.closed


async def test_pipelined_requests_are_answered_in_order(connect: Connect) -> None:
    conn = connect(echo_path)
    conn.feed(SIMPLE_GET + b"GET /b HTTP/1.1\r\n\r\n", b"GET /c HTTP/1.1\r\n\r\n")
    await conn.run_all()
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in conn.sent.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b"/", b"/b", b"/c"]
    assert not conn.closed


async def test_connection_close_from_the_client_closes_after_the_answer(
    connect: Connect,
) -> None:
    conn = connect(hello)
    conn.feed(CONNECTION_CLOSE_GET)
    await conn.run_all()
    assert conn.sent.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close\r\n" in conn.sent.lower()
    assert conn.closed


async def test_connection_close_from_the_app_closes_after_the_answer(connect: Connect) -> None:
    conn = connect(empty(204, [(b"connection", b"close")]))
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert conn.sent.startswith(b"HTTP/1.1 204 No Content")
    assert conn.closed


async def test_an_http_1_0_request_is_answered_then_closed(connect: Connect) -> None:
    versions: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        versions.append(scope["http_version"])
        await hello(scope, receive, send)

    conn = connect(app)
    conn.feed(HTTP10_GET)
    await conn.run_all()
    assert versions == ["1.0"]
    assert conn.sent.startswith(b"HTTP/1.1 200 OK") and conn.closed


async def test_an_http_1_0_keep_alive_request_is_answered_then_closed(connect: Connect) -> None:
    """Neither keeps an HTTP/1.0 connection: a server may close it, and the client knows."""
    conn = connect(hello)
    conn.feed(HTTP10_KEEP_ALIVE_GET)
    await conn.run_all()
    assert conn.sent.startswith(b"HTTP/1.1 200 OK") and conn.closed


async def test_a_chunked_request_body_reaches_the_app_unframed(connect: Connect) -> None:
    conn = connect(echo)
    conn.feed(CHUNKED_POST)
    await conn.run_all()
    assert conn.sent.endswith(b"Body: hello, world") and not conn.closed


async def test_a_bad_chunk_size_is_refused_400_and_closed(connect: Connect) -> None:
    conn = connect(echo)
    conn.feed(BAD_CHUNK_SIZE_POST)
    await conn.run_all()
    assert conn.status_lines()[-1] == b"HTTP/1.1 400 Bad Request"
    assert conn.closed


async def test_a_head_request_gets_the_head_without_the_body(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(SIMPLE_HEAD)
    await conn.run_all()
    assert conn.sent.startswith(b"HTTP/1.1 200 OK")
    assert b"content-length: 12\r\n" in conn.sent
    assert conn.sent.endswith(b"\r\n\r\n") and not conn.closed


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_status_is_sent_without_body_or_framing(
    connect: Connect, status: int
) -> None:
    conn = connect(empty(status))
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert conn.sent.startswith(b"HTTP/1.1 %d " % status)
    assert conn.sent.endswith(b"\r\n\r\n")
    assert b"transfer-encoding" not in conn.sent.lower()
    assert not conn.closed


async def test_a_response_without_length_is_chunked_and_ends_once(connect: Connect) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"Hello", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    conn = connect(app)
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert b"transfer-encoding: chunked\r\n" in conn.sent
    assert conn.sent.endswith(b"\r\n\r\n5\r\nHello\r\n0\r\n\r\n")


# -- malformed requests -----------------------------------------------------------------


@pytest.mark.parametrize(
    "request_line",
    [
        pytest.param(b"G?T / HTTP/1.1", id="invalid-method"),
        pytest.param(b"GET /?x=y z HTTP/1.1", id="invalid-path"),
        pytest.param(b"GET / HTTP1.1", id="invalid-http-version"),
        pytest.param(b"GET / HTTP/3.1", id="unknown-http-version"),
        pytest.param(b"NOT HTTP AT ALL", id="not-http"),
    ],
)
async def test_an_invalid_request_line_is_refused_400_and_closed(
    connect: Connect, request_line: bytes
) -> None:
    conn = connect(hello)
    conn.feed(INVALID_REQUEST_TEMPLATE % request_line)
    assert conn.status_lines() == [b"HTTP/1.1 400 Bad Request"]
    assert conn.closed


async def test_bytes_that_are_not_http_are_refused_and_closed(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(b"x" * 100_000)
    assert conn.closed


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(CL_AND_TE_POST, id="content-length-and-chunked"),
        pytest.param(DUPLICATE_CL_POST, id="two-content-lengths"),
        pytest.param(SAME_DUPLICATE_CL_POST, id="content-length-twice"),
        pytest.param(NUL_IN_HEADER_GET, id="nul-in-a-header"),
        pytest.param(HTTP2_PREFACE, id="http2-preface"),
    ],
)
async def test_an_ambiguous_or_foreign_request_is_refused_400_and_closed(
    connect: Connect, raw: bytes
) -> None:
    """Smuggling shapes (two lengths, length and chunked) never reach the app."""
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["path"])
        await hello(scope, receive, send)

    conn = connect(app)
    conn.feed(raw)
    await conn.run_all()
    assert seen == []
    assert conn.status_lines() == [b"HTTP/1.1 400 Bad Request"]
    assert conn.closed


async def test_an_obsolete_line_folding_is_refused_400(connect: Connect) -> None:
    headers: list[Any] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers.extend(v for n, v in scope["headers"] if n == b"x-folded")
        await hello(scope, receive, send)

    conn = connect(app)
    conn.feed(OBS_FOLD_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 400 Bad Request"]
    assert headers == [] and conn.closed


async def test_bare_lf_line_ends_are_refused(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(BARE_LF_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 400 Bad Request"]
    assert conn.closed


def held(path: str) -> tuple[App, asyncio.Event]:
    """An app whose answer to ``path`` waits for the event; others answer at once."""
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        if scope["path"] == path:
            await release.wait()
        await respond(send, scope["path"].encode())

    return app, release


async def test_a_malformed_request_after_a_pipelined_one_is_refused_after_its_answer(
    connect: Connect,
) -> None:
    """uvicorn writes its 400 and closes at once: the answer owed first is lost."""
    conn = connect(echo_path)
    conn.feed(SIMPLE_GET + INVALID_REQUEST_TEMPLATE % b"G?T / HTTP/1.1")
    await conn.run_all()
    assert conn.statuses() == conn.expect({"ours": [200, 400], "uvicorn": [400]})
    assert conn.closed


async def test_a_bad_chunk_in_a_pipelined_request_is_refused_after_the_answer_before(
    connect: Connect,
) -> None:
    conn = connect(echo_path)
    conn.feed(SIMPLE_GET + BAD_CHUNK_SIZE_POST)
    await conn.run_all()
    assert conn.statuses() == conn.expect({"ours": [200, 400], "uvicorn": [400]})
    assert conn.closed


async def test_a_connect_request_is_refused_400_and_closed(
    connect: Connect,
) -> None:
    conn = connect(echo_path)
    conn.feed(b"CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n" + SECOND_GET)
    await conn.run_all()
    assert conn.statuses() == [400]
    assert conn.closed


# -- sizes ------------------------------------------------------------------------------


async def test_a_head_past_the_header_cap_is_refused_431_as_it_arrives(
    connect: Connect,
) -> None:
    conn = connect(hello)
    conn.feed(HUGE_HEADERS[0])
    refused = conn.expect(
        {"ours": [b"HTTP/1.1 431 Request Header Fields Too Large"], "uvicorn": []}
    )
    assert conn.status_lines() == refused
    conn.feed(HUGE_HEADERS[1])
    await conn.run_all()
    assert conn.status_lines() == conn.expect({"ours": refused, "uvicorn": [b"HTTP/1.1 200 OK"]})


async def test_a_whole_head_past_the_header_cap_in_one_read_is_refused_431(
    connect: Connect,
) -> None:
    conn = connect(hello)
    conn.feed(HUGE_HEADERS[0] + HUGE_HEADERS[1])
    await conn.run_all()
    expected = {
        "ours": b"HTTP/1.1 431 Request Header Fields Too Large",
        "uvicorn": b"HTTP/1.1 200 OK",
    }
    assert conn.status_lines() == [conn.expect(expected)]


async def test_a_large_body_in_the_read_of_its_head_is_not_counted_as_head(
    connect: Connect,
) -> None:
    conn = connect(echo)
    body = b"x" * 100_000
    conn.feed(b"POST / HTTP/1.1\r\nHost: example.org\r\nContent-Length: 100000\r\n\r\n" + body)
    await conn.run_all()
    assert conn.statuses() == [200]
    assert conn.sent.endswith(b"Body: " + body)


async def test_a_head_in_two_reads_with_a_large_body_in_the_second_is_served(
    connect: Connect,
) -> None:
    conn = connect(echo)
    body = b"x" * 100_000
    conn.feed(b"POST / HTTP/1.1\r\nHost: example.org\r\nContent-Le")
    conn.feed(b"ngth: 100000\r\n\r\n" + body)
    await conn.run_all()
    assert conn.statuses() == [200]
    assert conn.sent.endswith(b"Body: " + body)


async def test_a_head_just_under_the_header_cap_is_served(connect: Connect) -> None:
    line = b"GET / HTTP/1.1\r\nHost: example.org\r\nX-Pad: "
    filler = b"p" * (HEADER_CAP - len(line) - 2 * 1024)
    conn = connect(hello)
    conn.feed(line + filler + b"\r\n\r\n")
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"]


async def test_many_headers_past_the_header_cap_are_refused_431(connect: Connect) -> None:
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60) for i in range(1000))
    conn = connect(hello)
    conn.feed(b"GET / HTTP/1.1\r\nHost: example.org\r\n" + headers + b"\r\n")
    await conn.run_all()
    expected = {
        "ours": b"HTTP/1.1 431 Request Header Fields Too Large",
        "uvicorn": b"HTTP/1.1 200 OK",
    }
    assert conn.status_lines() == [conn.expect(expected)]


async def test_a_100_kb_url_is_refused_414(connect: Connect) -> None:
    paths: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        paths.append(len(scope["path"]))
        await hello(scope, receive, send)

    conn = connect(app)
    conn.feed(LONG_URL_GET)
    await conn.run_all()
    # uvicorn's URL parser takes no URL past 64 KiB: 400 there.
    assert conn.statuses() == conn.expect({"ours": [414], "uvicorn": [400]})
    assert paths == []
    assert conn.closed or conn.transport.eof_written


async def test_a_100_kb_url_in_pieces_is_refused_before_it_ends(connect: Connect) -> None:
    conn = connect(hello)
    pieces = [LONG_URL_GET[i : i + 16 * 1024] for i in range(0, 48 * 1024, 16 * 1024)]
    conn.feed(*pieces)
    assert conn.statuses() == conn.expect({"ours": [414], "uvicorn": []})


async def test_a_long_url_after_a_pipelined_request_is_refused_414(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(SIMPLE_GET + LONG_URL_GET)
    await conn.run_all()
    assert conn.statuses() == conn.expect({"ours": [200, 414], "uvicorn": [400]})
    # Ours lingers: its side shut, the client's bytes read and dropped, then the close.
    assert not conn.transport.read_paused
    conn.loop.advance(3.0)
    assert conn.closed


# -- upgrades ---------------------------------------------------------------------------


@pytest.mark.parametrize("upgrade", [UPGRADE_H2C, UPGRADE_WEBSOCKET], ids=["h2c", "websocket"])
async def test_an_upgrade_request_is_answered_in_http_1_1(connect: Connect, upgrade: bytes) -> None:
    conn = connect(hello)
    conn.feed(upgrade)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"]
    assert conn.sent.endswith(b"Hello, world")


@pytest.mark.parametrize("upgrade", [UPGRADE_H2C, UPGRADE_WEBSOCKET], ids=["h2c", "websocket"])
async def test_a_request_pipelined_after_an_upgrade_request_is_answered(
    connect: Connect, upgrade: bytes
) -> None:
    """uvicorn drops the bytes after an upgrade it does not make: the second request is
    never answered and the connection waits for the keep-alive timeout."""
    conn = connect(echo_path)
    conn.feed(upgrade + SECOND_GET)
    await conn.run_all()
    answered = {"ours": [b"HTTP/1.1 200 OK"] * 2, "uvicorn": [b"HTTP/1.1 200 OK"]}
    assert conn.status_lines() == conn.expect(answered)
    assert conn.sent.endswith(conn.expect({"ours": b"/second", "uvicorn": b"/"}))


async def test_a_request_after_an_upgrade_request_in_a_later_read_is_answered(
    connect: Connect,
) -> None:
    conn = connect(echo_path)
    conn.feed(UPGRADE_H2C)
    await conn.run_all()
    conn.feed(SECOND_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"] * 2
    assert conn.sent.endswith(b"/second")


async def test_an_upgrade_request_with_a_body_is_refused_400(
    connect: Connect,
) -> None:
    """httptools stops parsing at the head of an upgrade request: its body and anything
    after it are left to the new protocol. We refuse it (400, close) rather than hand the
    app an empty body; uvicorn hands the app the empty body."""
    conn = connect(echo)
    conn.feed(UPGRADE_H2C_WITH_BODY + SECOND_GET)
    await conn.run_all()
    expected = {"ours": [b"HTTP/1.1 400 Bad Request"], "uvicorn": [b"HTTP/1.1 200 OK"]}
    assert conn.status_lines() == conn.expect(expected)
    assert conn.sent.endswith(conn.expect({"ours": b"}}", "uvicorn": b"Body: "}))
    assert conn.closed == (conn.kind == "ours")


# -- the app's answer -------------------------------------------------------------------


async def test_a_response_header_with_cr_lf_never_reaches_the_wire(connect: Connect) -> None:
    headers = [(b"content-length", b"0"), (b"key", b"value\r\nCookie: smuggled=value")]
    conn = connect(empty(200, headers))
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert b"smuggled" not in conn.sent
    assert conn.status_lines() == conn.expect(
        {"ours": [b"HTTP/1.1 500 Internal Server Error"], "uvicorn": []}
    )
    assert conn.closed


async def test_an_app_that_raises_before_answering_gets_a_500_and_a_close(
    connect: Connect,
) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    conn = connect(app)
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 500 Internal Server Error"]
    assert conn.closed


async def test_an_app_that_stops_mid_answer_has_its_connection_closed(connect: Connect) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"1", "more_body": True})

    conn = connect(app)
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert b"500" not in conn.sent
    assert conn.closed


async def test_an_app_that_returns_without_answering_gets_a_500(connect: Connect) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        return None

    conn = connect(app)
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 500 Internal Server Error"]
    assert conn.closed


async def test_an_answer_before_the_body_ends_keeps_the_connection(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(START_POST)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"]
    conn.feed(FINISH_POST + SECOND_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"] * 2
    assert not conn.closed


async def test_a_receive_after_the_answer_is_a_disconnect(connect: Connect) -> None:
    after: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await hello(scope, receive, send)
        after.append(await receive())

    conn = connect(app)
    conn.feed(SIMPLE_POST)
    await conn.run_all()
    assert after == [{"type": "http.disconnect"}]


# -- disconnects ------------------------------------------------------------------------


async def test_a_client_gone_early_is_an_http_disconnect_to_the_app(connect: Connect) -> None:
    messages: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (message := await receive())["type"] != "http.disconnect":
            messages.append(message["type"])
        messages.append(message["type"])

    conn = connect(app)
    conn.feed(SIMPLE_POST)
    conn.protocol.eof_received()
    conn.protocol.connection_lost(None)
    await conn.run_all()
    assert messages[-1:] == ["http.disconnect"]


async def test_a_client_gone_mid_answer_runs_the_client_gone_callback(connect: Connect) -> None:
    """Ours only: the router registers a callback instead of a task waiting for
    ``http.disconnect``; uvicorn has no such extension."""
    gone: list[str] = []
    registered = asyncio.Event()
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        when_gone = scope.get("extensions", {}).get(CLIENT_GONE)
        if when_gone is not None:
            when_gone(lambda: gone.append("gone"))
        registered.set()
        await release.wait()

    conn = connect(app)
    conn.feed(SIMPLE_GET)
    running = asyncio.ensure_future(conn.run_all())
    await registered.wait()
    conn.protocol.connection_lost(None)
    assert gone == conn.expect({"ours": ["gone"], "uvicorn": []})
    release.set()
    await running


# -- 100-continue -----------------------------------------------------------------------


async def test_100_continue_is_sent_when_the_app_reads_the_body(connect: Connect) -> None:
    conn = connect(echo)
    conn.feed(EXPECT_100_HEAD)
    running = asyncio.ensure_future(conn.run_all())
    await asyncio.sleep(0)  # the app now waits for the body
    assert conn.sent == b"HTTP/1.1 100 Continue\r\n\r\n"
    conn.feed(FINISH_POST)
    await running
    assert conn.status_lines() == [b"HTTP/1.1 100 Continue", b"HTTP/1.1 200 OK"]
    assert conn.sent.endswith(b'Body: {"hello": "world"}')


async def test_no_100_continue_when_the_app_answers_without_the_body(connect: Connect) -> None:
    """The client may send the body anyway: it is dropped, and the next request served."""
    conn = connect(empty(204))
    conn.feed(EXPECT_100_HEAD)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 204 No Content"]
    conn.feed(FINISH_POST + SECOND_GET)
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 204 No Content"] * 2
    assert b"100 Continue" not in conn.sent and not conn.closed


# -- timers -----------------------------------------------------------------------------


async def test_an_idle_connection_is_closed_at_the_keep_alive_timeout(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(SIMPLE_GET)
    await conn.run_all()
    conn.loop.advance(KEEP_ALIVE_S - 0.5)
    assert not conn.closed
    conn.loop.advance(1.0)
    assert conn.closed
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"]


async def test_pipelined_requests_are_not_cut_by_the_keep_alive_timeout(
    connect: Connect,
) -> None:
    conn = connect(hello)
    conn.feed(SIMPLE_GET + SIMPLE_GET)
    await conn.loop.run_one()
    conn.loop.advance(KEEP_ALIVE_S + 1)
    assert not conn.closed
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"] * 2


async def test_an_incomplete_head_is_answered_408_at_the_header_timeout(
    connect: Connect,
) -> None:
    conn = connect(hello)
    conn.feed(b"GET / HTTP/1.1\r\nHost: exa")
    conn.loop.advance(HEADER_TIMEOUT_S - 0.5)
    assert not conn.closed
    conn.loop.advance(1.0)
    expected = {"ours": [b"HTTP/1.1 408 Request Timeout"], "uvicorn": []}
    assert conn.status_lines() == conn.expect(expected)
    assert conn.closed == (conn.kind == "ours")


async def test_a_silent_connection_is_answered_408_at_the_header_timeout(
    connect: Connect,
) -> None:
    conn = connect(hello)
    conn.loop.advance(HEADER_TIMEOUT_S + 1)
    assert conn.statuses() == conn.expect({"ours": [408], "uvicorn": []})
    assert conn.closed == (conn.kind == "ours")


async def test_the_header_timeout_of_a_pipelined_head_waits_for_the_answer_before(
    connect: Connect,
) -> None:
    """A slow answer is not cut by a 408 written into it: the 408 follows it."""
    app, release = held("/slow")
    conn = connect(app)
    conn.feed(b"GET /slow HTTP/1.1\r\nHost: example.org\r\n\r\nGET /next HTTP/1.1\r\nHo")
    running = asyncio.ensure_future(conn.run_all())
    await asyncio.sleep(0)  # /slow now waits
    conn.loop.advance(HEADER_TIMEOUT_S + 1)
    assert conn.sent == b"" and not conn.closed
    release.set()
    await running
    assert conn.statuses() == conn.expect({"ours": [200, 408], "uvicorn": [200]})
    assert conn.closed == (conn.kind == "ours")


async def test_a_refusal_held_behind_a_slow_answer_is_not_replaced_by_a_408(
    connect: Connect,
) -> None:
    app, release = held("/slow")
    conn = connect(app)
    conn.feed(b"GET /slow HTTP/1.1\r\n\r\n" + INVALID_REQUEST_TEMPLATE % b"G?T / HTTP/1.1")
    running = asyncio.ensure_future(conn.run_all())
    await asyncio.sleep(0)  # /slow now waits
    conn.loop.advance(HEADER_TIMEOUT_S + 1)
    release.set()
    await running
    assert conn.statuses() == conn.expect({"ours": [200, 400], "uvicorn": [400]})
    assert conn.closed


# -- shutdown ---------------------------------------------------------------------------


async def test_shutdown_closes_an_idle_connection_at_once(connect: Connect) -> None:
    conn = connect(hello)
    conn.protocol.shutdown()
    assert conn.sent == b"" and conn.closed


async def test_shutdown_during_a_request_closes_after_its_answer(connect: Connect) -> None:
    conn = connect(hello)
    conn.feed(SIMPLE_GET)
    conn.protocol.shutdown()
    await conn.run_all()
    assert conn.status_lines() == [b"HTTP/1.1 200 OK"]
    assert b"connection: close\r\n" in conn.sent.lower()
    assert conn.closed


# -- through a router over a real socket -------------------------------------------------


@contextlib.asynccontextmanager
async def served(router: InProcessRouter) -> AsyncIterator[int]:
    """The router app behind our protocol on a loopback port, with the limits the router
    gives it from its settings (as ``switchyard router`` does, less uvicorn's server)."""
    settings = router.app.settings
    limits = ConnectionLimits(
        header_timeout_s=settings.timeouts.header_s,
        body_timeout_s=settings.timeouts.body_s,
        max_connections=settings.limits.max_client_connections,
        max_header_bytes=settings.limits.max_header_bytes,
        keep_alive_s=settings.timeouts.keep_alive_s,
    )
    config = SimpleNamespace(loaded=True, loaded_app=router.app)
    state = ServerState()
    loop = asyncio.get_running_loop()

    def protocol() -> ClientConnection:
        return ClientConnection(config, state, {}, loop, limits=limits)

    server = await loop.create_server(protocol, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for conn in list(state.connections):
            conn.transport.close()
        await server.wait_closed()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One ``Content-Length`` answer: its status and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(v) for n, _, v in (h.partition(": ") for h in lines) if n == "content-length")
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def read_answers(reader: asyncio.StreamReader, count: int) -> list[tuple[int, bytes]]:
    return [await read_answer(reader) for _ in range(count)]


async def test_through_a_router_a_request_after_an_upgrade_request_is_answered(
    engine: StubBackend,
) -> None:
    async with running_router(engine.url) as router, served(router) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        upgrade = UPGRADE_H2C.replace(b"GET / ", b"GET /health ")
        writer.write(upgrade + b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        answers = await asyncio.wait_for(read_answers(reader, 2), timeout=10)
        writer.close()
    assert [status for status, _ in answers] == [200, 200]


async def test_through_a_router_a_100_kb_url_is_refused_414(engine: StubBackend) -> None:
    async with running_router(engine.url) as router, served(router) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(LONG_URL_GET.replace(b"GET /", b"GET /v1/models?"))
        status, body = await asyncio.wait_for(read_answer(reader), timeout=10)
        rest = await asyncio.wait_for(reader.read(), timeout=10)  # then the router closes
        writer.close()
    assert (status, orjson.loads(body)["error"]["code"], rest) == (414, "url_too_long", b"")
