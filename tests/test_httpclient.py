"""The HTTP/1.1 client for calls to workers, against scripted servers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from switchyard.net.errors import ConnectError, InvalidURL, PayloadCut, ServerDisconnected
from switchyard.net.httpclient import ConnectionPool
from tests.support import eventually_async, free_port

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Worker"], Awaitable[None]]


@dataclass
class Worker:
    """A scripted server: ``script`` runs per connection; ``requests`` holds each request head."""

    script: Script
    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """Read one request (head and Content-Length body); b"" if the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        await reader.readexactly(length)
        self.requests.append(head)
        return head


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[Worker]]]:
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> Worker:
        worker = Worker(script)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            worker.connections += 1
            try:
                await script(reader, writer, worker)
            finally:
                writer.close()
                worker.closed.set()

        port = free_port()
        servers.append(await asyncio.start_server(handle, "127.0.0.1", port))
        worker.url = f"http://127.0.0.1:{port}/v1/completions"
        return worker

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def pool() -> AsyncIterator[ConnectionPool]:
    pool = ConnectionPool(connect_timeout_s=1.0)
    yield pool
    await pool.close()


async def answer_ok(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
    while await worker.request(r):
        w.write(OK)


async def test_sequential_requests_share_one_kept_alive_connection(serve, pool) -> None:
    worker = await serve(answer_ok)
    for _ in range(3):
        resp = await pool.post(worker.url, b'{"a":1}', {"content-type": "application/json"})
        assert (resp.status, await resp.read()) == (200, b"{}")
    assert worker.connections == 1
    assert len(worker.requests) == 3


async def test_request_carries_host_length_and_the_given_headers(serve, pool) -> None:
    worker = await serve(answer_ok)
    resp = await pool.post(worker.url, b"12345", {"x-request-id": "r1"})
    await resp.read()
    head = worker.requests[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    host = worker.url.split("/")[2].encode()
    assert b"\r\nHost: " + host + b"\r\n" in head
    assert b"\r\nContent-Length: 5\r\n" in head
    assert b"\r\nx-request-id: r1\r\n" in head


async def test_chunks_of_a_stream_are_read_as_they_arrive(serve, pool) -> None:
    release = asyncio.Event()

    async def stream(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        await worker.request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        w.write(b"Transfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await release.wait()
        w.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await w.drain()

    worker = await serve(stream)
    resp = await pool.post(worker.url, b"{}", {})
    assert resp.content_type == b"text/event-stream"
    assert await resp.readany() == b"first"
    release.set()
    assert await resp.read() == b"second"
    assert await resp.readany() == b""


def chunks_every(gap_s: float, count: int, then_silent: bool) -> Script:
    """A chunked stream of ``count`` chunks ``gap_s`` apart, then its end or silence."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        await worker.request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(count):
            w.write(b"1\r\nx\r\n")
            await w.drain()
            await asyncio.sleep(gap_s)
        if then_silent:
            await asyncio.sleep(30)
        w.write(b"0\r\n\r\n")
        await w.drain()

    return script


async def test_a_stream_silent_for_its_idle_timeout_raises_timeout_error(serve, pool) -> None:
    worker = await serve(chunks_every(0.0, 1, then_silent=True))
    resp = await pool.post(worker.url, b"{}", {})
    resp.idle_timeout(0.3)
    assert await resp.readany() == b"x"
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError):
        await resp.readany()
    assert 0.25 <= loop.time() - began < 2.0
    resp.close()


async def test_chunks_closer_than_the_idle_timeout_keep_a_long_stream_going(serve, pool) -> None:
    worker = await serve(chunks_every(0.1, 8, then_silent=False))
    resp = await pool.post(worker.url, b"{}", {})
    resp.idle_timeout(0.3)
    assert await resp.read() == b"x" * 8  # 0.8 s in all, never 0.3 s without a chunk


def answer_then_close(raw: bytes) -> Script:
    """A worker that answers one request with ``raw`` and closes the connection."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        await worker.request(r)
        w.write(raw)
        await w.drain()

    return script


async def test_a_body_without_length_ends_when_the_worker_closes(serve, pool) -> None:
    worker = await serve(
        answer_then_close(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
    )
    resp = await pool.post(worker.url, b"{}", {})
    assert await resp.read() == b"all of it"


async def test_an_answer_cut_after_its_head_raises_payload_cut(serve, pool) -> None:
    worker = await serve(answer_then_close(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart"))
    resp = await pool.post(worker.url, b"{}", {})
    assert await resp.readany() == b"part"
    with pytest.raises(PayloadCut):
        await resp.readany()


async def test_a_worker_that_closes_before_answering_is_a_disconnect(serve, pool) -> None:
    worker = await serve(answer_then_close(b""))
    with pytest.raises(ServerDisconnected):
        await pool.post(worker.url, b"{}", {})


async def test_a_refused_connection_raises_a_connect_error(pool) -> None:
    with pytest.raises(ConnectError) as raised:
        await pool.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}", {})
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)


async def test_a_url_without_a_host_is_invalid(pool) -> None:
    with pytest.raises(InvalidURL):
        await pool.post("ftp:///v1/completions", b"{}", {})


async def test_a_request_the_worker_read_and_dropped_is_not_sent_again(serve, pool) -> None:
    async def once_per_connection(
        r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker
    ) -> None:
        await worker.request(r)
        w.write(OK)
        await worker.request(r)  # read, then dropped unanswered: closed as it came

    worker = await serve(once_per_connection)
    first = await pool.post(worker.url, b"{}", {})
    await first.read()
    with pytest.raises(ServerDisconnected) as raised:
        await pool.post(worker.url, b"{}", {})
    assert raised.value.maybe_started
    assert (worker.connections, len(worker.requests)) == (1, 2)  # never written twice


async def test_a_kept_alive_connection_the_worker_closed_is_replaced(serve, pool) -> None:
    async def one_per_connection(
        r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker
    ) -> None:
        await worker.request(r)
        w.write(OK)
        await w.drain()  # then closed while idle, as a worker's keep-alive timer does

    worker = await serve(one_per_connection)
    first = await pool.post(worker.url, b"{}", {})
    await first.read()
    await worker.closed.wait()
    second = await pool.post(worker.url, b"{}", {})
    assert (second.status, await second.read()) == (200, b"{}")
    assert (worker.connections, len(worker.requests)) == (2, 2)


async def test_connections_per_worker_are_capped(serve) -> None:
    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        while await worker.request(r):
            await asyncio.sleep(0.05)
            w.write(OK)

    worker = await serve(slow)
    pool = ConnectionPool(connect_timeout_s=1.0, max_per_origin=1)

    async def one() -> bytes:
        resp = await pool.post(worker.url, b"{}", {})
        return await resp.read()

    assert await asyncio.gather(one(), one(), one()) == [b"{}"] * 3
    assert worker.connections == 1
    await pool.close()


async def test_an_answer_left_unfinished_closes_its_connection(serve, pool) -> None:
    async def endless(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        while await worker.request(r):
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        # the client left mid-answer: this connection is over

    worker = await serve(endless)
    resp = await pool.post(worker.url, b"{}", {})
    assert await resp.readany() == b"abc"
    resp.close()
    await asyncio.wait_for(worker.closed.wait(), 2)
    again = await pool.post(worker.url, b"{}", {})
    again.close()
    assert worker.connections == 2


async def test_cancelling_a_request_closes_its_connection(serve, pool) -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        await worker.request(r)
        await r.read()  # until the client closes

    worker = await serve(silent)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await pool.post(worker.url, b"{}", {})
    await asyncio.wait_for(worker.closed.wait(), 2)


async def test_a_large_answer_read_slowly_arrives_whole(serve, pool) -> None:
    payload = bytes(range(256)) * (12 * 1024)  # 3 MiB, past the read-pause mark

    async def large(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        while await worker.request(r):
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
            await w.drain()

    worker = await serve(large)
    for _ in range(2):  # the second on the same connection, once the first was read
        resp = await pool.post(worker.url, b"{}", {})
        parts = []
        while chunk := await resp.readany():
            parts.append(chunk)
            await asyncio.sleep(0.001)
        assert b"".join(parts) == payload
    assert worker.connections == 1


async def test_no_answer_head_within_the_timeout_raises_and_closes_the_connection(
    serve, pool
) -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        await worker.request(r)
        await r.read()

    worker = await serve(silent)
    with pytest.raises(TimeoutError):
        await pool.post(worker.url, b"{}", {}, timeout_s=0.2)
    await asyncio.wait_for(worker.closed.wait(), 2)


async def test_a_get_sends_a_bodiless_head_and_keeps_its_connection(
    serve: Callable[[Script], Awaitable[Worker]], pool: ConnectionPool
) -> None:
    worker = await serve(answer_ok)
    for _ in range(2):
        resp = await pool.get(worker.url.replace("/v1/completions", "/health?x=1"))
        assert (resp.status, await resp.read()) == (200, b"{}")
    assert worker.connections == 1
    assert worker.requests[0].startswith(b"GET /health?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"content-length" not in worker.requests[0].lower()


async def test_a_piped_stream_hands_each_piece_to_the_writer_as_it_arrives(serve, pool) -> None:
    release = asyncio.Event()

    async def stream(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        await worker.request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await release.wait()
        w.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await w.drain()

    worker = await serve(stream)
    resp = await pool.post(worker.url, b"{}", {})
    pieces: list[bytes] = []

    def write(piece: bytes) -> asyncio.Future[None] | None:
        pieces.append(piece)
        return None

    piping = asyncio.ensure_future(resp.pipe(write))
    await eventually_async(lambda: pieces, 2)
    assert pieces == [b"first"] and not piping.done()  # handed before the body ended
    release.set()
    async with asyncio.timeout(2):
        await piping
    assert pieces == [b"first", b"second"]


async def test_a_piped_stream_silent_for_its_idle_timeout_raises_timeout_error(serve, pool) -> None:
    worker = await serve(chunks_every(0.0, 1, then_silent=True))
    resp = await pool.post(worker.url, b"{}", {})
    resp.idle_timeout(0.3)
    pieces: list[bytes] = []
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError):
        await resp.pipe(lambda piece: pieces.append(piece))  # type: ignore[func-returns-value]
    assert pieces == [b"x"]
    assert 0.25 <= loop.time() - began < 2.0
    resp.close()


async def test_a_slow_pipe_writer_pauses_the_connection_until_it_catches_up(serve, pool) -> None:
    payload = bytes(range(256)) * (12 * 1024)  # 3 MiB: many pieces

    async def large(r: asyncio.StreamReader, w: asyncio.StreamWriter, worker: Worker) -> None:
        await worker.request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        await w.drain()

    worker = await serve(large)
    resp = await pool.post(worker.url, b"{}", {})
    loop = asyncio.get_running_loop()
    pieces: list[bytes] = []
    caught_up: asyncio.Future[None] | None = None
    early: list[bytes] = []

    def write(piece: bytes) -> asyncio.Future[None] | None:
        nonlocal caught_up
        if caught_up is not None and not caught_up.done():
            early.append(piece)  # came while the writer asked to wait
        pieces.append(piece)
        caught_up = loop.create_future()
        loop.call_later(0.002, caught_up.set_result, None)
        return caught_up

    async with asyncio.timeout(10):
        await resp.pipe(write)
    assert b"".join(pieces) == payload
    assert early == []
