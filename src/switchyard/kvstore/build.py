"""Building a ``KVStore`` from settings (embedded in the router or as the service)."""

from __future__ import annotations

from switchyard.kvstore.discovery import worker_url
from switchyard.kvstore.index import KVIndex
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.redis_index import RedisIndex
from switchyard.kvstore.settings import KVStoreSettings
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer


def tokenizer_from(settings: KVStoreSettings) -> RoutingTokenizer:
    if settings.tokenizer:
        return RoutingTokenizer.from_dir(settings.tokenizer, settings.tokenize_cache_bytes)
    if settings.tokenize_url:
        return RoutingTokenizer.from_engine(settings.tokenize_url, settings.tokenize_cache_bytes)
    return RoutingTokenizer.approximate()


def store_from_settings(settings: KVStoreSettings) -> KVStore:
    index: KVIndex
    if settings.redis_url:
        index = RedisIndex(
            settings.redis_url,
            prefix=settings.redis_prefix,
            idle_ttl_s=settings.redis_idle_ttl_s,
        )
    else:
        index = MemoryIndex(capacity_blocks=settings.capacity_blocks)
    store = KVStore(
        index,
        block_size=settings.block_size,
        seed=settings.seed,
        tokenizer=tokenizer_from(settings),
        speculative_ttl_s=settings.speculative_ttl_s,
        lookup_timeout_s=settings.lookup_timeout_ms / 1000.0,
        key_cache_bytes=settings.key_cache_bytes,
        zmtp=settings.zmtp(),
    )
    for sub in settings.subscriptions():
        store.subscribe(sub.instance, sub.endpoint, sub.replay_endpoint, sub.flavor, sub.dp_rank)
    if settings.kv_listen:
        store.listen(settings.kv_listen)
    if settings.workers:
        store.follow_workers([worker_url(w) for w in settings.workers])
    return store
