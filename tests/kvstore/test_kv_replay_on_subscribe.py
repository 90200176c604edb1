"""Every new subscription asks the publisher's replay socket for what it buffered, once the
subscription is in place: a batch that went out before the subscription took reached no
one live, and with no batch after it no gap would ever show it.

The engine here is scripted in the test's loop: its PUB side speaks ZMTP byte by byte
(``tests.zmtp_peer``), so the test decides when it accepts a subscriber, and its replay
side is a ZMQ ROUTER answering as vLLM's does (each buffered batch, then -1).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from switchyard.kvstore.store import KVStore
from switchyard.mock.engine.events import BlockStored, KVEventBatch
from switchyard.mock.kvevents import END_SEQ, encode_batch
from switchyard.net.zmtp import ZmtpOptions
from tests import zmtp_peer as peer
from tests.support import eventually_async

pytestmark = pytest.mark.timeout(60)

E = "http://127.0.0.1:8001"
TOPIC = b"kv@engine"
TOKENS = list(range(100, 148))  # three blocks of 16
FAST = ZmtpOptions(max_frame_bytes=1 << 20, heartbeat_s=0.05, heartbeat_timeout_s=0.5)


def elsewhere() -> bytes:
    """A batch storing a block of other tokens."""
    stored = BlockStored([21], None, list(range(500, 516)), 16)
    return encode_batch(KVEventBatch(time.time(), [stored]))


def block(n: int) -> bytes:
    """A batch storing the ``n``-th block of ``TOKENS`` (a child of the one before)."""
    parent = 11 + n - 1 if n else None
    stored = BlockStored([11 + n], parent, TOKENS[16 * n : 16 * (n + 1)], 16)
    return encode_batch(KVEventBatch(time.time(), [stored]))


class Engine:
    """One vLLM publisher: a PUB socket that accepts subscribers only while ``up`` (before,
    it closes each connection at once) and a replay ROUTER over everything it published.
    ``asked`` holds each replay request: its start sequence and how many subscriptions
    its PUB side had taken by then."""

    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.up.set()
        self.batches: list[tuple[int, bytes]] = []
        self.asked: list[tuple[int, int]] = []
        self.peer = peer.Peer(self._pub)
        self._live: peer.Writer | None = None
        self._ctx = zmq.asyncio.Context()
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        port = self._replay.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self._serving: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Engine:
        await self.peer.__aenter__()
        self._serving = asyncio.create_task(self._serve_replay())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._serving is not None
        self._serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._serving
        await self.peer.__aexit__(*exc)
        self._replay.close(linger=0)
        self._ctx.term()

    @property
    def endpoint(self) -> str:
        return self.peer.endpoint

    def publish(self, payload: bytes) -> int:
        """Buffer the batch, and send it to the subscriber if one is connected."""
        seq = len(self.batches)
        self.batches.append((seq, payload))
        if self._live is not None:
            self._live.write(peer.message(TOPIC, seq.to_bytes(8, "big"), payload))
        return seq

    def restart(self) -> None:
        """A new engine process on the same ports: nothing buffered, numbered from 0."""
        self.batches = []

    def cut(self) -> None:
        """The network between engine and router goes: the connection drops, new ones are
        refused until ``up`` is set again."""
        self.up.clear()
        if self._live is not None:
            self._live.transport.abort()
            self._live = None

    async def _pub(self, p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        if not self.up.is_set():
            return  # closed at once: no publisher there yet
        await p.handshake(reader, writer)
        self._live = writer
        try:
            await p.answer_pings(reader, writer)
        finally:
            if self._live is writer:
                self._live = None

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            self.asked.append((first, self.peer.subscriptions))
            for seq, payload in self.batches:
                if seq >= first:
                    await self._replay.send_multipart(
                        [client, b"", TOPIC, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])


@pytest.fixture
async def store() -> AsyncIterator[KVStore]:
    s = KVStore(block_size=16, zmtp=FAST)
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    async with Engine() as e:
        yield e


async def matched(store: KVStore) -> int:
    res = await store.lookup(None, token_ids=TOKENS)
    return max((m.matched_tokens for m in res.matches), default=0)


async def indexed(store: KVStore, tokens: int) -> None:
    async def reached() -> bool:
        return await matched(store) == tokens

    await eventually_async(reached)


def lost(store: KVStore) -> float:
    """How many times the feed found its publisher gone, whatever the reason."""
    return sum(
        sample.value
        for metric in store.metrics.registry.collect()
        if metric.name == "switchyard_kvstore_feed_disconnects"
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["instance"] == E
    )


async def test_the_only_batch_published_just_before_the_subscription_is_indexed(
    store: KVStore, engine: Engine
) -> None:
    engine.up.clear()  # the router starts with its engine: its first try finds no publisher
    store.subscribe(E, engine.endpoint, replay_endpoint=engine.replay_endpoint)
    await eventually_async(lambda: lost(store) >= 1 and not store.catching_up(E))
    engine.publish(block(0))  # the engine's only batch: no subscriber yet, so only buffered
    engine.up.set()
    await indexed(store, 16)
    assert engine.peer.subscriptions == 1
    assert all(subscriptions >= 1 for _, subscriptions in engine.asked)  # asked once subscribed
    assert not store.stale(E)  # the replay resynced the feed: no live frame was needed


async def test_a_first_subscription_takes_the_buffer_then_follows_live(
    store: KVStore, engine: Engine
) -> None:
    engine.publish(block(0))
    store.subscribe(E, engine.endpoint, replay_endpoint=engine.replay_endpoint)
    await indexed(store, 16)
    assert engine.asked == [(0, 1)]
    engine.publish(block(1))
    await indexed(store, 32)


async def test_a_batch_published_while_the_subscription_was_down_is_replayed_after_it(
    store: KVStore, engine: Engine
) -> None:
    store.subscribe(E, engine.endpoint, replay_endpoint=engine.replay_endpoint)
    await eventually_async(lambda: engine.peer.subscriptions == 1)
    engine.publish(block(0))
    await indexed(store, 16)
    engine.cut()
    await eventually_async(lambda: store.stale(E))
    engine.publish(block(1))  # while no subscription is in place: only buffered
    engine.up.set()
    await indexed(store, 32)
    assert engine.peer.subscriptions == 2
    # The resubscription asked from the last batch it had applied, which the same
    # publisher still echoes: nothing was cleared.
    assert engine.asked[-1] == (0, 2)
    reg = store.metrics.registry
    assert reg.get_sample_value("switchyard_kvstore_instance_clears_total", {
        "instance": E, "reason": "restart"}) is None  # fmt: skip
    assert not store.stale(E)
    engine.publish(block(2))  # and live frames go on from there
    await indexed(store, 48)


@pytest.mark.parametrize("published", [1, 2])
async def test_an_engine_restarted_while_unsubscribed_is_forgotten_then_replayed(
    store: KVStore, engine: Engine, published: int
) -> None:
    """``published`` batches since the restart: one leaves nothing at the number last
    applied, two put a different batch there."""
    store.subscribe(E, engine.endpoint, replay_endpoint=engine.replay_endpoint)
    await eventually_async(lambda: engine.peer.subscriptions == 1)
    engine.publish(block(0))
    engine.publish(block(1))
    await indexed(store, 32)
    engine.cut()
    await eventually_async(lambda: store.stale(E))
    engine.restart()  # its cache is empty and its sequence starts over
    engine.publish(block(0))
    if published == 2:
        engine.publish(elsewhere())
    engine.up.set()
    await indexed(store, 16)  # block 1 went with the old process
    reg = store.metrics.registry
    clears = {"instance": E, "reason": "restart"}
    assert reg.get_sample_value("switchyard_kvstore_instance_clears_total", clears) == 1
    assert [start for start, _ in engine.asked] == [0, 1, 0]
    assert not store.stale(E)
