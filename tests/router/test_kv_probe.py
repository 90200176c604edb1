"""The router tokenizes a long prompt only as far as some worker's cached prefix reaches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from prometheus_client import CollectorRegistry

from switchyard.balancer.siblings import SiblingBus
from switchyard.kvstore.store import KVStore, LookupResult
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.router.kv import EmbeddedPrefixes
from switchyard.router.scheduler.framework import Context
from tests.support import TOKENIZER_DIR, eventually_async

WORDS = " ".join(f"word{i % 97} token{i % 13}" for i in range(4000))


def probe_after_placing(text: str, held: int | None, worker: str) -> tuple[bool, Context, int]:
    """Place the first ``held`` tokens of ``text`` (all if None) on ``worker``, then probe.

    Returns whether the probe stopped short of a full lookup, its context and the
    prompt's true token count.
    """

    async def run() -> tuple[bool, Context, int]:
        store = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR))
        tokens, _ = await store.tokenize("m", prompt=text)
        await store.record_placement(store.keys_for(tokens[:held]), worker)
        ctx = Context(model="m")
        result = await EmbeddedPrefixes(store).probe("m", {"prompt": text}, None, ["a", "b"])
        if result is not None:
            ctx.set_prefix(result)
        return result is not None, ctx, len(tokens)

    return asyncio.run(run())


def test_a_match_ending_early_stops_tokenization_at_a_head() -> None:
    stopped, ctx, total = probe_after_placing(WORDS, 160, "a")
    assert stopped
    assert ctx.matched["a"] == 160
    assert ctx.prefix is not None and len(ctx.prefix.keys) < total // 16
    assert abs(ctx.prompt_tokens - total) < 0.1 * total


def test_a_match_reaching_past_the_first_head_grows_the_probe() -> None:
    stopped, ctx, _ = probe_after_placing(WORDS, 1600, "b")
    assert stopped
    assert ctx.matched["b"] == 1600


def test_a_prompt_matched_to_its_end_is_tokenized_whole() -> None:
    stopped, _, _ = probe_after_placing(WORDS[:3000], None, "a")
    assert not stopped


def test_a_single_new_chat_message_is_probed_at_its_head() -> None:
    """Below the length that goes to the tokenizer thread, too (the Mooncake trace's
    prompts are one message each, most of them under it)."""
    message = [{"role": "user", "content": WORDS[:3000]}]

    async def run() -> tuple[LookupResult | None, int]:
        store = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR))
        # Tokenized by another store: this one has not seen the message.
        other = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR))
        tokens, _ = await other.tokenize("m", messages=message)
        await store.record_placement(store.keys_for(tokens[:160]), "a")
        probed = EmbeddedPrefixes(store)
        return await probed.probe("m", {"messages": message}, None, ["a", "b"]), len(tokens)

    result, total = asyncio.run(run())
    assert result is not None
    assert len(result.keys) < total // 16
    assert [(m.instance, m.matched_tokens) for m in result.matches] == [("a", 160)]


def test_the_embedded_stores_metrics_are_served_with_the_routers() -> None:
    registry = CollectorRegistry()
    store = KVStore(block_size=16, tokenizer=RoutingTokenizer.approximate())
    store.metrics.lag.labels("http://engine:8000").set(0.25)
    EmbeddedPrefixes(store).expose(registry)
    lag = {"instance": "http://engine:8000"}
    assert registry.get_sample_value("switchyard_kvstore_event_lag_seconds", lag) == 0.25


@asynccontextmanager
async def processes(tmp_path: Path, stores: list[KVStore]) -> AsyncIterator[list[EmbeddedPrefixes]]:
    """Each store as one process of a router sees it, all on one sibling bus."""
    buses = [SiblingBus(tmp_path, rescan_s=0.05) for _ in stores]
    sources = [EmbeddedPrefixes(s, siblings=b) for s, b in zip(stores, buses, strict=True)]
    for bus, source in zip(buses, sources, strict=True):
        await bus.start()
        await source.start()
    try:
        await eventually_async(lambda: all(bus.peers == len(stores) - 1 for bus in buses))
        await asyncio.sleep(0.2)  # a SUB that has just connected may still be subscribing
        yield sources
    finally:
        for bus, source in zip(buses, sources, strict=True):
            await source.stop()
            await bus.stop()


async def test_a_placement_reaches_the_routers_other_processes(tmp_path: Path) -> None:
    stores = [KVStore(block_size=16) for _ in range(2)]
    async with processes(tmp_path, stores) as sources:
        tokens = list(range(1000, 1128))
        await sources[0].place(stores[0].keys_for(tokens), "a", 0, 30.0)

        async def matched_on_the_other() -> int:
            result = await stores[1].lookup(None, token_ids=tokens, candidates=["a"])
            return sum(m.matched_tokens for m in result.matches)

        async def shared() -> bool:
            return await matched_on_the_other() == 128

        assert await eventually_async(shared, 3, 0.02, "placement not shared")


async def test_a_chat_message_one_process_tokenized_is_cached_in_the_others(
    tmp_path: Path,
) -> None:
    stores = [
        KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR)) for _ in range(2)
    ]
    async with processes(tmp_path, stores) as sources:
        chat = [{"role": "system", "content": WORDS[:2000]}, {"role": "user", "content": "hi"}]
        await sources[0].warm("m", {"messages": chat})
        other = stores[1].tokenizer
        await eventually_async(lambda: other.uncached_chars(chat[:1]) == 0)
        ids, _ = await stores[1].tokenize("m", messages=chat)
        assert ids == (await stores[0].tokenize("m", messages=chat))[0]
