"""``KVStore.take_frame``: a live event frame applied on the subscriber's callback, or left
to the task that handles gaps, restarts and duplicates."""

from __future__ import annotations

import msgpack

from switchyard.kvstore.feed import Feed
from switchyard.kvstore.store import KVStore

E = "http://127.0.0.1:8001"
TOKENS = list(range(32))


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "medium": "GPU",
    }
    return msgpack.packb([1.0, [event]])


async def matched(store: KVStore) -> int:
    res = await store.lookup(None, token_ids=TOKENS)
    return max((m.matched_tokens for m in res.matches), default=0)


def following(store: KVStore, last_seq: int) -> Feed:
    feed = Feed(store._ingestor(E, 0), "test")
    feed.last_seq = last_seq
    return feed


async def test_the_next_frame_of_a_feed_is_applied_at_once() -> None:
    store = KVStore(block_size=16)
    feed = following(store, 6)
    assert store.take_frame(feed, 7, stored([1, 2], None, TOKENS))
    assert feed.last_seq == 7
    assert await matched(store) == 32


async def test_a_frame_after_a_gap_is_left_to_the_gap_handling() -> None:
    store = KVStore(block_size=16)
    feed = following(store, 6)
    assert not store.take_frame(feed, 9, stored([1, 2], None, TOKENS))
    assert feed.last_seq == 6
    assert await matched(store) == 0


async def test_a_feed_not_yet_followed_or_catching_up_takes_no_frame() -> None:
    store = KVStore(block_size=16)
    fresh = Feed(store._ingestor(E, 0), "test")
    assert not store.take_frame(fresh, 0, stored([1, 2], None, TOKENS))
    feed = following(store, 6)
    feed.catching_up = True
    assert not store.take_frame(feed, 7, stored([1, 2], None, TOKENS))
    assert await matched(store) == 0


async def test_an_undecodable_frame_is_left_to_be_counted_and_logged() -> None:
    store = KVStore(block_size=16)
    feed = following(store, 6)
    assert not store.take_frame(feed, 7, b"\xc1 not msgpack")
    assert feed.last_seq == 6
