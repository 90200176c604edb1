"""Reading a ZMQ socket from the event loop: message by message, a burst at a time.

The socket is a plain ``zmq.Socket``: the loop watches its ``FD`` (``add_reader``) only
while nothing is left to read, and each wake-up takes every message waiting, up to
``BURST``, with non-blocking reads. zmq.asyncio did the same through a future and a poll
state per awaited receive plus its own readiness bookkeeping on every wake-up, a visible
share of a router's CPU where about one KV-event message comes per wake-up
(``docs/decisions/0003-zmtp-subscriber.md``).

ZMQ's ``FD`` signals edges: once it fired, the socket must be read until ``zmq.Again``
before waiting on it again. That is the only order this reader uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import zmq

# The one context type the KV-event readers share (sockets of bytes frames).
ZmqContext = zmq.Context[zmq.Socket[bytes]]
# Messages taken without a wait before the loop gets a turn again.
BURST = 64


async def messages(sock: zmq.Socket[bytes]) -> AsyncIterator[list[bytes]]:
    """Every multipart message of ``sock``, in order, for as long as it is read."""
    loop = asyncio.get_running_loop()
    fd: int = sock.FD
    while True:
        for _ in range(BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            yield frames
        else:
            await asyncio.sleep(0)  # a full burst: others take a turn, then read on
            continue
        readable = loop.create_future()
        loop.add_reader(fd, _wake, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)


def _wake(readable: asyncio.Future[None]) -> None:
    if not readable.done():
        readable.set_result(None)
