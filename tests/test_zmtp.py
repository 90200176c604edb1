"""``switchyard.net.zmtp.subscribe``: a ZMTP 3.1 subscriber in the event loop, read against
libzmq's own publishers (pyzmq PUB sockets) and against a scripted peer that breaks the
protocol, announces a frame of 2^40 bytes or falls silent without closing."""

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
from tests import zmtp_peer as peer
from tests.support import eventually_async

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


# -- limits and liveness, against a scripted peer that lies or falls silent ----------------

FAST = zmtp.ZmtpOptions(max_frame_bytes=1 << 20, heartbeat_s=0.05, heartbeat_timeout_s=0.2)
HELLO = [b"topic", b"\x00" * 8, b"hello"]


@pytest.fixture(autouse=True)
def quick_reconnects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused handshake backs off; at the production pace a run of liars takes seconds."""
    monkeypatch.setattr(zmtp, "RECONNECT_S", 0.01)
    monkeypatch.setattr(zmtp, "RECONNECT_MAX_S", 0.05)


class Downs(list[BaseException | None]):
    """What ``on_down`` was told, in order."""

    def __call__(self, reason: BaseException | None) -> None:
        self.append(reason)


def lying_once(lie: bytes) -> peer.Script:
    """Send ``lie`` (after the handshake when it starts with no greeting), then hang up."""

    async def script(p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        writer.write(lie)
        await writer.drain()
        while await reader.read(65536):
            pass

    return script


def after_handshake(lie: bytes) -> peer.Script:
    async def script(p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        await p.handshake(reader, writer)
        writer.write(lie)
        await p.drain_silently(reader)

    return script


async def publishing(p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
    await peer.publishes(p, reader, writer, peer.message(*HELLO))


GREETING_NO_SIGNATURE = b"\xff" + bytes(8) + b"\x7e" + peer.GREETING[10:]
GREETING_ZMTP_2 = peer.GREETING[:10] + b"\x02\x00" + peer.GREETING[12:]
GREETING_CURVE = peer.GREETING[:12] + b"CURVE".ljust(20, b"\x00") + peer.GREETING[32:]
# READY whose property is cut inside its value's size, and one whose value size runs past it.
READY_TRUNCATED = peer.command(b"READY", b"\x0bSocket-Type\x00\x00")
READY_VALUE_PAST_END = peer.command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x10PUB")
READY_NAME_PAST_END = peer.command(b"READY", b"\x20Socket")
COMMAND_NAME_PAST_END = peer.frame(b"\x09READY", peer.COMMAND)
PING_WITHOUT_TTL = peer.command(b"PING", b"\x00")

LIES = {
    "no ZMTP signature": (lying_once(GREETING_NO_SIGNATURE), "not a ZMQ peer"),
    "a ZMTP 2 greeting": (lying_once(GREETING_ZMTP_2), "ZMTP 2.x peer"),
    "the CURVE mechanism": (lying_once(GREETING_CURVE), "security mechanism CURVE"),
    "READY cut short": (lying_once(peer.GREETING + READY_TRUNCATED), "malformed READY"),
    "READY value past its end": (
        lying_once(peer.GREETING + READY_VALUE_PAST_END),
        "malformed READY",
    ),
    "READY name past its end": (
        lying_once(peer.GREETING + READY_NAME_PAST_END),
        "malformed READY",
    ),
    "command name past its frame": (
        lying_once(peer.GREETING + COMMAND_NAME_PAST_END),
        "malformed command",
    ),
    "PING without a TTL": (after_handshake(PING_WITHOUT_TTL), "malformed PING"),
}


@pytest.mark.parametrize("lie", list(LIES))
async def test_a_protocol_error_is_logged_dropped_and_retried_and_the_stream_goes_on(
    lie: str, caplog: pytest.LogCaptureFixture
) -> None:
    script, says = LIES[lie]
    downs = Downs()
    async with peer.Peer(script, publishing) as p:
        stream = zmtp.subscribe(p.endpoint, options=FAST, on_down=downs)
        with caplog.at_level(logging.WARNING, "switchyard.net.zmtp"):
            async with asyncio.timeout(10):
                assert await anext(stream) == HELLO
        await stream.aclose()
    assert p.connections == 2
    assert len(downs) == 1 and isinstance(downs[0], zmtp.ZmtpError)
    assert says in str(downs[0])
    assert says in caplog.text and "reconnecting" in caplog.text


async def test_a_frame_over_the_limit_drops_the_connection_before_it_is_buffered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    peak = [0]

    class Watched(zmtp._Sub):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            peak[0] = max(peak[0], len(self._buf))

    monkeypatch.setattr(zmtp, "_Sub", Watched)
    sent = [0]

    async def huge(p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        await p.handshake(reader, writer)
        writer.write(bytes([peer.LONG]) + (1 << 40).to_bytes(8, "big"))
        chunk = bytes(1 << 16)
        while sent[0] < 64 << 20:  # the 2^40 bytes, for as long as we are read
            writer.write(chunk)
            await writer.drain()
            sent[0] += len(chunk)

    downs = Downs()
    async with peer.Peer(huge, publishing) as p:
        stream = zmtp.subscribe(p.endpoint, options=FAST, on_down=downs)
        with caplog.at_level(logging.WARNING, "switchyard.net.zmtp"):
            async with asyncio.timeout(10):
                assert await anext(stream) == HELLO  # from the next connection
        await stream.aclose()
    assert p.connections == 2
    assert len(downs) == 1 and isinstance(downs[0], zmtp.FrameTooLarge)
    assert f"a frame of {1 << 40} bytes is over the {1 << 20}-byte limit" in caplog.text
    assert peak[0] < 1 << 16  # not one chunk of the body was kept
    assert sent[0] < 64 << 20  # the sender was cut off long before


async def test_a_multipart_message_over_the_limit_is_refused_too() -> None:
    part = bytes(300_000)  # each frame under the 1 MiB limit, the message over it
    downs = Downs()
    async with peer.Peer(after_handshake(peer.message(*[part] * 4)), publishing) as p:
        stream = zmtp.subscribe(p.endpoint, options=FAST, on_down=downs)
        async with asyncio.timeout(10):
            assert await anext(stream) == HELLO
        await stream.aclose()
    assert len(downs) == 1 and isinstance(downs[0], zmtp.FrameTooLarge)


async def test_a_peer_silent_after_the_handshake_is_dead_within_the_bound() -> None:
    loop = asyncio.get_running_loop()
    silent_for: list[float] = []

    async def silent(p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        await p.handshake(reader, writer)
        since = loop.time()
        try:
            await p.drain_silently(reader)
        finally:
            silent_for.append(loop.time() - since)

    downs = Downs()
    async with peer.Peer(silent, publishing) as p:
        stream = zmtp.subscribe(p.endpoint, options=FAST, on_down=downs)
        async with asyncio.timeout(10):
            assert await anext(stream) == HELLO
        await stream.aclose()
    assert len(downs) == 1 and isinstance(downs[0], zmtp.PeerSilent)
    (took,) = silent_for
    assert took >= FAST.heartbeat_timeout_s  # not before the timeout
    assert took < FAST.detection_bound_s + 1.0  # within the bound (a loaded CI's slack)
    # PINGs went out every heartbeat with the timeout as their TTL (in deciseconds).
    assert len(p.pings) >= 3
    assert set(p.pings) == {b"\x04PING\x00\x02"}


async def test_a_handshake_that_does_not_come_is_dead_too() -> None:
    downs = Downs()
    async with peer.Peer(peer.silent_from_the_start, publishing) as p:
        stream = zmtp.subscribe(p.endpoint, options=FAST, on_down=downs)
        async with asyncio.timeout(10):
            assert await anext(stream) == HELLO
        await stream.aclose()
    assert len(downs) == 1 and isinstance(downs[0], zmtp.PeerSilent)
    assert "no handshake within 0.2 s" in str(downs[0])


async def test_a_peer_that_answers_pings_is_kept_while_it_publishes_nothing() -> None:
    downs = Downs()
    async with peer.Peer(publishing) as p:
        stream = zmtp.subscribe(p.endpoint, options=FAST, on_down=downs)
        async with asyncio.timeout(10):
            assert await anext(stream) == HELLO
        # Eight heartbeats: two timeouts with nothing but PONGs coming.
        await eventually_async(lambda: len(p.pings) >= 8)
        await stream.aclose()
    assert p.connections == 1 and downs == []


async def test_a_run_of_liars_and_a_silent_peer_leave_the_subscription_alive() -> None:
    liars = [script for script, _ in LIES.values()]
    downs = Downs()
    async with peer.Peer(
        *liars,
        peer.silent_from_the_start,
        peer.silent_after_handshake,
        after_handshake(bytes([peer.LONG]) + (1 << 40).to_bytes(8, "big")),
        publishing,
    ) as p:
        stream = zmtp.subscribe(p.endpoint, options=FAST, on_down=downs)
        async with asyncio.timeout(20):
            assert await anext(stream) == HELLO
        await stream.aclose()
    assert p.connections == len(LIES) + 4
    # Once per outage, with the first reason: the handshake liars and the silent greeter
    # after the PING liar are part of outages already told; each liar after a handshake
    # ends a connection that was up.
    assert [(type(d), str(d).split(" (")[0]) for d in downs] == [
        (zmtp.ZmtpError, "not a ZMQ peer"),
        (zmtp.ZmtpError, "malformed PING of 1 bytes"),
        (zmtp.PeerSilent, "nothing came for 0.2 s"),
        (zmtp.FrameTooLarge, f"a frame of {1 << 40} bytes is over the {1 << 20}-byte limit"),
    ]


def test_options_that_would_find_a_healthy_peer_dead_are_refused() -> None:
    with pytest.raises(ValueError, match="must exceed"):
        zmtp.ZmtpOptions(heartbeat_s=1.0, heartbeat_timeout_s=1.0)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        zmtp.ZmtpOptions(max_frame_bytes=0)
    assert zmtp.ZmtpOptions().detection_bound_s == 4.0  # 1 s heartbeats, 3 s timeout


# -- liveness against libzmq's own publishers -----------------------------------------------


async def test_libzmq_answers_our_pings_so_an_idle_publisher_is_not_found_dead(
    ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    pings = [0]
    ping = zmtp._ping

    def counted(ttl_s: float) -> bytes:
        pings[0] += 1
        return ping(ttl_s)

    monkeypatch.setattr(zmtp, "_ping", counted)
    pub = ctx.socket(zmq.PUB)  # no heartbeats of its own: only PONGs come while idle
    monitor = pub.get_monitor_socket()
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    downs = Downs()
    stream = zmtp.subscribe(f"tcp://127.0.0.1:{port}", options=FAST, on_down=downs)
    assert await until_received(pub, stream) == [b"fence"]
    start = pings[0]
    await eventually_async(lambda: pings[0] - start >= 8)  # two timeouts of silence
    pub.send_multipart([b"still", b"here"])
    async with asyncio.timeout(5):
        assert await anext(stream) == [b"still", b"here"]
    events = []
    while monitor.poll(0):
        events.append(recv_monitor_message(monitor)["event"])
    assert zmq.EVENT_DISCONNECTED not in events
    assert events.count(zmq.EVENT_ACCEPTED) == 1
    assert downs == []
    await stream.aclose()


async def test_a_publisher_that_closes_is_reported_down_once_and_read_again(
    ctx: zmq.Context,
) -> None:
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    downs = Downs()
    stream = zmtp.subscribe(f"tcp://127.0.0.1:{port}", options=FAST, on_down=downs)
    assert await until_received(pub, stream) == [b"fence"]
    pending = asyncio.ensure_future(anext(stream))  # the stream is read meanwhile
    pub.close(linger=0)
    await eventually_async(lambda: len(downs) == 1)
    assert not isinstance(downs[0], zmtp.ZmtpError)  # closed by the peer: no protocol error
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    async with asyncio.timeout(10):
        while not pending.done():
            pub.send_multipart([b"back"])
            await asyncio.wait([pending], timeout=0.02)
    assert pending.result() == [b"back"]
    assert len(downs) == 1  # the refused attempts in between were the same outage
    await stream.aclose()
