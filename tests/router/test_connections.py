"""Client connections are bounded: head and body deadlines, idle keep-alive, a connection cap."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import orjson
import pytest

from tests.router.stub_backend import StubBackend
from tests.support import Server, eventually, free_port, one_process

StartRouter = Callable[..., Server]


@pytest.fixture
def start_router() -> Iterator[StartRouter]:
    """A router process; the start-up allowance is generous for a busy machine."""
    started: list[Server] = []

    def start(*workers: str, args: tuple[str, ...] = ()) -> Server:
        port = free_port()
        argv = ["router", "--port", str(port), *(f"--worker={w}" for w in workers)]
        argv += [*one_process(args), *args]
        server = Server(argv, port, start_timeout_s=90).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the router sends until it closes the connection, and when it closed."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic()


def health_request() -> bytes:
    return b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"


def test_a_connection_that_sends_nothing_gets_408_after_the_header_timeout(
    start_router: StartRouter, stub: StubBackend
) -> None:
    router = start_router(stub.url, args=("--timeouts-header-s", "0.5"))
    sock = connect(router.port)
    opened = time.monotonic()
    data, closed = read_until_closed(sock)
    assert 0.4 < closed - opened < 5
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert orjson.loads(body)["error"]["code"] == "request_timeout"


def test_a_trickled_request_head_is_cut_at_the_header_timeout(
    start_router: StartRouter, stub: StubBackend
) -> None:
    router = start_router(stub.url, args=("--timeouts-header-s", "0.5"))
    sock = connect(router.port)
    opened = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nx-slow: ")
    data, closed = read_until_closed(sock)
    assert closed - opened < 5 and data.startswith(b"HTTP/1.1 408")


def test_a_body_that_stops_arriving_is_cut_at_the_body_timeout(
    start_router: StartRouter, stub: StubBackend
) -> None:
    router = start_router(stub.url, args=("--timeouts-body-s", "0.5"))
    sock = connect(router.port)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"model":'
    )
    sent = time.monotonic()
    _, closed = read_until_closed(sock)
    assert 0.4 < closed - sent < 5
    assert stub.state.requests == 0


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(
    start_router: StartRouter, stub: StubBackend
) -> None:
    router = start_router(stub.url, args=("--timeouts-keep-alive-s", "0.5"))
    sock = connect(router.port)
    sock.sendall(health_request())
    first = b""
    while not first.endswith(b"}"):  # the whole answer, head and body (a JSON object)
        first += sock.recv(65536)
    answered = time.monotonic()
    assert first.startswith(b"HTTP/1.1 200")
    rest, closed = read_until_closed(sock)
    assert rest == b"" and 0.4 < closed - answered < 5


def test_over_the_connection_cap_requests_get_503_too_many_connections(
    start_router: StartRouter, stub: StubBackend
) -> None:
    router = start_router(stub.url, args=("--limits-max-client-connections", "2"))
    held = [connect(router.port), connect(router.port)]
    for sock in held:
        sock.sendall(health_request())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    extra = connect(router.port)
    extra.sendall(health_request())
    data, _ = read_until_closed(extra)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503")
    assert b"x-switchyard-worker: none" in head.lower()
    assert orjson.loads(body)["error"]["code"] == "too_many_connections"
    held[0].close()

    def answered() -> bool:  # once the router has seen the close
        again = connect(router.port)
        again.sendall(health_request())
        return again.recv(65536).startswith(b"HTTP/1.1 200")

    eventually(answered, 5, 0.05)


def test_a_head_growing_past_the_header_cap_is_refused_431_before_it_ends(
    start_router: StartRouter, stub: StubBackend
) -> None:
    """The head never ends: the router answers 431 as the bytes pass its cap instead of
    buffering them until the header timeout."""
    router = start_router(stub.url, args=("--timeouts-header-s", "30"))
    sock = connect(router.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: router\r\nx-filler: ")
    sent = time.monotonic()
    try:
        for _ in range(64):
            sock.sendall(b"a" * 16384)
    except OSError:
        pass  # the router closed the connection while we were still sending
    data, closed = read_until_closed(sock)
    assert closed - sent < 20
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    assert orjson.loads(body)["error"]["code"] == "headers_too_large"
