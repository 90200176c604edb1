"""Reading a zmq.asyncio socket message by message, a burst at a time.

Each awaited ``recv_multipart`` of zmq.asyncio registers a future and a poll state with
the loop; a message already waiting needs none of that. ``messages`` awaits the first
message of a burst, then takes the rest with non-blocking reads on a shadow of the same
socket. The KV-event subscriber and the sibling bus read this way (their
``_add_recv_event`` was a quarter of the subscriber's and half of the bus receiver's
py-spy samples on the multi-turn replay, 2026-12-03).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

# Messages taken without a wait before the loop gets a turn again.
BURST = 64


async def messages(sock: zmq.asyncio.Socket) -> AsyncIterator[list[bytes]]:
    """Every multipart message of ``sock``, in order, for as long as it is read."""
    shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
    while True:
        yield await sock.recv_multipart()
        for _ in range(BURST - 1):
            try:
                frames = shadow.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            yield frames
