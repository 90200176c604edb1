"""Subscribing to a ZMQ publisher from the event loop itself: ZMTP 3.1, NULL mechanism.

A KV-event subscriber only ever connects to one PUB socket, subscribes to everything and
reads. Through libzmq each message crossed its I/O thread, a mailbox signal and a wake-up
of the loop on the socket's ``FD``, several times the CPU of the same bytes read by an
asyncio protocol, and several frames come per request (the figures and their command are
in ``docs/decisions/0003-zmtp-subscriber.md``).

The wire (rfc.zeromq.org spec 37, ZMTP 3.1): a 64-byte greeting each way (signature,
version 3.1, mechanism ``NULL``), a ``READY`` command each way naming the socket types,
then frames of one flags byte (``MORE``, ``LONG``, ``COMMAND``) and a 1- or 8-byte size.
The subscription is 3.0's message whose first byte is 1, not 3.1's ``SUBSCRIBE``
command: libzmq's publishers take the message from peers of every 3.x version, and a
publisher that speaks only 3.0 knows no such command. It is sent once the publisher's
``READY`` came.

Liveness (``ZmtpOptions``): every ``heartbeat_s`` a ``PING`` goes out with a TTL of
``heartbeat_timeout_s`` (libzmq answers with a ``PONG`` and drops us if we fall silent
that long), and a connection that brought nothing at all, no frame and no ``PONG``, for
``heartbeat_timeout_s`` is dead: a publisher stopped (``SIGSTOP``) or cut off by the
network never closes its side. Silence is checked at each heartbeat, so a dead peer is
found within ``heartbeat_timeout_s + heartbeat_s`` of its last byte (4 s with the
defaults, 1 s and 3 s). A connection and handshake that take longer than
``heartbeat_timeout_s`` are dead too, and TCP keepalive is set as a second line. A peer
that is not a ZMQ publisher, breaks the protocol (a bad greeting, ``READY`` or command),
or announces a frame over ``max_frame_bytes`` (it is refused from its size, before any of
it is buffered) is a ``ZmtpError``: logged on one line, the connection dropped.

Every lost, dead or refused connection is retried, as libzmq does, every ``RECONNECT_S``
growing to ``RECONNECT_MAX_S``; what was published meanwhile is lost, as with libzmq (the
event sequence numbers show the gap). ``on_down`` tells the reader each time its stream
stops, with the reason, so it can treat what it built from the stream as stale.

The listener side (``--kv-listen``: engines connect to us) stays on libzmq
(``switchyard.net.zmqrecv``): it binds and accepts many peers, which this does not.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

log = logging.getLogger("switchyard.net.zmtp")

RECONNECT_S = 0.1
RECONNECT_MAX_S = 2.0
# Messages a slow reader may leave waiting before the socket stops being read (the
# publisher then drops at its high-water mark, as it would for a slow libzmq subscriber).
MAX_QUEUED = 10_000
# Far above the largest KV-event batch (a few MB for a long prompt's blocks).
MAX_FRAME_BYTES = 64 << 20
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
GREETING = _SIGNATURE + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
_SIZE64 = struct.Struct(">Q")
_TTL = struct.Struct(">H")
_PUBLISHERS = (b"PUB", b"XPUB")


@dataclass(frozen=True, slots=True)
class ZmtpOptions:
    """The limits of one subscription: the largest frame (or multipart message) read, and
    how often the publisher is pinged and how long its silence may last."""

    max_frame_bytes: int = MAX_FRAME_BYTES
    heartbeat_s: float = HEARTBEAT_S
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be positive, not {self.max_frame_bytes}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, not {self.heartbeat_s}")
        # A timeout within one interval would find a healthy idle peer dead between PINGs.
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                f"heartbeat_s ({self.heartbeat_s})"
            )

    @property
    def detection_bound_s(self) -> float:
        """Longest silence of a dead peer before it is found: checks run at heartbeats."""
        return self.heartbeat_timeout_s + self.heartbeat_s


class ZmtpError(ConnectionError):
    """The peer broke the protocol or our limits; the connection is dropped and retried.

    ``ZmtpError``: not a ZMQ publisher we can read (another protocol, mechanism or socket
    type), or a malformed greeting, ``READY`` or command.
    ``FrameTooLarge``: a frame (or multipart message) over ``max_frame_bytes``.
    ``PeerSilent``: no traffic for ``heartbeat_timeout_s``, or no handshake within it.
    """


class FrameTooLarge(ZmtpError):
    """A frame announced over the limit: refused from its size, never buffered."""


class PeerSilent(ZmtpError):
    """Nothing came for the heartbeat timeout: the peer is stopped or cut off."""


def _frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + _SIZE64.pack(len(body)) + body
    return bytes([flags, len(body)]) + body


def _command(name: bytes, data: bytes = b"") -> bytes:
    return _frame(bytes([len(name)]) + name + data, _COMMAND)


def _ready(socket_type: bytes) -> bytes:
    prop = b"Socket-Type"
    return _command(
        b"READY", bytes([len(prop)]) + prop + struct.pack(">I", len(socket_type)) + socket_type
    )


HELLO = GREETING + _ready(b"SUB")
# Sent once the peer's READY came: libzmq takes any frame before that for a second
# handshake command and drops the connection (PROTOCOL_ERROR_ZMTP_UNEXPECTED_COMMAND).
SUBSCRIBE_ALL = _frame(b"\x01")


def _ping(ttl_s: float) -> bytes:
    """A PING with no context; the TTL is in deciseconds, at most 16 bits of them."""
    return _command(b"PING", _TTL.pack(min(0xFFFF, max(1, round(ttl_s * 10)))))


def _properties(data: bytes) -> dict[bytes, bytes]:
    """The metadata of a ``READY`` command: name (1-byte size), value (4-byte size) pairs."""
    out: dict[bytes, bytes] = {}
    pos = 0
    end = len(data)
    while pos < end:
        n = data[pos]
        if n == 0 or pos + 1 + n + 4 > end:
            raise ZmtpError("malformed READY: a property name runs past the command")
        name = data[pos + 1 : pos + 1 + n]
        pos += 1 + n
        (size,) = struct.unpack_from(">I", data, pos)
        pos += 4
        if pos + size > end:
            raise ZmtpError(f"malformed READY: property {name!r} runs past the command")
        out[name.lower()] = data[pos : pos + size]
        pos += size
    return out


Take = Callable[[list[bytes]], bool]
OnDown = Callable[[BaseException | None], None]
OnUp = Callable[[], Awaitable[None]]


class _Sub(asyncio.Protocol):
    """One connection: greeting, handshake, then whole messages to ``take`` or ``queue``."""

    def __init__(self, endpoint: str, take: Take | None, options: ZmtpOptions) -> None:
        self.endpoint = endpoint
        self.take = take
        self.options = options
        self.queue: deque[list[bytes]] = deque()
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self.ready = self._loop.create_future()
        self.closed = False
        # Why the connection ended, when we ended it (protocol error, limit, silence).
        self.error: ZmtpError | None = None
        self.lost: Exception | None = None  # what the transport reported, if anything
        self._waiter: asyncio.Future[None] | None = None
        self._buf = bytearray()
        self._greeted = False
        self._parts: list[bytes] = []
        self._part_bytes = 0
        self._paused = False
        self._last_rx = self._loop.time()
        self._beat_due = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are no subclasses
        _keepalive(self.transport.get_extra_info("socket"), self.options)
        self.transport.write(HELLO)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = exc
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.ready.done():
            self.ready.set_exception(
                self.error or exc or ConnectionError(f"{self.endpoint}: connection closed")
            )
        self._wake()

    def data_received(self, data: bytes) -> None:
        self._last_rx = self._loop.time()
        buf = self._buf
        buf += data
        try:
            pos = self._parse(buf)
        except ZmtpError as exc:
            self._fail(exc)
            return
        del buf[:pos]
        if self.queue:
            self._wake()
            if len(self.queue) >= MAX_QUEUED and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()

    def _fail(self, exc: ZmtpError) -> None:
        """Drop the connection for ``exc``; before the handshake ends ``_connect`` logs it."""
        if self.closed:
            return
        self.error = exc
        if not self.ready.done():
            self.ready.set_exception(exc)
        else:
            log.warning("%s: %s; reconnecting", self.endpoint, exc)
        self._buf.clear()
        assert self.transport is not None
        self.transport.abort()

    def _parse(self, buf: bytearray) -> int:
        """Consume whole frames from ``buf``; returns how many bytes were."""
        pos = 0
        end = len(buf)
        if not self._greeted:
            if end < 64:
                if end >= 1 and buf[0] != 0xFF:
                    raise ZmtpError("not a ZMQ peer (no ZMTP signature)")
                return 0
            if buf[0] != 0xFF or buf[9] != 0x7F:
                raise ZmtpError("not a ZMQ peer (no ZMTP signature)")
            if buf[10] < 3:
                raise ZmtpError(f"ZMTP {buf[10]}.x peer: only 3.x is read")
            mechanism = bytes(buf[12:32]).rstrip(b"\x00")
            if mechanism != b"NULL":
                raise ZmtpError(
                    f"security mechanism {mechanism.decode(errors='replace')}: only NULL is read"
                )
            self._greeted = True
            pos = 64
        limit = self.options.max_frame_bytes
        while pos + 2 <= end:
            flags = buf[pos]
            if flags & _LONG:
                if pos + 9 > end:
                    break
                (size,) = _SIZE64.unpack_from(buf, pos + 1)
                if size > limit:  # refused from its header, before any of it is kept
                    raise FrameTooLarge(f"a frame of {size} bytes is over the {limit}-byte limit")
                start = pos + 9
            else:
                size = buf[pos + 1]
                start = pos + 2
            if start + size > end:
                break
            body = bytes(buf[start : start + size])
            pos = start + size
            if flags & _COMMAND:
                self._on_command(body)
            elif self.ready.done():
                self._parts.append(body)
                # Each frame is under the limit, but a peer may send any number of them.
                self._part_bytes += size
                if self._part_bytes > limit:
                    raise FrameTooLarge(
                        f"a message of {self._part_bytes} bytes or more is over the "
                        f"{limit}-byte limit"
                    )
                if flags & _MORE:
                    continue
                # Taken at once only behind an empty queue, so messages keep their order.
                if self.queue or self.take is None or not self.take(self._parts):
                    self.queue.append(self._parts)
                self._parts = []
                self._part_bytes = 0
        return pos

    def _on_command(self, body: bytes) -> None:
        n = body[0] if body else 0
        if n == 0 or 1 + n > len(body):
            raise ZmtpError("malformed command: its name runs past the frame")
        name, data = body[1 : 1 + n], body[1 + n :]
        if name == b"READY":
            kind = _properties(data).get(b"socket-type", b"")
            if kind not in _PUBLISHERS:
                raise ZmtpError(f"the peer is a {kind.decode(errors='replace')} socket, not PUB")
            if not self.ready.done():
                assert self.transport is not None
                self.transport.write(SUBSCRIBE_ALL)
                self.ready.set_result(None)
                self._start_heartbeat()
        elif name == b"ERROR":
            reason = data[1 : 1 + data[0]] if data else b""
            raise ZmtpError(f"the peer refused us: {reason.decode(errors='replace')}")
        elif name == b"PING":
            if len(data) < 2 or len(data) > 2 + 16:
                raise ZmtpError(f"malformed PING of {len(data)} bytes (a TTL and 0-16 more)")
            if self.transport is not None:
                self.transport.write(_command(b"PONG", data[2:]))  # TTL, then the context
        # PONG and unknown commands: their arrival is all the liveness check needs.

    def _start_heartbeat(self) -> None:
        self._last_rx = self._loop.time()
        self._beat_due = self._last_rx + self.options.heartbeat_s
        self._timer = self._loop.call_at(self._beat_due, self._beat)

    def _beat(self) -> None:
        """Find a silent peer dead, else ping it; runs every ``heartbeat_s``."""
        self._timer = None
        if self.closed or self.transport is None:
            return
        opts = self.options
        now = self._loop.time()
        # Silence we could not have heard is no sign of a dead peer: reading paused for a
        # slow consumer, or the loop itself held past a whole interval.
        if self._paused or now - self._beat_due > opts.heartbeat_s:
            self._last_rx = now
        silent = now - self._last_rx
        if silent >= opts.heartbeat_timeout_s:
            self._fail(
                PeerSilent(f"nothing came for {opts.heartbeat_timeout_s:g} s (no frame, no PONG)")
            )
            return
        self.transport.write(_ping(opts.heartbeat_timeout_s))
        self._beat_due = now + opts.heartbeat_s
        self._timer = self._loop.call_at(self._beat_due, self._beat)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until a message is queued or the connection is gone."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _keepalive(sock: socket.socket | None, options: ZmtpOptions) -> None:
    """TCP keepalive as a second line under the PINGs: the kernel probes an idle peer too."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's timers
            sock.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(options.heartbeat_timeout_s))
            )
            sock.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(options.heartbeat_s))
            )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        pass  # a socket that refuses keepalive still has the PINGs


