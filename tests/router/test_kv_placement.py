"""Where a request goes is recorded as speculative index entries, as far as they are new."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Worker, WorkerSpec
from switchyard.kvstore.index import Location
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.router.kv import KVAwareness
from switchyard.router.metrics import RouterMetrics
from switchyard.router.scheduler.framework import Context
from tests.support import TOKENIZER_DIR

TEXT = " ".join(f"word{i % 97} token{i % 13}" for i in range(400))
WITH_EVENTS = Worker(WorkerSpec("http://a", kv_events="tcp://127.0.0.1:1"), BalancerSettings())
WITHOUT_EVENTS = Worker(WorkerSpec("http://a"), BalancerSettings())


class NoFleet:
    def subscribe(self, callback: Callable[..., None]) -> None:
        return None

    def workers(self) -> list[Worker]:
        return []


def placed_after_holding(
    worker: Worker, held_blocks: int, held_rank: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Let ``worker`` hold the prompt's first blocks (engine-confirmed), look the prompt
    up, place it there: what was recorded, and the prompt's keys."""

    async def run() -> tuple[list[list[int]], list[int]]:
        store = KVStore(block_size=16, tokenizer=RoutingTokenizer.from_dir(TOKENIZER_DIR))
        kv = KVAwareness(store, NoFleet(), RouterMetrics(), speculative_ttl_s=30.0)  # type: ignore[arg-type]
        tokens, _ = await store.tokenize("m", prompt=TEXT)
        keys = store.keys_for(tokens)
        await store.index.add(keys[:held_blocks], Location(worker.id, held_rank, "gpu"))
        recorded: list[list[int]] = []
        record = store.record_placement

        async def spy(
            keys: list[int], instance: str, dp_rank: int = 0, ttl_s: float | None = None
        ) -> None:
            recorded.append(keys)
            await record(keys, instance, dp_rank, ttl_s)

        store.record_placement = spy  # type: ignore[method-assign]
        ctx = Context(model="m")
        ctx.set_prefix(await store.match_tokens(tokens, [worker.id]))
        await kv.placed(ctx, worker, 0)
        return recorded, keys

    return asyncio.run(run())


def test_with_events_only_the_blocks_past_the_workers_cached_prefix_are_placed() -> None:
    recorded, keys = placed_after_holding(WITH_EVENTS, 10)
    assert recorded == [keys[10:]]


def test_with_events_a_prompt_the_worker_holds_whole_places_nothing() -> None:
    recorded, keys = placed_after_holding(WITH_EVENTS, 10_000)
    assert recorded == []


def test_without_events_the_whole_prompt_is_placed_again_renewing_its_estimate() -> None:
    recorded, keys = placed_after_holding(WITHOUT_EVENTS, 10)
    assert recorded == [keys]


def test_blocks_held_on_another_dp_rank_are_placed_on_this_one() -> None:
    recorded, keys = placed_after_holding(WITH_EVENTS, 10, held_rank=1)
    assert recorded == [keys]
