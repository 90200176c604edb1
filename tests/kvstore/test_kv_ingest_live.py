"""Events over real ZMQ sockets: the mock engine's publisher, gaps, replay, and a full engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from openai import OpenAI

from switchyard.kvstore.store import KVStore
from switchyard.mock.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from switchyard.mock.kvevents import KVEventPublisher
from tests.support import TOKENIZER_DIR, Server, eventually, eventually_async, free_port

pytestmark = pytest.mark.timeout(60)

E = "http://127.0.0.1:8001"
TOKENS = list(range(100, 148))  # three blocks of 16


def stored(tokens: list[int], hashes: list[int], parent: int | None = None) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored(hashes, parent, tokens, 16)])


async def matched(store: KVStore, tokens: list[int] = TOKENS) -> int:
    res = await store.lookup(None, token_ids=tokens)
    return max((m.matched_tokens for m in res.matches), default=0)


@pytest.fixture
async def store() -> AsyncIterator[KVStore]:
    s = KVStore(block_size=16)
    await s.start()
    yield s
    await s.stop()


def publisher(encoding: str = "array", replay: bool = False) -> KVEventPublisher:
    replay_ep = f"tcp://127.0.0.1:{free_port()}" if replay else None
    return KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_ep, encoding=encoding)


async def joined(store: KVStore, pub: KVEventPublisher) -> None:
    """Publish a probe until the SUB socket sees it (ZMQ slow joiner), then forget it."""
    probe = list(range(16))

    async def seen() -> bool:
        pub.publish(stored(probe, [999]))
        await asyncio.sleep(0.02)
        return await matched(store, probe) == 16

    await eventually_async(seen)
    pub.publish(KVEventBatch(time.time(), [BlockRemoved([999])]))
    await eventually_async(lambda: _zero(store, probe))


async def _zero(store: KVStore, tokens: list[int]) -> bool:
    return await matched(store, tokens) == 0


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_published_events_update_the_index(store: KVStore, encoding: str) -> None:
    pub = publisher(encoding)
    try:
        store.subscribe(E, pub.endpoint)
        await joined(store, pub)
        pub.publish(stored(TOKENS[:32], [11, 12]))
        pub.publish(stored(TOKENS[32:], [13], parent=12))

        async def three_blocks() -> bool:
            return await matched(store) == 48

        await eventually_async(three_blocks)
        pub.publish(KVEventBatch(time.time(), [BlockRemoved([12])]))

        async def one_block() -> bool:
            return await matched(store) == 16

        await eventually_async(one_block)
        pub.publish(KVEventBatch(time.time(), [AllBlocksCleared()]))
        await eventually_async(lambda: _zero(store, TOKENS))
        assert await matched(store) == 0
    finally:
        pub.close()


async def test_lost_batches_are_recovered_by_replay(store: KVStore) -> None:
    pub = publisher(replay=True)
    try:
        store.subscribe(E, pub.endpoint, replay_endpoint=pub.replay_endpoint)
        await joined(store, pub)
        pub.publish(stored(TOKENS[:16], [11]))
        pub.drop_next(1)
        pub.publish(stored(TOKENS[16:32], [12], parent=11))
        pub.publish(stored(TOKENS[32:], [13], parent=12))

        async def all_three() -> bool:
            return await matched(store) == 48

        await eventually_async(all_three)
        reg = store.metrics.registry
        assert reg.get_sample_value("switchyard_kvstore_sequence_gaps_total", {"instance": E}) == 1
        ok = {"instance": E, "outcome": "ok"}
        assert reg.get_sample_value("switchyard_kvstore_replays_total", ok) == 1
    finally:
        pub.close()


async def test_a_store_that_joins_late_converges_on_new_prefixes(store: KVStore) -> None:
    pub = publisher()
    try:
        pub.publish(stored(TOKENS[:16], [11]))  # before the store listens: never seen
        await asyncio.sleep(0.05)
        store.subscribe(E, pub.endpoint)
        await joined(store, pub)
        pub.publish(stored(TOKENS[16:32], [12], parent=11))  # child of an unseen parent
        fresh = list(range(700, 732))
        pub.publish(stored(fresh, [21, 22]))

        async def fresh_found() -> bool:
            return await matched(store, fresh) == 32

        await eventually_async(fresh_found)
        assert await matched(store) == 0
        reg = store.metrics.registry
        assert reg.get_sample_value("switchyard_kvstore_orphan_blocks_total") == 1
    finally:
        pub.close()


async def test_a_store_that_joins_late_learns_the_buffered_blocks_by_replay(
    store: KVStore,
) -> None:
    pub = publisher(replay=True)
    try:
        pub.publish(stored(TOKENS[:32], [11, 12]))  # before the store listens
        pub.publish(stored(TOKENS[32:], [13], parent=12))
        pub.publish(KVEventBatch(time.time(), [BlockRemoved([13])]))
        await asyncio.sleep(0.05)
        store.subscribe(E, pub.endpoint, replay_endpoint=pub.replay_endpoint)

        async def two_blocks() -> bool:
            return await matched(store) == 32

        await eventually_async(two_blocks)
        await joined(store, pub)  # live frames follow the replayed ones
        assert await matched(store) == 32
        reg = store.metrics.registry
        assert reg.get_sample_value("switchyard_kvstore_sequence_gaps_total", {"instance": E}) in (
            None,
            0,
        )
    finally:
        pub.close()


async def test_a_gap_without_replay_clears_the_instance(store: KVStore) -> None:
    pub = publisher()
    other = list(range(500, 516))
    try:
        store.subscribe(E, pub.endpoint)
        await joined(store, pub)
        pub.publish(stored(TOKENS[:16], [11]))

        async def first() -> bool:
            return await matched(store) == 16

        await eventually_async(first)
        pub.inject_gap(1)
        pub.publish(stored(other, [21]))

        async def second() -> bool:
            return await matched(store, other) == 16

        await eventually_async(second)
        assert await matched(store) == 0
        clears = {"instance": E, "reason": "gap"}
        reg = store.metrics.registry
        assert reg.get_sample_value("switchyard_kvstore_instance_clears_total", clears) == 1
    finally:
        pub.close()


@pytest.mark.parametrize(
    ("flavor", "encoding", "tokenizer"),
    [("vllm", "map", "dir"), ("sglang", "array", "engine")],
)
def test_a_chat_served_by_the_mock_engine_is_found_by_the_kvstore_service(
    flavor: str, encoding: str, tokenizer: str
) -> None:
    """End to end: real mock engine process, real kvstore process, the engine's tokenizer
    (read from the same directory, or asked over the engine's ``/tokenize``)."""
    zmq_port, engine_port = free_port(), free_port()
    engine_args = ["mock", "--port", str(engine_port), "--block-size", "16", "--speed", "100"]
    engine_args += ["--flavor", flavor, "--kv-events-encoding", encoding]
    engine_args += ["--kv-events-port", str(zmq_port), "--tokenizer", str(TOKENIZER_DIR)]
    engine = Server(engine_args, engine_port)
    kv_port = free_port()
    tok_args = (
        ["--tokenizer", str(TOKENIZER_DIR)]
        if tokenizer == "dir"
        else ["--tokenize-url", engine.url]
    )
    subscription = f"{engine.url}=tcp://127.0.0.1:{zmq_port},flavor={flavor}"
    store = Server(
        ["kvstore", "--port", str(kv_port), *tok_args, "--subscribe", subscription], kv_port
    )
    messages = [
        {"role": "system", "content": "You answer questions about routing. " * 30},
        {"role": "user", "content": "Which engine holds my prefix?"},
    ]
    with engine, store:
        client = OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
        body = {"model": "mock-model", "messages": messages, "candidates": [engine.url]}

        def lookup() -> dict | None:
            client.chat.completions.create(model="mock-model", messages=messages, max_tokens=2)
            time.sleep(0.1)  # the engine's events reach the store
            answer = httpx.post(store.url + "/v1/lookup", json=body, timeout=5).json()
            return answer if answer["matches"] else None

        answer = eventually(lookup, 15, 0)
        found = answer["matches"]
        assert found[0]["instance"] == engine.url
        assert found[0]["matched_tokens"] == answer["total_tokens"] // 16 * 16
