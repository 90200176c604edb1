"""Subscribing to a ZMQ publisher from the event loop itself: ZMTP 3.0, NULL mechanism.

A KV-event subscriber only ever connects to one PUB socket, subscribes to everything and
reads. Through libzmq each message crossed its I/O thread, a mailbox signal and a wake-up
of the loop on the socket's ``FD``, several times the CPU of the same bytes read by an
asyncio protocol, and several frames come per request (the figures and their command are
in ``docs/decisions/0003-zmtp-subscriber.md``).

The wire (rfc.zeromq.org spec 23, ZMTP 3.0): a 64-byte greeting each way (signature,
version 3.0, mechanism ``NULL``), a ``READY`` command each way naming the socket types,
then frames of one flags byte (``MORE``, ``LONG``, ``COMMAND``) and a 1- or 8-byte size.
A 3.0 subscriber subscribes with a message whose first byte is 1 (libzmq's publishers
accept it from peers of every 3.x version), once the publisher's ``READY`` came. ``PING``
commands (a publisher with heartbeats on) get a ``PONG``. A lost or refused connection
is retried, as libzmq does, every ``RECONNECT_S`` growing to ``RECONNECT_MAX_S``; what was
published meanwhile is lost, as with libzmq (the event sequence numbers show the gap).

The listener side (``--kv-listen``: engines connect to us) stays on libzmq
(``switchyard.net.zmqrecv``): it binds and accepts many peers, which this does not.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import cast
from urllib.parse import urlsplit

log = logging.getLogger("switchyard.net.zmtp")

RECONNECT_S = 0.1
RECONNECT_MAX_S = 2.0
# Messages a slow reader may leave waiting before the socket stops being read (the
# publisher then drops at its high-water mark, as it would for a slow libzmq subscriber).
MAX_QUEUED = 10_000

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
_SIZE64 = struct.Struct(">Q")
_PUBLISHERS = (b"PUB", b"XPUB")


class ZmtpError(ConnectionError):
    """The peer is no ZMQ publisher we can read (another protocol, mechanism or socket type)."""


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


def _properties(data: bytes) -> dict[bytes, bytes]:
    """The metadata of a ``READY`` command: name (1-byte size), value (4-byte size) pairs."""
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        n = data[pos]
        name = data[pos + 1 : pos + 1 + n]
        pos += 1 + n
        (size,) = struct.unpack_from(">I", data, pos)
        out[name.lower()] = data[pos + 4 : pos + 4 + size]
        pos += 4 + size
    return out


Take = Callable[[list[bytes]], bool]


class _Sub(asyncio.Protocol):
    """One connection: greeting, handshake, then whole messages to ``take`` or ``queue``."""

    def __init__(self, endpoint: str, take: Take | None = None) -> None:
        self.endpoint = endpoint
        self.take = take
        self.queue: deque[list[bytes]] = deque()
        self.transport: asyncio.Transport | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._buf = bytearray()
        self._greeted = False
        self._parts: list[bytes] = []
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are no subclasses
        self.transport.write(HELLO)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(exc or ConnectionError(f"{self.endpoint}: connection closed"))
        self._wake()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        try:
            pos = self._parse(buf)
        except ZmtpError as exc:
            if not self.ready.done():
                self.ready.set_exception(exc)
            else:
                log.warning("%s: %s", self.endpoint, exc)
            assert self.transport is not None
            self.transport.abort()
            return
        del buf[:pos]
        if self.queue:
            self._wake()
            if len(self.queue) >= MAX_QUEUED and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()

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
        while pos + 2 <= end:
            flags = buf[pos]
            if flags & _LONG:
                if pos + 9 > end:
                    break
                (size,) = _SIZE64.unpack_from(buf, pos + 1)
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
                if not flags & _MORE:
                    # Taken at once only behind an empty queue, so messages keep their order.
                    if self.queue or self.take is None or not self.take(self._parts):
                        self.queue.append(self._parts)
                    self._parts = []
        return pos

    def _on_command(self, body: bytes) -> None:
        n = body[0] if body else 0
        name, data = body[1 : 1 + n], body[1 + n :]
        if name == b"READY":
            kind = _properties(data).get(b"socket-type", b"")
            if kind not in _PUBLISHERS:
                raise ZmtpError(f"the peer is a {kind.decode(errors='replace')} socket, not PUB")
            if not self.ready.done():
                assert self.transport is not None
                self.transport.write(SUBSCRIBE_ALL)
                self.ready.set_result(None)
        elif name == b"ERROR":
            reason = data[1 : 1 + data[0]] if data else b""
            raise ZmtpError(f"the peer refused us: {reason.decode(errors='replace')}")
        elif name == b"PING" and self.transport is not None:
            self.transport.write(_command(b"PONG", data[2:]))  # TTL, then the context

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until a message is queued or the connection is gone."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


async def _connect(endpoint: str, take: Take | None) -> _Sub:
    loop = asyncio.get_running_loop()
    if endpoint.startswith("ipc://"):
        path = endpoint[6:]
        if path.startswith("@"):  # libzmq's spelling of Linux's abstract namespace
            path = "\0" + path[1:]
        _, proto = await loop.create_unix_connection(lambda: _Sub(endpoint, take), path)
    else:
        parts = urlsplit(endpoint)
        if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
            raise ValueError(f"{endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
        _, proto = await loop.create_connection(
            lambda: _Sub(endpoint, take), parts.hostname, parts.port
        )
    try:
        await proto.ready
    except BaseException:
        proto.close()
        raise
    return proto


async def subscribe(endpoint: str, take: Take | None = None) -> AsyncGenerator[list[bytes], None]:
    """Every multipart message the publisher at ``endpoint`` sends while this is read, in
    order, across reconnections. A peer that is not a ZMQ publisher is retried too (it
    may be one tomorrow), with a warning each time it answers wrongly.

    ``take``, when given, is offered each message as it is read, on the protocol's
    callback, while none waits to be yielded; what it takes (returns True for) is not
    yielded. It must not raise. A message handled there costs no task switch and no
    future."""
    delay = RECONNECT_S
    while True:
        try:
            sub = await _connect(endpoint, take)
        except ZmtpError as exc:
            log.warning("%s: %s", endpoint, exc)
        except OSError:
            pass  # not up yet, or gone: as libzmq, keep trying
        else:
            delay = RECONNECT_S
            try:
                while True:
                    queue = sub.queue
                    while queue:
                        yield queue.popleft()
                    if sub.closed:
                        break
                    await sub.wait()
            finally:
                sub.close()
        await asyncio.sleep(delay)
        delay = min(delay * 2, RECONNECT_MAX_S)
