"""A scripted ZMQ publisher on a raw asyncio socket: it speaks ZMTP byte by byte, so a test
can make it lie (a bad greeting or READY, a frame of 2^40 bytes) or fall silent without
closing, as a stopped process or a cut network does, and then behave again."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)
MORE, LONG, COMMAND = 0x01, 0x02, 0x04


def frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def command(name: bytes, data: bytes = b"") -> bytes:
    return frame(bytes([len(name)]) + name + data, COMMAND)


def ready(socket_type: bytes = b"PUB") -> bytes:
    prop = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return command(b"READY", prop)


def message(*parts: bytes) -> bytes:
    return b"".join(frame(p, MORE if i < len(parts) - 1 else 0) for i, p in enumerate(parts))


Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Script = Callable[["Peer", Reader, Writer], Awaitable[None]]


class Peer:
    """A TCP server on loopback; connection ``n`` (from 0) plays ``scripts[n]``, the last
    script once they run out. Counts connections and records each PING it is sent."""

    def __init__(self, *scripts: Script) -> None:
        self.scripts = scripts
        self.connections = 0
        self.closed = 0  # connections that ended
        self.pings: list[bytes] = []
        self.subscriptions = 0  # handshakes that ended in the subscription
        self.server: asyncio.Server | None = None
        self._writers: set[Writer] = set()

    async def __aenter__(self) -> Peer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self._writers:  # a silent script's reader then sees the end
            writer.transport.abort()
        await asyncio.sleep(0)

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: Reader, writer: Writer) -> None:
        n = self.connections
        self.connections += 1
        script = self.scripts[min(n, len(self.scripts) - 1)]
        self._writers.add(writer)
        try:
            await script(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed += 1
            self._writers.discard(writer)
            writer.close()

    async def read_frame(self, reader: Reader) -> tuple[int, bytes]:
        """The next frame the subscriber sent; PINGs are recorded on the way."""
        flags = (await reader.readexactly(1))[0]
        if flags & LONG:
            (size,) = struct.unpack(">Q", await reader.readexactly(8))
        else:
            size = (await reader.readexactly(1))[0]
        body = await reader.readexactly(size)
        if flags & COMMAND and body[1 : 1 + body[0]] == b"PING":
            self.pings.append(body)
        return flags, body

    async def handshake(self, reader: Reader, writer: Writer) -> None:
        """Greeting and READY each way, then the subscriber's subscription."""
        writer.write(GREETING + ready())
        await reader.readexactly(64)
        flags, body = await self.read_frame(reader)
        assert flags & COMMAND and body.startswith(b"\x05READY"), body
        flags, body = await self.read_frame(reader)
        assert body == b"\x01", body  # subscribe to everything
        self.subscriptions += 1

    async def answer_pings(self, reader: Reader, writer: Writer) -> None:
        """A healthy idle publisher: each PING gets its PONG, until the subscriber goes."""
        while True:
            flags, body = await self.read_frame(reader)
            if flags & COMMAND and body[1 : 1 + body[0]] == b"PING":
                writer.write(command(b"PONG", body[1 + body[0] + 2 :]))

    async def drain_silently(self, reader: Reader) -> None:
        """Read (and record PINGs) but never write, until the subscriber goes."""
        while True:
            await self.read_frame(reader)


async def publishes(peer: Peer, reader: Reader, writer: Writer, *messages: bytes) -> None:
    """Handshake, send ``messages``, then answer PINGs."""
    await peer.handshake(reader, writer)
    writer.write(b"".join(messages))
    await peer.answer_pings(reader, writer)


async def silent_after_handshake(peer: Peer, reader: Reader, writer: Writer) -> None:
    await peer.handshake(reader, writer)
    await peer.drain_silently(reader)


async def silent_from_the_start(peer: Peer, reader: Reader, writer: Writer) -> None:
    """Accepted by the kernel, never greeted: a stopped process's listening socket."""
    while await reader.read(65536):
        pass
