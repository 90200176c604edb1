"""A publisher that goes silent, lies or closes: its feed is marked stale (``expects_events``
False, the gauge at 1) until it has resynced, and the router estimates that worker's cache
meanwhile. Scripted publishers pace the silence; libzmq's own PUB closes and comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError

from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import KVStore
from switchyard.mock.engine.events import BlockStored, KVEventBatch
from switchyard.mock.kvevents import KVEventPublisher, encode_batch
from switchyard.net.zmtp import ZmtpOptions
from switchyard.router.kv import EmbeddedPrefixes
from switchyard.router.server import build_kvstore
from switchyard.router.settings import RouterSettings
from tests import zmtp_peer as peer
from tests.support import eventually_async, free_port

pytestmark = pytest.mark.timeout(60)

E = "http://127.0.0.1:8001"
FAST = ZmtpOptions(max_frame_bytes=1 << 20, heartbeat_s=0.05, heartbeat_timeout_s=0.2)
TOKENS = list(range(100, 148))  # three blocks of 16


def batch(seq: int, block: int) -> bytes:
    """vLLM's frames for one stored block (the ``block``-th of ``TOKENS``), sequence ``seq``."""
    parent = 11 + block - 1 if block else None
    tokens = TOKENS[16 * block : 16 * (block + 1)]
    payload = encode_batch(
        KVEventBatch(time.time(), [BlockStored([11 + block], parent, tokens, 16)])
    )
    return peer.message(b"kv@engine", seq.to_bytes(8, "big"), payload)


@pytest.fixture
async def store() -> AsyncIterator[KVStore]:
    s = KVStore(block_size=16, zmtp=FAST)
    await s.start()
    yield s
    await s.stop()


async def matched(store: KVStore) -> int:
    res = await store.lookup(None, token_ids=TOKENS)
    return max((m.matched_tokens for m in res.matches), default=0)


def gauge(store: KVStore) -> float | None:
    return store.metrics.registry.get_sample_value("switchyard_kvstore_feed_stale", {"instance": E})


def disconnects(store: KVStore, reason: str) -> float:
    value = store.metrics.registry.get_sample_value(
        "switchyard_kvstore_feed_disconnects_total", {"instance": E, "reason": reason}
    )
    return value or 0.0


