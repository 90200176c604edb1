"""ZMQ SUB client for one engine publisher, with replay over its ROUTER socket.

Runs as an asyncio task on the store's loop (``switchyard.net.zmtp`` reads the publisher's
stream), so index updates and lookups never race. Replay protocol (vLLM): a DEALER sends
``[b"", start_seq]`` (8 bytes, big-endian) to the publisher's ROUTER socket; it answers
``[b"", topic, seq, payload]`` per buffered batch, then ``seq = -1``. Older publishers
leave the topic out, so the sequence and payload are read from the end of the frames.

The stream tells when its connection is lost or found dead (``on_lost``); the feed is
resynced (``on_resynced``) once a frame of the next connection has been handled, through
``on_frame`` so that a gap left by the outage is replayed first.

Every new subscription (the first, and each after an outage) is followed by ``catch_up``
before any of its frames is handled: a publisher's batch that went out before the
subscription took (the engine's only one, say) reached no one live, so only its replay
buffer still has it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from switchyard.kvstore.events import EventDecodeError, decode_seq
from switchyard.kvstore.feed import Feed
from switchyard.net.zmqrecv import ZmqContext
from switchyard.net.zmtp import ZmtpOptions, subscribe

log = logging.getLogger("switchyard.kvstore.subscriber")

Handler = Callable[[Feed, int, bytes], Awaitable[None]]
Taker = Callable[[Feed, int, bytes], bool]
CatchUp = Callable[[Feed], Awaitable[None]]
Lost = Callable[[Feed, BaseException | None], None]
Resynced = Callable[[Feed], None]


async def request_replay(
    ctx: ZmqContext, endpoint: str, start_seq: int, timeout_s: float = 1.0
) -> list[tuple[int, bytes]] | None:
    """Buffered batches from ``start_seq`` on, or ``None`` if the publisher did not answer."""
    sock = zmq.asyncio.Socket(ctx, zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            if not await sock.poll(int(timeout_s * 1000)):
                return None
            frames = await sock.recv_multipart()
            if len(frames) < 3:
                return None
            seq = decode_seq(frames[-2])
            if seq < 0:
                return out
            out.append((seq, frames[-1]))
    finally:
        sock.close(linger=0)


class Subscriber:
    def __init__(
        self,
        ctx: ZmqContext,
        feed: Feed,
        on_frame: Handler,
        catch_up: CatchUp | None = None,
        take: Taker | None = None,
        options: ZmtpOptions | None = None,
        on_lost: Lost | None = None,
        on_resynced: Resynced | None = None,
    ) -> None:
        """``catch_up`` runs each time the subscription is up (connected and subscribed),
        before that connection's frames are handled (what arrives meanwhile waits in the
        stream). ``take`` is offered each live frame
        as it is read, once the first has been handled, unless the feed is stale; what it
        declines goes to ``on_frame``. ``options``: the stream's frame cap and heartbeats."""
        self._ctx = ctx
        self.feed = feed
        self._on_frame = on_frame
        self._catch_up = catch_up
        self._take_frame = take
        self.options = options or ZmtpOptions()
        self._on_lost = on_lost
        self._on_resynced = on_resynced
        self._live = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-sub {self.feed.endpoint}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            (outcome,) = await asyncio.gather(self._task, return_exceptions=True)
            if isinstance(outcome, Exception):  # a feed that never connected still stops
                log.warning("%s: subscriber had failed: %s", self.feed.instance, outcome)
            self._task = None

    async def _run(self) -> None:
        assert self.feed.endpoint is not None
        self._live = False
        stream = subscribe(
            self.feed.endpoint,
            self._take if self._take_frame else None,
            self.options,
            self._lost,
            self._up,
        )
        try:
            async for frames in stream:
                await self._handle(frames)
                self._live = True
        finally:
            await stream.aclose()

    async def _up(self) -> None:
        """A subscription is up: ask the publisher for what it buffered before it took. A
        replay asked before then (while connecting) could miss a batch published in between,
        which no live frame brings either."""
        if self._catch_up is None:
            return
        try:
            await self._catch_up(self.feed)
        except Exception:
            log.exception("%s: catching up failed", self.feed.instance)

    def _lost(self, reason: BaseException | None) -> None:
        if self._on_lost is not None:
            self._on_lost(self.feed, reason)

    def _take(self, frames: list[bytes]) -> bool:
        if not self._live or self.feed.stale or len(frames) < 2:
            return False
        assert self._take_frame is not None
        try:
            return self._take_frame(self.feed, decode_seq(frames[-2]), frames[-1])
        except Exception:
            log.exception("%s: event handling failed", self.feed.instance)
            return True

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        seq_frame, payload = frames[-2], frames[-1]
        try:
            await self._on_frame(self.feed, decode_seq(seq_frame), payload)
        except EventDecodeError as exc:
            log.warning("%s: undecodable frame: %s", self.feed.instance, exc)
        except Exception:
            log.exception("%s: event handling failed", self.feed.instance)
        if self.feed.stale and self._on_resynced is not None:
            self._on_resynced(self.feed)
