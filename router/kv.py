"""The router's view of the fleet's KV caches: prefix lookups, estimated placements, hit rate.

With engines that publish KV events the KV store knows what each engine holds.
Without them the router estimates: it records where it sent each prompt as
speculative entries with a TTL (approximate mode) and says so in its metrics.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from kvstore.registry import FleetFollower
from kvstore.store import KVStore, LookupResult
from router.metrics import KVMetrics
from router.request import CHAT, COMPLETIONS, RoutedRequest
from router.scheduler.framework import Context

if TYPE_CHECKING:
    from balancer.view import FleetView
    from balancer.worker import Worker
    from kvstore.remote import RemoteKVStore
    from router.metrics import RouterMetrics

OCCUPANCY_TTL_S = 0.1
PROBE_CHARS = 512
PROBE_GROWTH = 4

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
        fleet: FleetView,
        metrics: RouterMetrics,
        *,
        speculative_ttl_s: float,
        event_lag_ttl_s: float = 2.0,
    ) -> None:
        self.store = store
        self.fleet = fleet
        self.speculative_ttl_s = speculative_ttl_s
        self.event_lag_ttl_s = event_lag_ttl_s
        self.follower: FleetFollower | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._occupancy: dict[str, int] = {}
        self._occupancy_at = -1.0
        if isinstance(store, KVStore):
            self.follower = FleetFollower(store)
            fleet.subscribe(self.follower)
            for worker in fleet.workers():
                self.follower("added", worker)
        counters = KVMetrics(metrics.registry)
        self.predicted = counters.predicted
        self.actual = counters.actual
        self.prompt = counters.prompt
        self.degraded = counters.degraded

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
        salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
        ids = [w.id for w in candidates]
        if not await self._probe(ctx, req.model, kwargs, salt, ids):
            result = await self.store.lookup(
                req.model, candidates=ids, lora_name=None, cache_salt=salt, **kwargs
            )
            if result.degraded:
                self.degraded.inc()
            ctx.set_prefix(result)
        ctx.cached_blocks = await self.occupancy()

    async def _probe(
        self, ctx: Context, model: str, kwargs: dict[str, Any], salt: str | None, ids: list[str]
    ) -> bool:
        """Tokenize a long prompt only as far as some worker's match reaches.

        Tokenizing costs ~1.5 us per token, on the request's path and on the one event
        loop: a burst of long prompts queues behind it (the Mooncake trace's bursts of
        ten added ~15 ms to everyone's TTFT). Matches are consecutive from block 0, so
        once every worker's match ends inside a head of the prompt, the rest of the
        prompt cannot change them: routing needs only its length. Heads grow fourfold
        from ``PROBE_CHARS``. The placement records the probed head; a worker without
        KV events gets the whole prompt recorded once the first byte is on its way.
        """
        store = self.store
        if not isinstance(store, KVStore):
            return False
        tok = store.tokenizer_for(model)
        messages, prompt = kwargs.get("messages"), kwargs.get("prompt")
        text = tok.render_chat(messages) if messages is not None else prompt
        if not tok.exact or not isinstance(text, str):
            return False
        chars = PROBE_CHARS
        while True:
            head = tok.encode_head(text, chars, prompt=messages is None)
            if head is None or len(head) < store.block_size:
                return False
            keys = store.keys_for(head, None, salt)
            matches, degraded = await store.lookup_keys(keys, ids)
            if degraded:
                return False
            longest = max((m.matched_tokens for m in matches), default=0)
            if longest < len(keys) * store.block_size:
                break
            chars *= PROBE_GROWTH
        total = round(len(text) * len(head) / chars)
        ctx.set_prefix(LookupResult(store.block_size, total, keys, matches, exact=False))
        ctx.deferred_keys = (model, kwargs, salt)
        return True

    async def occupancy(self) -> dict[str, int]:
        """Blocks each instance holds, from a snapshot at most ``OCCUPANCY_TTL_S`` old.

        Only the embedded store answers this cheaply; with a remote store the
        scheduler goes without it.
        """
        if not isinstance(self.store, KVStore):
            return self._occupancy
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
        """Record where the prompt is going, as a speculative entry.

        Without events this is all the router knows (approximate mode, long TTL). With
        events it bridges the moments until the engine's BlockStored arrives: a burst of
        requests sharing a new prefix follows the first one instead of scattering
        (events confirm the entry, or it expires after ``event_lag_ttl_s``).
        """
        ttl = self.speculative_ttl_s if self.estimating(worker) else self.event_lag_ttl_s
        if ctx.prefix is None or not ctx.prefix.keys:
            return
        record = self.store.record_placement(ctx.prefix.keys, worker.id, rank or 0, ttl)
        if isinstance(self.store, KVStore):
            await record
            return
        self._spawn(record)

    def answered(self, ctx: Context, worker: Worker, rank: int | None) -> None:
        """The worker answered: record the whole prompt where no KV events will.

        With events the probed head bridges the moments until the engine's own events
        arrive, so the rest is never tokenized here. Without them the placement is all
        the router will know: the tokenization the probe skipped is paid now, spawned
        once the first byte is on its way (any earlier, it would hold the event loop
        while the request or its first token waits).
        """
        deferred, ctx.deferred_keys = ctx.deferred_keys, None
        if deferred is None or not self.estimating(worker):
            return
        self._spawn(self._place_later(deferred, worker.id, rank or 0, self.speculative_ttl_s))

    async def _place_later(
        self, deferred: tuple[str, dict[str, Any], str | None], instance: str, rank: int, ttl: float
    ) -> None:
        model, kwargs, salt = deferred
        assert isinstance(self.store, KVStore)
        tokens, _ = await self.store.tokenize(model, **kwargs)
        keys = self.store.keys_for(tokens, None, salt)
        await self.store.record_placement(keys, instance, rank, ttl)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
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
