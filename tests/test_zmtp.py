"""``switchyard.net.zmtp.subscribe``: a ZMTP 3.0 subscriber in the event loop, read against
libzmq's own publishers (pyzmq PUB sockets)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from switchyard.loadtest.procs import free_port
from switchyard.net import zmtp

pytestmark = pytest.mark.timeout(30)


async def until_received(pub: zmq.Socket[bytes], stream: AsyncIterator[list[bytes]]) -> list[bytes]:
    """Publish probes until one arrives (the subscription takes a moment to reach the PUB),
    then a fence; returns the first message after the probes (the fence, if all is well)."""
    pending = asyncio.ensure_future(anext(stream))
    async with asyncio.timeout(10):
        while not pending.done():
            pub.send_multipart([b"probe"])
            await asyncio.wait([pending], timeout=0.02)
    assert pending.result() == [b"probe"]
    nxt = asyncio.ensure_future(anext(stream))
    pub.send_multipart([b"fence"])
    async with asyncio.timeout(5):
        while (got := await nxt) == [b"probe"]:  # probes already on their way
            nxt = asyncio.ensure_future(anext(stream))
    return got


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


async def test_multipart_messages_arrive_whole_and_in_order(ctx: zmq.Context) -> None:
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stream = zmtp.subscribe(f"tcp://127.0.0.1:{port}")
    assert await until_received(pub, stream) == [b"fence"]
    sent = [[b"topic", i.to_bytes(8, "big"), bytes([i % 251]) * (i * 37)] for i in range(200)]
    for frames in sent:
        pub.send_multipart(frames)
    async with asyncio.timeout(5):
        got = [await anext(stream) for _ in sent]
    assert got == sent  # frames of 0 to 7,363 bytes: short and long sizes
    await stream.aclose()


async def test_a_subscriber_started_before_its_publisher_connects_once_it_binds(
    ctx: zmq.Context,
) -> None:
    port = free_port()
    stream = zmtp.subscribe(f"tcp://127.0.0.1:{port}")
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.3)  # refused a few times meanwhile
    assert not first.done()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    async with asyncio.timeout(10):
        while not first.done():
            pub.send_multipart([b"hello"])
            await asyncio.wait([first], timeout=0.02)
    assert first.result() == [b"hello"]
    await stream.aclose()


async def test_a_restarted_publisher_is_read_again(ctx: zmq.Context) -> None:
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    stream = zmtp.subscribe(f"tcp://127.0.0.1:{port}")
    assert await until_received(pub, stream) == [b"fence"]
    pub.close(linger=0)
    await asyncio.sleep(0.2)
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    assert await until_received(pub, stream) == [b"fence"]
    pub.send_multipart([b"after", b"restart"])
    async with asyncio.timeout(5):
        assert await anext(stream) == [b"after", b"restart"]
    await stream.aclose()


async def test_a_publisher_with_heartbeats_keeps_the_connection(ctx: zmq.Context) -> None:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.HEARTBEAT_IVL, 50)
    pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 150)
    monitor = pub.get_monitor_socket()
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stream = zmtp.subscribe(f"tcp://127.0.0.1:{port}")
    assert await until_received(pub, stream) == [b"fence"]
    await asyncio.sleep(0.6)  # four heartbeat timeouts: each PING was answered
    events = []
    while monitor.poll(0):
        events.append(recv_monitor_message(monitor)["event"])
    assert zmq.EVENT_DISCONNECTED not in events
    assert events.count(zmq.EVENT_ACCEPTED) == 1
    await stream.aclose()


async def test_an_ipc_publisher_is_read(ctx: zmq.Context, tmp_path: Path) -> None:
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/events")
    stream = zmtp.subscribe(f"ipc://{tmp_path}/events")
    assert await until_received(pub, stream) == [b"fence"]
    await stream.aclose()


async def test_an_ipc_publisher_in_the_abstract_namespace_is_read(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    endpoint = f"ipc://@switchyard-test-{tmp_path.name}"
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    stream = zmtp.subscribe(endpoint)
    assert await until_received(pub, stream) == [b"fence"]
    await stream.aclose()


async def subscribed_to(
    peer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    caplog: pytest.LogCaptureFixture,
    for_s: float,
) -> bool:
    """Subscribe to a scripted TCP peer for ``for_s`` (warnings captured); whether a
    message came meanwhile."""
    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reading = asyncio.ensure_future(anext(zmtp.subscribe(f"tcp://127.0.0.1:{port}")))
    with caplog.at_level(logging.WARNING, "switchyard.net.zmtp"):
        await asyncio.sleep(for_s)
    came = reading.done()
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    server.close()
    return came


async def test_a_peer_that_is_not_zmq_is_warned_of_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answered = 0

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        answered += 1
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    assert not await subscribed_to(http, caplog, 0.5)
    assert answered >= 2
    assert "not a ZMQ peer" in caplog.text


async def test_a_zmq_peer_that_is_no_publisher_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A PULL socket's side of the handshake, byte by byte (ZMTP 3.0, NULL mechanism).
    greeting = b"\xff" + bytes(7) + b"\x01\x7f" + b"\x03\x00" + b"NULL" + bytes(16) + bytes(32)
    body = b"\x05READY" + b"\x0bSocket-Type" + b"\x00\x00\x00\x04PULL"
    ready = bytes([0x04, len(body)]) + body

    async def pull(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(greeting + ready)
        await reader.read(1000)
        writer.close()

    assert not await subscribed_to(pull, caplog, 0.3)
    assert "the peer is a PULL socket, not PUB" in caplog.text


def test_an_endpoint_that_is_neither_tcp_nor_ipc_is_refused() -> None:
    async def first() -> None:
        await anext(zmtp.subscribe("udp://127.0.0.1:5557"))

    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        asyncio.run(first())


async def test_messages_taken_on_arrival_are_not_yielded_and_all_keep_their_order(
    ctx: zmq.Context,
) -> None:
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    handled: list[list[bytes]] = []  # taken or yielded, in the order it happened
    taken: list[list[bytes]] = []

    def take(frames: list[bytes]) -> bool:
        if frames[0] != b"even":
            return False
        taken.append(frames)
        handled.append(frames)
        return True

    stream = zmtp.subscribe(f"tcp://127.0.0.1:{port}", take)
    assert await until_received(pub, stream) == [b"fence"]
    sent = [[b"even" if i % 2 == 0 else b"odd", str(i).encode()] for i in range(100)]
    for frames in sent:
        pub.send_multipart(frames)
    pub.send_multipart([b"last"])
    async with asyncio.timeout(5):
        while (got := await anext(stream)) != [b"last"]:
            assert got not in taken
            handled.append(got)
    assert taken[0] == sent[0]  # it came to an empty queue
    # An even message behind a queued odd one waits its turn in the queue, not in take.
    assert handled == sent
    await stream.aclose()
