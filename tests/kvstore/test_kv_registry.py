"""Subscriptions follow the balancer's worker registry (DP ranks on offset ports)."""

from __future__ import annotations

import asyncio
import time

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.worker import WorkerSpec
from switchyard.kvstore.registry import FleetFollower, rank_endpoint
from switchyard.kvstore.store import KVStore
from switchyard.mock.engine.events import BlockStored, KVEventBatch
from switchyard.mock.kvevents import KVEventPublisher
from tests.support import eventually_async, free_port

pytestmark = pytest.mark.timeout(30)

URL = "http://127.0.0.1:8001"


def test_rank_endpoints_offset_the_port_like_vllm() -> None:
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"


async def test_a_registered_worker_is_followed_per_rank_and_forgotten_on_removal() -> None:
    base = free_port() - 1  # rank 1 publishes on base + 1, a port known to be free
    pub1 = KVEventPublisher(f"tcp://127.0.0.1:{base}", dp_rank=1)
    store = KVStore(block_size=16)
    await store.start()
    follower = FleetFollower(store)
    fleet = Fleet()
    fleet.subscribe(follower)
    try:
        fleet.add(WorkerSpec.parse(f"{URL};dp=2;kv=tcp://127.0.0.1:{base}"))
        assert follower.endpoints[URL] == [
            f"tcp://127.0.0.1:{base}",
            f"tcp://127.0.0.1:{base + 1}",
        ]
        tokens = list(range(16))

        async def published() -> list:
            # Published again each time: a subscriber still joining misses the first ones.
            pub1.publish(KVEventBatch(time.time(), [BlockStored([7], None, tokens, 16)]))
            await asyncio.sleep(0.05)
            return (await store.lookup(None, token_ids=tokens)).matches

        matches = await eventually_async(published, 5, 0)
        assert [(m.instance, m.dp_rank) for m in matches] == [(URL, 1)]

        fleet.remove(URL)
        await follower.wait()
        assert URL not in follower.endpoints and store.feeds() == []
        assert (await store.lookup(None, token_ids=tokens)).matches == []
    finally:
        pub1.close()
        await store.stop()
