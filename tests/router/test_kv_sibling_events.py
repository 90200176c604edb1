"""The processes of one router: one follows the engines' KV events and shares the index
operations they become; the others apply those, and take the events over when it ends."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from balancer.siblings import SiblingBus
from kvstore.store import KVStore
from mockengine.engine.events import BlockRemoved, KVEventBatch
from router.kv import TAKE_OVER_S, EmbeddedPrefixes
from tests.kvstore.test_kv_ingest_live import TOKENS, eventually, joined, matched, publisher, stored
from tests.router.test_kv_probe import processes

pytestmark = pytest.mark.timeout(60)

E = "http://127.0.0.1:8001"


def subscribed_pair(endpoint: str) -> list[KVStore]:
    stores = [KVStore(block_size=16) for _ in range(2)]
    for store in stores:
        store.subscribe(E, endpoint)
    return stores


async def test_only_one_process_follows_the_engines_events(tmp_path: Path) -> None:
    pub = publisher()
    stores = subscribed_pair(pub.endpoint)
    try:
        async with processes(tmp_path, stores):
            assert [s.events_from_sibling for s in stores] == [False, True]
    finally:
        pub.close()


async def test_blocks_an_engine_stored_reach_the_process_that_does_not_follow_it(
    tmp_path: Path,
) -> None:
    pub = publisher()
    stores = subscribed_pair(pub.endpoint)
    try:
        async with processes(tmp_path, stores):
            await joined(stores[0], pub)
            pub.publish(stored(TOKENS, [11, 12, 13]))
            await eventually(lambda: _matches(stores[1], 48))
    finally:
        pub.close()


async def test_blocks_an_engine_removed_leave_the_other_processes_index(tmp_path: Path) -> None:
    pub = publisher()
    stores = subscribed_pair(pub.endpoint)
    try:
        async with processes(tmp_path, stores):
            await joined(stores[0], pub)
            pub.publish(stored(TOKENS, [11, 12, 13]))
            await eventually(lambda: _matches(stores[1], 48))
            pub.publish(KVEventBatch(time.time(), [BlockRemoved([12])]))
            await eventually(lambda: _matches(stores[1], 16))
    finally:
        pub.close()


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
        await joined(stores[0], pub)
        pub.publish(stored(TOKENS, [11, 12, 13]))
        await eventually(lambda: _matches(stores[0], 48))
        async with processes(tmp_path, stores[1:]):
            await eventually(lambda: _matches(stores[1], 48))
            assert stores[1].events_from_sibling
    finally:
        await first.stop()
        await first_bus.stop()
        pub.close()


async def test_when_the_following_process_ends_another_takes_the_events_over(
    tmp_path: Path,
) -> None:
    pub = publisher()
    stores = subscribed_pair(pub.endpoint)
    try:
        async with processes(tmp_path, stores) as sources:
            await sources[0].stop()  # its process ends: the lock goes with it
            await eventually(lambda: _following_itself(stores[1]), timeout=3 * TAKE_OVER_S)
            await joined(stores[1], pub)
            pub.publish(stored(TOKENS, [11, 12, 13]))
            await eventually(lambda: _matches(stores[1], 48))
    finally:
        pub.close()


async def _matches(store: KVStore, tokens: int) -> bool:
    return await matched(store) == tokens


async def _following_itself(store: KVStore) -> bool:
    return not store.events_from_sibling
