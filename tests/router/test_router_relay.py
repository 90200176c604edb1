"""The relay streams bytes untouched, keeps status and headers, and propagates disconnects."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.router.conftest import StartRouter
from tests.router.starlette_engine import StarletteEngine
from tests.router.stub_backend import StubBackend

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "stub-model", "prompt": "hi"}
STREAM_PAYLOAD = b'{"model": "stub-model", "prompt": "hi", "stream": true}'
STREAM_REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(STREAM_PAYLOAD), STREAM_PAYLOAD)
)


@pytest.fixture
def starlette_engine() -> Iterator[StarletteEngine]:
    engine = StarletteEngine().start()
    yield engine
    engine.stop()


def test_non_stream_body_is_passed_through(stub: StubBackend, start_router: StartRouter) -> None:
    router = start_router(stub.url).url
    resp = httpx.post(router + "/v1/completions", json=BODY)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["echo"] == BODY


def test_sse_bytes_arrive_unchanged_and_in_order(
    stub: StubBackend, start_router: StartRouter
) -> None:
    stub.state.chunk_interval_s = 0.001
    router = start_router(stub.url).url
    with httpx.stream("POST", router + "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        received = b""
        for chunk in resp.iter_raw():
            received += chunk
            if received.count(b"\n\n") >= 20:
                break
    expected = b"".join(b'data: {"i": %d}\n\n' % i for i in range(20))
    assert received.startswith(expected)


def test_upstream_client_error_status_is_relayed_not_retried(
    stub: StubBackend, start_router: StartRouter
) -> None:
    router = start_router(stub.url).url
    stub.state.status = 422
    resp = httpx.post(router + "/v1/completions", json=BODY)
    assert resp.status_code == 422
    assert resp.json()["error"]["message"] == "stub failure"
    assert stub.state.requests == 1


def test_request_id_is_created_and_forwarded(stub: StubBackend, start_router: StartRouter) -> None:
    router = start_router(stub.url).url
    resp = httpx.post(router + "/v1/completions", json=BODY)
    created = resp.headers["x-request-id"]
    assert len(created) >= 16
    assert stub.state.last_headers["x-request-id"] == created


def test_client_request_id_is_kept(stub: StubBackend, start_router: StartRouter) -> None:
    router = start_router(stub.url).url
    resp = httpx.post(router + "/v1/completions", json=BODY, headers={"x-request-id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    assert stub.state.last_headers["x-request-id"] == "abc-123"


def test_client_disconnect_mid_stream_aborts_upstream_within_100ms(
    stub: StubBackend, start_router: StartRouter
) -> None:
    stub.state.chunk_interval_s = 0.005
    router = start_router(stub.url)
    sock = socket.create_connection(("127.0.0.1", router.port))
    sock.sendall(STREAM_REQUEST)
    received = b""
    while received.count(b"data:") < 5:
        received += sock.recv(65536)
    sock.close()
    closed_at = time.monotonic()
    deadline = closed_at + 2
    while not stub.state.disconnected_at and time.monotonic() < deadline:
        time.sleep(0.005)
    assert stub.state.disconnected_at, "the engine never saw the abort"
    assert stub.state.disconnected_at[0] - closed_at < 0.1


def test_a_stream_abandoned_after_its_reader_stalled_is_aborted_in_the_engine(
    starlette_engine: StarletteEngine, start_router: StartRouter
) -> None:
    # The reader stops for a second: the router's buffers to it fill, the relay pauses
    # reading from the engine, and the engine blocks writing. The disconnect must still
    # reach the engine's stream (on vLLM's HTTP stack) and cancel it.
    router = start_router(starlette_engine.url)
    sock = socket.create_connection(("127.0.0.1", router.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(STREAM_REQUEST)
    received = b""
    while received.count(b"data:") < 3:
        piece = sock.recv(100)
        assert piece, received
        received += piece
    time.sleep(1.0)
    sock.close()
    deadline = time.monotonic() + 5
    counts = starlette_engine.counts
    while not counts.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (counts.aborted, counts.finished) == (1, 0)
