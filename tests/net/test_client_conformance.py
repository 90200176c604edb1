"""Our HTTP/1.1 client held to the protocol: a scripted worker answers from a table of
byte strings (and can close, reset or trickle), and every case is followed by another
request on the same pool, which must reuse the connection where the answer left it
usable and replace it where it did not."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from switchyard.net.errors import (
    InvalidHeader,
    PayloadCut,
    RemoteProtocolError,
    ResponseHeadTooLarge,
    ServerDisconnected,
    TransportError,
)
from switchyard.net.httpclient import ConnectionPool

pytestmark = pytest.mark.timeout(30)

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\nok"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
SWITCHING = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
HTTP10_TO_CLOSE = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"
NO_CONTENT = b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"
NOT_MODIFIED = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n"
HEAD_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
LENGTH_AND_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nok\r\n0\r\n\r\n"
)
CUT_CHUNK = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"
BAD_STATUS_LINE = b"HTTP/1.1 2OO OK\r\nContent-Length: 2\r\n\r\nok"
HEAD_CAP = 4096
HUGE_HEAD = (
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (HEAD_CAP * 4) + b"\r\nContent-Length: 2\r\n\r\nok"
)
PART_OF_BODY = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab"

# Steps a scripted answer takes besides writing bytes.
CLOSE = "close"  # close the connection (FIN)
RESET = "reset"  # close with SO_LINGER 0 (RST)
GO = "go"  # wait until the test has the answer's head
ENDLESS = "endless"  # header bytes until the client hangs up


@dataclass(frozen=True)
class Trickle:
    """Write ``data`` a byte at a time, yielding to the loop between bytes."""

    data: bytes


Step = bytes | str | Trickle


@dataclass
class ScriptedWorker:
    """Answers the n-th request with the n-th script of ``answers`` (then ``OK``)."""

    answers: deque[list[Step]]
    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await self._request(reader):
                script: list[Step] = self.answers.popleft() if self.answers else [OK]
                if not await self._answer(script, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed.set()

    async def _request(self, reader: asyncio.StreamReader) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":")[1]))
        self.requests.append(head)
        return True

    async def _answer(self, script: list[Step], writer: asyncio.StreamWriter) -> bool:
        """Run ``script``; False once it ended the connection."""
        for step in script:
            if isinstance(step, bytes):
                writer.write(step)
                await writer.drain()
            elif isinstance(step, Trickle):
                for i in range(len(step.data)):
                    writer.write(step.data[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(0)
            elif step == GO:
                await self.go.wait()
            elif step == ENDLESS:
                writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
                for _ in range(4096):  # 32 MiB at most, far past any cap
                    writer.write(b"a" * 8192)
                    await writer.drain()
            elif step == RESET:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return False
            elif step == CLOSE:
                return False
        return True


Start = Callable[..., Awaitable[ScriptedWorker]]


@pytest.fixture
async def scripted() -> AsyncIterator[Start]:
    """Starts a scripted worker on 127.0.0.1 with its answers, one list of steps each."""
    servers: list[asyncio.Server] = []

    async def start(*answers: list[Step]) -> ScriptedWorker:
        worker = ScriptedWorker(deque(answers))
        server = await asyncio.start_server(worker.handle, "127.0.0.1", 0)
        servers.append(server)
        worker.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        return worker

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def pool() -> AsyncIterator[ConnectionPool]:
    pool = ConnectionPool(connect_timeout_s=2.0, max_head_bytes=HEAD_CAP)
    yield pool
    await pool.close()


@dataclass(frozen=True)
class Case:
    """An answer script, what the client makes of it (status and body, or an error),
    and whether its connection then serves the next request."""

    script: tuple[Step, ...]
    expect: tuple[int, bytes] | type[TransportError]
    kept: bool
    method: str = "POST"


CASES = {
    "100 Continue before the final answer is skipped": Case((CONTINUE + OK,), (200, b"ok"), True),
    "103 Early Hints with headers before the final answer is skipped": Case(
        (EARLY_HINTS, CONTINUE, OK), (200, b"ok"), True
    ),
    "101 Switching Protocols, never asked for, is an error": Case(
        (SWITCHING,), RemoteProtocolError, False
    ),
    "an HTTP/1.0 body without length runs until the close": Case(
        (HTTP10_TO_CLOSE, CLOSE), (200, b"all of it"), False
    ),
    "204 has no body whatever its Content-Length": Case((NO_CONTENT,), (204, b""), True),
    "304 has no body whatever its Content-Length": Case((NOT_MODIFIED,), (304, b""), True),
    "an answer to HEAD has no body whatever its Content-Length": Case(
        (HEAD_ANSWER,), (200, b""), True, method="HEAD"
    ),
    "Content-Length with Transfer-Encoding is an error": Case(
        (LENGTH_AND_CHUNKED,), RemoteProtocolError, False
    ),
    "a chunk cut by the close is PayloadCut": Case((CUT_CHUNK, GO, CLOSE), PayloadCut, False),
    "a head over the cap is an error": Case((HUGE_HEAD,), ResponseHeadTooLarge, False),
    "an endless head is an error at the cap": Case((ENDLESS,), ResponseHeadTooLarge, False),
    "a malformed status line is an error": Case((BAD_STATUS_LINE,), RemoteProtocolError, False),
    "a head and body trickled a byte at a time are read whole": Case(
        (Trickle(CONTINUE + OK),), (200, b"ok"), True
    ),
    "a reset mid-body is PayloadCut": Case((PART_OF_BODY, GO, RESET), PayloadCut, False),
    "a close after the request was written, before any byte, may have started it": Case(
        (CLOSE,), ServerDisconnected, False
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_client_conformance(scripted: Start, pool: ConnectionPool, case: Case) -> None:
    worker = await scripted([OK], list(case.script))
    warm = await pool.post(worker.url, b"{}", {})
    assert await warm.read() == b"ok"  # the case runs on a kept-alive connection

    async def exchange() -> tuple[int, bytes]:
        if case.method == "POST":
            resp = await pool.post(worker.url, b"{}", {"content-type": "application/json"})
        else:
            resp = await pool.request(case.method, worker.url)
        worker.go.set()
        return resp.status, await resp.read()

    async with asyncio.timeout(10):
        if isinstance(case.expect, tuple):
            assert await exchange() == case.expect
        else:
            with pytest.raises(case.expect) as raised:
                await exchange()
            assert raised.value.maybe_started  # the request was written: never resent
        then = await pool.post(worker.url, b"{}", {})
        assert (then.status, await then.read()) == (200, b"ok")
    assert len(worker.requests) == 3  # each request written once
    assert worker.connections == (1 if case.kept else 2)


async def test_interim_answers_headers_are_not_the_final_ones(scripted, pool) -> None:
    worker = await scripted([EARLY_HINTS + OK])
    resp = await pool.post(worker.url, b"{}", {})
    assert [name for name, _ in resp.raw_headers] == [b"Content-Type", b"Content-Length"]
    assert await resp.read() == b"ok"


async def test_a_kept_connection_closed_while_idle_is_replaced_unwritten(
    scripted, pool: ConnectionPool
) -> None:
    worker = await scripted([OK, GO, CLOSE])
    warm = await pool.post(worker.url, b"{}", {})
    assert await warm.read() == b"ok"
    (idle,) = pool._idle[next(iter(pool._idle))]
    assert idle.transport is not None
    idle.transport.pause_reading()  # the worker's FIN stays unread by the loop
    worker.go.set()
    await worker.closed.wait()
    resp = await pool.post(worker.url, b"{}", {})
    assert (resp.status, await resp.read()) == (200, b"ok")
    assert (worker.connections, len(worker.requests)) == (2, 2)  # none written on the old one


UNSAFE_HEADERS = {
    "CR LF in a value": {"x-note": "a\r\nx-injected: 1"},
    "LF in a value": {"x-note": "a\nGET / HTTP/1.1"},
    "NUL in a value": {"x-note": "a\x00b"},
    "CR LF in a name": {"x-a\r\nx-b": "1"},
    "a name that is no token": {"x a": "1"},
}


@pytest.mark.parametrize("headers", UNSAFE_HEADERS.values(), ids=UNSAFE_HEADERS.keys())
async def test_unsafe_headers_are_refused_before_any_byte_is_written(
    scripted, pool: ConnectionPool, headers: dict[str, str]
) -> None:
    worker = await scripted()
    warm = await pool.post(worker.url, b"{}", {})
    assert await warm.read() == b"ok"
    with pytest.raises(InvalidHeader) as raised:
        await pool.post(worker.url, b"{}", headers)
    assert isinstance(raised.value, ValueError) and not raised.value.maybe_started
    then = await pool.post(worker.url, b"{}", {})
    assert await then.read() == b"ok"
    assert (worker.connections, len(worker.requests)) == (1, 2)  # the connection untouched
