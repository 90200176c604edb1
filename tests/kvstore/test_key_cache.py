"""The block-key cache: the same keys as hashing from scratch, only the new blocks hashed."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from switchyard.kvstore.build import store_from_settings
from switchyard.kvstore.keys import KeyCache, block_keys
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import OFFLOAD_CHARS, RoutingTokenizer
from switchyard.router.kv import KVAwareness
from switchyard.router.metrics import KVMetrics
from tests.support import TOKENIZER_DIR

TOKENS = list(range(1000, 1000 + 16 * 40))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    cuts=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 3, 16]),
    seed=st.integers(0, 3),
    extra=st.sampled_from([None, "lora=a\x00salt="]),
)
def test_cached_keys_equal_keys_hashed_from_scratch(
    tokens: list[int], cuts: list[int], block_size: int, seed: int, extra: str | None
) -> None:
    cache = KeyCache(segment_blocks=2)
    for cut in [*cuts, len(tokens)]:
        prefix = tokens[:cut]
        assert cache.block_keys(prefix, block_size, seed, extra) == block_keys(
            prefix, block_size, seed, extra
        )


def test_a_longer_prompt_hashes_only_the_blocks_after_the_cached_segments() -> None:
    cache = KeyCache(segment_blocks=8)
    cache.block_keys(TOKENS[: 16 * 20], 16)
    assert (cache.hits, cache.misses) == (0, 20)
    cache.block_keys(TOKENS, 16)
    assert (cache.hits, cache.misses) == (16, 20 + 24), "two whole segments of the 20 blocks"


def test_another_seed_salt_or_block_size_does_not_share_cached_keys() -> None:
    cache = KeyCache()
    cache.block_keys(TOKENS, 16)
    for args in ((16, 1, None), (16, 0, "lora=\x00salt=s"), (32, 0, None)):
        assert cache.block_keys(TOKENS, *args) == block_keys(TOKENS, *args)
    assert cache.hits == 0


def test_the_cache_keeps_within_its_byte_bound_dropping_the_oldest_segments() -> None:
    cache = KeyCache(max_bytes=KeyCache.ENTRY_BYTES * 3)
    cache.block_keys(TOKENS, 16)
    assert len(cache) == 3
    cache.block_keys(TOKENS[: 16 * 8], 16)
    assert cache.hits == 0, "the first segments went out first"


def test_block_key_counters_move_by_what_the_cache_counted_since_the_last_sync() -> None:
    registry = CollectorRegistry()
    metrics = KVMetrics(registry)
    owner = SimpleNamespace(
        key_cache_hit=metrics.key_cache_hit,
        key_cache_miss=metrics.key_cache_miss,
        _keys_seen=(0, 0),
    )
    cache = KeyCache(segment_blocks=8)
    name = "switchyard_router_block_key_cache_total"
    for _ in range(2):
        cache.block_keys(TOKENS, 16)
        KVAwareness._count_keys(owner, cache)  # type: ignore[arg-type]
    assert registry.get_sample_value(name, {"outcome": "hit"}) == 40
    assert registry.get_sample_value(name, {"outcome": "miss"}) == 40


def test_stopping_the_store_ends_the_tokenizer_thread() -> None:
    store = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR))

    async def run() -> None:
        await store.start()
        await store.tokenize(None, prompt="word " * OFFLOAD_CHARS)
        assert _tokenize_threads()
        await store.stop()

    asyncio.run(run())  # the store stays referenced: its pool is not collected
    for thread in _tokenize_threads():
        thread.join(timeout=2.0)
    assert not _tokenize_threads()


def _tokenize_threads() -> list[threading.Thread]:
    alive = threading.enumerate()
    return [t for t in alive if t.name.startswith("switchyard-tokenize")]


def test_the_store_sizes_its_key_cache_from_the_settings() -> None:
    small = store_from_settings(KVStoreSettings(key_cache_bytes=KeyCache.ENTRY_BYTES * 10))
    large = store_from_settings(KVStoreSettings())
    assert small.key_cache.max_entries == 10
    assert large.key_cache.max_entries > 10_000
