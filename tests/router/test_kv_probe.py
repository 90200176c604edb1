"""The router tokenizes a long prompt only as far as some worker's cached prefix reaches."""

from __future__ import annotations

import asyncio

from balancer.fleet import Fleet
from kvstore.store import KVStore
from kvstore.tokenize import RoutingTokenizer
from router.kv import KVAwareness
from router.metrics import RouterMetrics
from router.scheduler.framework import Context
from tests.support import TOKENIZER_DIR

WORDS = " ".join(f"word{i % 97} token{i % 13}" for i in range(4000))


def awareness() -> tuple[KVAwareness, KVStore]:
    store = KVStore(tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR))
    return KVAwareness(store, Fleet(), RouterMetrics(), speculative_ttl_s=30.0), store


async def probe(kv: KVAwareness, text: str) -> tuple[bool, Context]:
    ctx = Context(model="m")
    stopped = await kv._probe(ctx, "m", {"prompt": text}, None, ["a", "b"])
    return stopped, ctx


def test_a_match_ending_early_stops_tokenization_at_a_head() -> None:
    async def run() -> None:
        kv, store = awareness()
        tokens, _ = await store.tokenize("m", prompt=WORDS)
        await store.record_placement(store.keys_for(tokens[:160]), "a")
        stopped, ctx = await probe(kv, WORDS)
        assert stopped
        assert ctx.matched["a"] == 160
        assert ctx.prefix is not None and len(ctx.prefix.keys) < len(tokens) // 16
        assert abs(ctx.prompt_tokens - len(tokens)) < 0.1 * len(tokens)

    asyncio.run(run())


def test_a_match_reaching_past_the_first_head_grows_the_probe() -> None:
    async def run() -> None:
        kv, store = awareness()
        tokens, _ = await store.tokenize("m", prompt=WORDS)
        await store.record_placement(store.keys_for(tokens[:1600]), "b")
        stopped, ctx = await probe(kv, WORDS)
        assert stopped
        assert ctx.matched["b"] == 1600

    asyncio.run(run())


def test_a_prompt_matched_to_its_end_is_tokenized_whole() -> None:
    async def run() -> None:
        kv, store = awareness()
        text = WORDS[:3000]
        tokens, _ = await store.tokenize("m", prompt=text)
        await store.record_placement(store.keys_for(tokens), "a")
        stopped, _ = await probe(kv, text)
        assert not stopped

    asyncio.run(run())
