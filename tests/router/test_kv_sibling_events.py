"""The processes of one router: one follows the engines' KV events and shares the index
operations they become; the others apply those, and take the events over when it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from switchyard.balancer.siblings import SiblingBus
from switchyard.kvstore.store import KVStore
from switchyard.mock.engine.events import BlockRemoved, KVEventBatch
from switchyard.mock.kvevents import KVEventPublisher
from switchyard.router.kv import TAKE_OVER_S, EmbeddedPrefixes
from tests.kvstore.test_kv_ingest_live import TOKENS, joined, matched, publisher, stored
from tests.router.test_kv_probe import processes
from tests.support import eventually_async, free_port

pytestmark = pytest.mark.timeout(60)

E = "http://127.0.0.1:8001"


def subscribed_pair(endpoint: str | None) -> list[KVStore]:
    assert endpoint is not None
    stores = [KVStore(block_size=16) for _ in range(2)]
    for store in stores:
        store.subscribe(E, endpoint)
    return stores


@asynccontextmanager
async def two_processes(
    tmp_path: Path,
) -> AsyncIterator[tuple[KVEventPublisher, list[KVStore], list[EmbeddedPrefixes]]]:
    """An engine's publisher and two processes of a router subscribed to it; the first
    to start follows the events."""
    pub = publisher()
    stores = subscribed_pair(pub.endpoint)
    try:
        async with processes(tmp_path, stores) as sources:
            yield pub, stores, sources
    finally:
        pub.close()


async def store_three_blocks(pub: KVEventPublisher, heard_by: KVStore, seen_by: KVStore) -> None:
    """Publish three stored blocks once ``heard_by`` receives the events; wait until
    ``seen_by`` indexed them."""
    await joined(heard_by, pub)
    pub.publish(stored(TOKENS, [11, 12, 13]))
    await eventually_async(lambda: _matches(seen_by, 48))
    assert await matched(seen_by) == 48


async def test_only_one_process_follows_the_engines_events(tmp_path: Path) -> None:
    async with two_processes(tmp_path) as (_, stores, _):
        assert [s.events_from_sibling for s in stores] == [False, True]


async def test_blocks_an_engine_stored_reach_the_process_that_does_not_follow_it(
    tmp_path: Path,
) -> None:
    async with two_processes(tmp_path) as (pub, stores, _):
        await store_three_blocks(pub, stores[0], stores[1])
        assert stores[1].events_from_sibling  # learned from the follower, not the engine


async def test_blocks_an_engine_removed_leave_the_other_processes_index(tmp_path: Path) -> None:
    async with two_processes(tmp_path) as (pub, stores, _):
        await store_three_blocks(pub, stores[0], stores[1])
        pub.publish(KVEventBatch(time.time(), [BlockRemoved([12])]))
        await eventually_async(lambda: _matches(stores[1], 16))
        assert await matched(stores[1]) == 16


async def test_a_process_that_starts_after_the_events_learns_what_they_said(
    tmp_path: Path,
) -> None:
    pub = publisher()
    stores = subscribed_pair(pub.endpoint)
    first_bus = SiblingBus(tmp_path, rescan_s=0.05)
    first = EmbeddedPrefixes(stores[0], siblings=first_bus)
    await first_bus.start()
    await first.start()
    try:
        await store_three_blocks(pub, stores[0], stores[0])
        async with processes(tmp_path, stores[1:]):
            await eventually_async(lambda: _matches(stores[1], 48))
            assert stores[1].events_from_sibling
    finally:
        await first.stop()
        await first_bus.stop()
        pub.close()


async def test_when_the_following_process_ends_another_takes_the_events_over(
    tmp_path: Path,
) -> None:
    async with two_processes(tmp_path) as (pub, stores, sources):
        await sources[0].stop()  # its process ends: the lock goes with it
        await eventually_async(lambda: _following_itself(stores[1]), timeout_s=3 * TAKE_OVER_S)
        await store_three_blocks(pub, stores[1], stores[1])
        assert not stores[1].events_from_sibling


async def test_a_feed_gone_stale_is_stale_in_every_process_until_it_resyncs(
    tmp_path: Path,
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(endpoint)
    stores = subscribed_pair(endpoint)
    try:
        async with processes(tmp_path, stores):
            await store_three_blocks(pub, stores[0], stores[1])
            assert not stores[1].stale(E) and stores[1].expects_events(E)
            pub.close()  # the engine's publisher went: the follower's feed is lost
            await eventually_async(lambda: stores[1].stale(E))
            assert stores[0].stale(E) and not stores[1].expects_events(E)

            pub = KVEventPublisher(endpoint)  # back, its sequence started over

            async def resynced() -> bool:
                pub.publish(KVEventBatch(time.time(), [BlockRemoved([99])]))
                await asyncio.sleep(0.02)  # the slow joiner's subscription is on its way
                return not stores[1].stale(E)

            await eventually_async(resynced)
            assert not stores[0].stale(E) and stores[1].expects_events(E)
    finally:
        pub.close()


async def _matches(store: KVStore, tokens: int) -> bool:
    return await matched(store) == tokens


async def _following_itself(store: KVStore) -> bool:
    return not store.events_from_sibling
