"""The router's view of the fleet's KV caches: prefix lookups, estimated placements, hit rate.

With engines that publish KV events the KV store knows what each engine holds.
Without them the router estimates: it records where it sent each prompt as
speculative entries with a TTL (approximate mode) and says so in its metrics.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from kvstore.registry import FleetFollower
from kvstore.store import KVStore
from router.request import CHAT, COMPLETIONS, RoutedRequest
from router.scheduler.framework import Context

if TYPE_CHECKING:
    from balancer.fleet import Fleet
    from balancer.worker import Worker
    from kvstore.remote import RemoteKVStore
    from router.metrics import RouterMetrics

OCCUPANCY_TTL_S = 0.1

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


def usage_tokens(body: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, cached_tokens) from a response body or the tail of a stream."""
    prompts = _PROMPT.findall(body)
    if not prompts:
        return None
    cached = _CACHED.findall(body)
    return int(prompts[-1]), int(cached[-1]) if cached else 0


class KVAwareness:
    def __init__(
        self,
        store: KVStore | RemoteKVStore,
        fleet: Fleet,
        metrics: RouterMetrics,
        *,
        speculative_ttl_s: float,
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.speculative_ttl_s = speculative_ttl_s
        self.follower: FleetFollower | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._occupancy: dict[str, int] = {}
        self._occupancy_at = -1.0
        if isinstance(store, KVStore):
            self.follower = FleetFollower(store)
            fleet.subscribe(self.follower)
            for worker in fleet.workers():
                self.follower("added", worker)
        r = metrics.registry
        self.predicted = Counter(
            "switchyard_router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen worker to have cached.",
            registry=r,
        )
        self.actual = Counter(
            "switchyard_router_actual_cached_tokens",
            "Prompt tokens the engines reported as cached (usage.prompt_tokens_details).",
            registry=r,
        )
        self.prompt = Counter(
            "switchyard_router_prompt_tokens",
            "Prompt tokens of answered requests that reported usage.",
            registry=r,
        )
        self.degraded = Counter(
            "switchyard_router_kv_lookups_degraded",
            "Lookups answered without information (KV store down or slow).",
            registry=r,
        )

    def has_events(self, worker: Worker) -> bool:
        return bool(worker.spec.kv_events)

    def estimating(self, worker: Worker) -> bool:
        """Approximate mode for this worker: no KV events, so placements are estimated."""
        return not self.has_events(worker)

    async def start(self) -> None:
        await self.store.start()

    async def stop(self) -> None:
        await self.store.stop()

    async def annotate(self, ctx: Context, req: RoutedRequest, candidates: list[Worker]) -> None:
        """Fill the context with the prefix matches of the candidates."""
        data: dict[str, Any] = req.data
        kwargs: dict[str, Any] = {}
        if req.route == CHAT:
            kwargs["messages"] = data["messages"]
        elif req.route == COMPLETIONS:
            prompt = data["prompt"]
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]
            kwargs["prompt"] = prompt
        else:
            return
        result = await self.store.lookup(
            req.model,
            candidates=[w.id for w in candidates],
            lora_name=None,
            cache_salt=data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None,
            **kwargs,
        )
        if result.degraded:
            self.degraded.inc()
        ctx.set_prefix(result)
        ctx.cached_blocks = await self.occupancy()

    async def occupancy(self) -> dict[str, int]:
        """Blocks each instance holds, from a snapshot at most ``OCCUPANCY_TTL_S`` old."""
        now = time.monotonic()
        if now - self._occupancy_at > OCCUPANCY_TTL_S:
            self._occupancy_at = now
            counts: dict[str, int] = {}
            for info in await self.store.locations():
                instance = info.location.instance
                counts[instance] = counts.get(instance, 0) + info.blocks
            self._occupancy = counts
        return self._occupancy

    async def placed(self, ctx: Context, worker: Worker, rank: int | None) -> None:
        """Record an estimated placement where the engine publishes no events."""
        if ctx.prefix is None or not ctx.prefix.keys or not self.estimating(worker):
            return
        record = self.store.record_placement(
            ctx.prefix.keys, worker.id, rank or 0, self.speculative_ttl_s
        )
        if isinstance(self.store, KVStore):
            await record
            return
        task = asyncio.get_running_loop().create_task(record)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def observe_usage(self, ctx: Context, worker_id: str, tail: bytes) -> None:
        usage = usage_tokens(tail)
        if usage is None:
            return
        prompt, cached = usage
        self.prompt.inc(prompt)
        self.actual.inc(cached)
        self.predicted.inc(min(ctx.matched.get(worker_id, 0.0), prompt))