class Pausable:
    """A publisher that can be stopped and resumed, as ``SIGSTOP`` and ``SIGCONT`` do to an
    engine: while stopped its connections are accepted (the kernel does that) and nothing
    is written, not even a PONG; resumed, it publishes what ``send`` queued."""

    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()

    async def __call__(self, p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        if self.stopped.is_set():
            while await reader.read(65536):
                pass
            return
        await p.handshake(reader, writer)
        pings = asyncio.ensure_future(self._pongs(p, reader, writer))
        try:
            while not pings.done():
                get = asyncio.ensure_future(self.outbox.get())
                await asyncio.wait([get, pings], return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    writer.write(get.result())
                else:
                    get.cancel()
        finally:
            pings.cancel()

    async def _pongs(self, p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        while True:
            flags, body = await p.read_frame(reader)
            if flags & peer.COMMAND and body[1 : 1 + body[0]] == b"PING":
                if not self.stopped.is_set():
                    writer.write(peer.command(b"PONG", body[1 + body[0] + 2 :]))

    def send(self, frames: bytes) -> None:
        self.outbox.put_nowait(frames)


async def test_a_silent_publisher_makes_the_feed_stale_until_it_resyncs(store: KVStore) -> None:
    engine = Pausable()
    async with peer.Peer(engine) as p:
        store.subscribe(E, p.endpoint)
        engine.send(batch(0, 0))
        await eventually_async(lambda: _equals(matched(store), 16))
        assert store.expects_events(E) and gauge(store) == 0

        loop = asyncio.get_running_loop()
        engine.stopped.set()
        since = loop.time()
        await eventually_async(lambda: not store.expects_events(E))
        took = loop.time() - since
        assert gauge(store) == 1 and store.stale(E)
        assert disconnects(store, "silent") == 1
        # Its last PONG came up to one heartbeat before it stopped; found within the bound.
        assert FAST.heartbeat_timeout_s - FAST.heartbeat_s <= took < FAST.detection_bound_s + 1.0
        assert await matched(store) == 16  # what it said stays, its weight is the router's

        engine.stopped.clear()
        await eventually_async(lambda: p.subscriptions == 2)  # reconnected and subscribed
        engine.send(batch(1, 1))  # the next batch of the resumed engine
        await eventually_async(lambda: store.expects_events(E))
        assert gauge(store) == 0 and not store.stale(E)
        assert await matched(store) == 32


async def _equals(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def test_the_router_estimates_a_stale_workers_cache_even_with_kv_events_configured(
    store: KVStore,
) -> None:
    engine = Pausable()
    worker = cast(Any, SimpleNamespace(id=E, spec=SimpleNamespace(kv_events="tcp://x:1")))
    prefixes = EmbeddedPrefixes(store)
    async with peer.Peer(engine) as p:
        store.subscribe(E, p.endpoint)
        engine.send(batch(0, 0))
        await eventually_async(lambda: _equals(matched(store), 16))
        assert prefixes.has_events(worker)
        engine.stopped.set()
        await eventually_async(lambda: not prefixes.has_events(worker))
        engine.stopped.clear()
        engine.send(batch(1, 1))
        await eventually_async(lambda: prefixes.has_events(worker))


async def test_a_frame_over_the_limit_is_counted_and_the_feed_goes_on(store: KVStore) -> None:
    async def huge(p: peer.Peer, reader: peer.Reader, writer: peer.Writer) -> None:
        await p.handshake(reader, writer)
        writer.write(bytes([peer.LONG]) + (1 << 40).to_bytes(8, "big"))
        await p.drain_silently(reader)

    engine = Pausable()
    async with peer.Peer(huge, engine) as p:
        store.subscribe(E, p.endpoint)
        await eventually_async(lambda: disconnects(store, "frame_too_large") == 1)
        engine.send(batch(0, 0))
        await eventually_async(lambda: _equals(matched(store), 16))
        assert store.expects_events(E) and gauge(store) == 0
        assert p.connections == 2


async def test_a_libzmq_publisher_that_closes_and_comes_back_is_resynced(store: KVStore) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(endpoint)
    try:
        store.subscribe(E, endpoint)

        async def first_block() -> bool:
            pub.publish(KVEventBatch(time.time(), [BlockStored([11], None, TOKENS[:16], 16)]))
            await asyncio.sleep(0.02)  # the slow joiner's subscription is on its way
            return await matched(store) == 16

        await eventually_async(first_block)
        assert store.expects_events(E)
        pub.close()
        await eventually_async(lambda: store.stale(E))
        assert gauge(store) == 1 and disconnects(store, "lost") == 1
        assert not store.expects_events(E)

        pub = KVEventPublisher(endpoint)  # restarted: its sequence starts over

        async def resynced() -> bool:
            pub.publish(KVEventBatch(time.time(), [BlockStored([11], None, TOKENS[:16], 16)]))
            await asyncio.sleep(0.02)
            return not store.stale(E)

        await eventually_async(resynced)
        assert store.expects_events(E) and gauge(store) == 0
    finally:
        pub.close()


async def test_a_subscription_dropped_while_stale_leaves_no_stale_gauge(store: KVStore) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    store.subscribe(E, endpoint)
    await eventually_async(lambda: store.stale(E))
    assert gauge(store) == 1 and disconnects(store, "lost") == 1
    await store.unsubscribe(endpoint)
    assert gauge(store) == 0 and not store.stale(E)


def test_the_routers_kv_settings_reach_its_embedded_store(tmp_path: Path) -> None:
    config = tmp_path / "switchyard.yaml"
    config.write_text(
        "router:\n  kv:\n    events_max_frame_bytes: 1024\n"
        "    events_heartbeat_s: 0.5\n    events_heartbeat_timeout_s: 2\n"
    )
    settings = RouterSettings.load(config, workers=["http://127.0.0.1:9"])
    store = build_kvstore(settings, config, wanted=True)
    assert isinstance(store, KVStore)
    assert store.zmtp == ZmtpOptions(max_frame_bytes=1024, heartbeat_s=0.5, heartbeat_timeout_s=2)


def test_a_heartbeat_timeout_within_one_interval_is_refused_by_the_settings() -> None:
    with pytest.raises(ValidationError, match="must exceed"):
        KVStoreSettings.load(None, events_heartbeat_s=2.0, events_heartbeat_timeout_s=2.0)
    with pytest.raises(ValidationError, match="must exceed"):
        RouterSettings.load(None, workers=["http://127.0.0.1:9"], kv={"events_heartbeat_s": 3})
    assert KVStoreSettings.load(None).zmtp() == ZmtpOptions()