async def _connect(endpoint: str, take: Take | None, options: ZmtpOptions) -> _Sub:
    loop = asyncio.get_running_loop()
    proto: _Sub | None = None

    def made() -> _Sub:
        nonlocal proto
        proto = _Sub(endpoint, take, options)
        return proto

    try:
        async with asyncio.timeout(options.heartbeat_timeout_s):
            if endpoint.startswith("ipc://"):
                path = endpoint[6:]
                if path.startswith("@"):  # libzmq's spelling of Linux's abstract namespace
                    path = "\0" + path[1:]
                await loop.create_unix_connection(made, path)
            else:
                parts = urlsplit(endpoint)
                if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
                    raise ValueError(f"{endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
                await loop.create_connection(made, parts.hostname, parts.port)
            assert proto is not None
            await proto.ready
    except TimeoutError:
        if proto is not None:
            proto.close()
        raise PeerSilent(f"no handshake within {options.heartbeat_timeout_s:g} s") from None
    except BaseException:
        if proto is not None:
            proto.close()
        raise
    return proto


async def subscribe(
    endpoint: str,
    take: Take | None = None,
    options: ZmtpOptions | None = None,
    on_down: OnDown | None = None,
    on_up: OnUp | None = None,
) -> AsyncGenerator[list[bytes], None]:
    """Every multipart message the publisher at ``endpoint`` sends while this is read, in
    order, across reconnections. A peer that is not a ZMQ publisher is retried too (it
    may be one tomorrow), with a warning each time it answers wrongly.

    ``take``, when given, is offered each message as it is read, on the protocol's
    callback, while none waits to be yielded; what it takes (returns True for) is not
    yielded. It must not raise. A message handled there costs no task switch and no
    future.

    ``on_down(reason)`` is called when a connection that was up ends (the reason: the
    ``ZmtpError`` we dropped it for, an ``OSError``, or ``None`` when the peer closed it)
    and when an attempt fails while none was up since the last call: once per outage,
    and once when the first attempt fails. It must not raise.

    ``on_up()`` is awaited each time a connection is up and its subscription sent, before
    any of its messages is yielded (what arrives meanwhile is read and waits, or goes to
    ``take``): the publisher's replay can then be asked for what was published before the
    subscription took, with nothing of the new connection handled yet. It must not raise."""
    opts = options or ZmtpOptions()
    delay = RECONNECT_S
    told = False  # on_down was called and no connection came up since
    while True:
        reason: BaseException | None
        try:
            sub = await _connect(endpoint, take, opts)
        except ZmtpError as exc:
            log.warning("%s: %s; reconnecting", endpoint, exc)
            reason = exc
        except OSError as exc:
            reason = exc  # not up yet, or gone: as libzmq, keep trying
        else:
            delay = RECONNECT_S
            told = False
            try:
                if on_up is not None:
                    await on_up()
                while True:
                    queue = sub.queue
                    while queue:
                        yield queue.popleft()
                    if sub.closed:
                        break
                    await sub.wait()
            finally:
                sub.close()
            reason = sub.error or sub.lost
        if on_down is not None and not told:
            told = True
            on_down(reason)
        await asyncio.sleep(delay)
        delay = min(delay * 2, RECONNECT_MAX_S)
