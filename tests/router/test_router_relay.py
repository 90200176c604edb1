"""The relay streams bytes untouched, keeps status and headers, and propagates disconnects.

Answers are checked in-process; disconnects go through the router's own server (a process),
whose protocol is what notices them."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.router.conftest import StartRouter
from tests.router.inprocess import running_router
from tests.router.starlette_engine import StarletteEngine
from tests.router.stub_backend import StubBackend
from tests.support import eventually

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


async def test_non_stream_body_is_passed_through(engine: StubBackend) -> None:
    async with running_router(engine.url) as router:
        resp = await router.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["echo"] == BODY


async def test_sse_bytes_arrive_unchanged_and_in_order(engine: StubBackend) -> None:
    engine.state.chunk_interval_s = 0.001
    engine.state.chunks = 20
    async with running_router(engine.url) as router:
        resp = await router.post("/v1/completions", json={**BODY, "stream": True})
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.content == b"".join(b'data: {"i": %d}\n\n' % i for i in range(20))


async def test_upstream_client_error_status_is_relayed_not_retried(engine: StubBackend) -> None:
    engine.state.status = 422
    async with running_router(engine.url) as router:
        resp = await router.post("/v1/completions", json=BODY)
    assert resp.status_code == 422
    assert resp.json()["error"]["message"] == "stub failure"
    assert engine.state.requests == 1


async def test_request_id_is_created_and_forwarded(engine: StubBackend) -> None:
    async with running_router(engine.url) as router:
        resp = await router.post("/v1/completions", json=BODY)
    created = resp.headers["x-request-id"]
    assert len(created) >= 16
    assert engine.state.last_headers["x-request-id"] == created


async def test_client_request_id_is_kept(engine: StubBackend) -> None:
    async with running_router(engine.url) as router:
        resp = await router.post("/v1/completions", json=BODY, headers={"x-request-id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    assert engine.state.last_headers["x-request-id"] == "abc-123"


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
    eventually(lambda: stub.state.disconnected_at, 2, 0.005, "the engine never saw the abort")
    # The time is the point: the abort reaches the engine at once, not at a later write.
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
    time.sleep(1.0)  # the stall is the scenario: the router's buffers to the reader fill
    sock.close()
    counts = starlette_engine.counts
    eventually(lambda: counts.aborted, 5)
    assert (counts.aborted, counts.finished) == (1, 0)
