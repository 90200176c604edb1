"""The router's view of the fleet's KV caches: prefix lookups, estimated placements, hit rate.

With engines that publish KV events the KV store knows what each engine holds.
Without them the router estimates: it records where it sent each prompt as
speculative entries with a TTL (approximate mode) and says so in its metrics.
The store is embedded (``EmbeddedPrefixes``: tokenizes, follows the fleet's events)
or a kvstore service (``RemotePrefixes``: one HTTP lookup per request).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from switchyard.balancer.siblings import ProcessLock, SiblingBus
from switchyard.core.packing import packb
from switchyard.kvstore.index import Add, Clear, Location, Op, Remove
from switchyard.kvstore.keys import KeyCache
from switchyard.kvstore.remote import RemoteKVStore
from switchyard.kvstore.store import KVStore, LookupResult
from switchyard.kvstore.tokenize import (
    CHARS_PER_TOKEN,
    OFFLOAD_CHARS,
    ChatPlan,
    RoutingTokenizer,
)
from switchyard.router.metrics import METRICS_DIR_ENV, KVMetrics
from switchyard.router.parity import ParityMonitor
from switchyard.router.request import CHAT, COMPLETIONS, RoutedRequest
from switchyard.router.scheduler.framework import Context

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from switchyard.balancer.view import FleetView
    from switchyard.balancer.worker import Worker
    from switchyard.router.metrics import RouterMetrics
    from switchyard.router.usage import Usage

OCCUPANCY_TTL_S = 0.1
PLACE = b"place"  # sibling-bus topic: a placement another process of this router recorded
TOKENS = b"tokens"  # sibling-bus topic: a chat message another process tokenized
OPS = b"kvops"  # sibling-bus topic: index operations the engines' events became
STALE = b"kvstale"  # sibling-bus topic: an instance's event feed went stale or resynced
# How often a process whose sibling follows the engines' events tries to take that over.
TAKE_OVER_S = 1.0
# How far behind the cache counters of a process that is not answering /metrics may be.
COUNTER_SYNC_S = 1.0
_ADD, _REMOVE, _CLEAR = 0, 1, 2
PROBE_CHARS = 512
PROBE_GROWTH = 4


Prompt = dict[str, Any]  # {"messages": [...]} or {"prompt": "..."}


class PrefixSource(Protocol):
    """Where the router's knowledge of the engines' KV caches comes from."""

    async def start(self) -> None:
        """Connect (and, embedded, start following the engines' events)."""

    async def stop(self) -> None:
        """Release sockets and sessions."""

    def follow(self, fleet: FleetView) -> None:
        """Keep event subscriptions equal to the fleet (embedded only: a service has its own)."""

    def has_events(self, worker: Worker) -> bool:
        """Whether the worker's KV events reach this source (else placements are estimates)."""

    async def lookup(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult:
        """Matches of the whole prompt."""

    async def probe(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult | None:
        """Matches from a head of the prompt when that decides them, else ``None``."""

    async def place(self, keys: list[int], instance: str, rank: int, ttl_s: float) -> None:
        """Record speculative entries (returns once the request may go on)."""

    async def place_prompt(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        instance: str,
        rank: int,
        ttl_s: float,
        lora: str | None = None,
    ) -> None:
        """Tokenize the whole prompt and record it as speculative entries of ``instance``."""

    async def warm(self, model: str, prompt: Prompt) -> None:
        """Tokenize the whole prompt into the caches, so later turns find it there."""

    async def occupancy(self) -> dict[str, int]:
        """Blocks each instance holds (empty when the source cannot say cheaply)."""

    def parity_monitor(
        self, fleet: FleetView, registry: CollectorRegistry, interval_s: float
    ) -> ParityMonitor | None:
        """The hash-parity self-check, where this source sees the engines' events."""

    def expose(self, registry: CollectorRegistry) -> None:
        """Serve the source's own metrics (event lag, gaps, lookups) on ``registry``."""


class EmbeddedPrefixes:
    """The KV store in the router's own process: follows the fleet, probes prompt heads."""

    def __init__(
        self,
        store: KVStore,
        clock: Callable[[], float] = time.monotonic,
        siblings: SiblingBus | None = None,
    ) -> None:
        """``siblings``: the other processes of this router, told of every placement, every
        chat message tokenized and, from the one that follows the engines' events, the
        index operations those became."""
        self.store = store
        self.clock = clock  # when the occupancy snapshot is stale (a simulator's own clock)
        self.siblings = siblings
        self._occupancy: dict[str, int] = {}
        self._occupancy_at = -1.0
        self._events_lock: ProcessLock | None = None
        self._take_over: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.siblings is not None:
            self.siblings.on(PLACE, self._on_sibling_place)
            self.siblings.on(TOKENS, self._on_sibling_tokens)
            for model, tok in [("", self.store.tokenizer), *self.store.model_tokenizers.items()]:
                tok.on_message = self._share_tokens(model)
            if self.store.index.kind == "memory":
                self._share_events(self.siblings)
        await self.store.start()

    def _share_events(self, bus: SiblingBus) -> None:
        """One process follows the engines' KV events for all (the holder of a lock of the
        bus directory) and sends the index operations they become; the others apply those
        and keep their subscribers stopped until the lock comes free (its process ended),
        then follow the events themselves, catching up from the engines' replay buffers.
        Each process re-keying every event was a large share of each one's CPU on the
        multi-turn replay."""
        self._events_lock = ProcessLock(bus.directory / "kv-events.lock")
        bus.on(OPS, self._on_sibling_ops)
        bus.on(STALE, self._on_sibling_stale)
        self.store.on_ops = lambda instance, size, ops: bus.publish(
            OPS, _pack_ops(instance, size, ops), lazy=True
        )
        self.store.on_stale = lambda instance, stale: bus.publish(
            STALE, packb((instance, stale)), lazy=True
        )
        bus.on_join = lambda: self._send_snapshot(bus)
        if not self._events_lock.acquire():
            self.store.events_from_sibling = True
            self._take_over = asyncio.get_running_loop().create_task(
                self._await_events_lock(self._events_lock), name="kv-events:take-over"
            )

    def _send_snapshot(self, bus: SiblingBus) -> None:
        """A sibling joined: what the events said so far, so that one started after them
        (a restarted process) knows what the engines hold."""
        if self.store.events_from_sibling:
            return
        for instance, block_size, ops in self.store.event_snapshot():
            bus.publish(OPS, _pack_ops(instance, block_size, ops), lazy=True)
        for instance in self.store.stale_instances():
            bus.publish(STALE, packb((instance, True)), lazy=True)

    async def _await_events_lock(self, lock: ProcessLock) -> None:
        while not lock.acquire():
            await asyncio.sleep(TAKE_OVER_S)
        await self.store.follow_events()

    async def _on_sibling_ops(self, origin: str, payload: bytes) -> None:
        await self.store.apply_shared(*_unpack_ops(payload))

    def _on_sibling_stale(self, origin: str, payload: bytes) -> None:
        instance, stale = msgpack.unpackb(payload)
        self.store.stale_from_sibling(instance, stale)

    def _share_tokens(self, model: str) -> Callable[[bytes, list[int]], None]:
        """Tell the other processes each chat message this one tokenizes: the next turn of a
        conversation comes to any of them, and finds its history cached there."""
        bus = self.siblings
        assert bus is not None

        def told(key: bytes, ids: list[int]) -> None:
            bus.publish(TOKENS, packb((model, key, ids)), lazy=True)

        return told

    def _on_sibling_tokens(self, origin: str, payload: bytes) -> None:
        model, key, ids = msgpack.unpackb(payload)
        self.store.tokenizer_for(model or None).learn(key, ids)

    async def stop(self) -> None:
        if self._take_over is not None:
            self._take_over.cancel()
            await asyncio.gather(self._take_over, return_exceptions=True)
            self._take_over = None
        await self.store.stop()
        if self._events_lock is not None:
            self._events_lock.release()

    def follow(self, fleet: FleetView) -> None:
        self.store.follow_fleet(fleet)

    def has_events(self, worker: Worker) -> bool:
        if worker.spec.kv_events:  # unless its publisher went: its entries may be out of date
            return not self.store.stale(worker.id)
        return self.store.expects_events(worker.id)  # which is False for a stale feed too

    async def lookup(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult:
        return await self.store.lookup(
            model, candidates=candidates, lora_name=lora, cache_salt=salt, **prompt
        )

    async def probe(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult | None:
        """Tokenize a long prompt only as far as some worker's match reaches, and a chat
        without a last message the router never saw (``_probe_chat``).

        Tokenizing costs CPU per token, on the request's path and on the one event loop:
        a burst of long prompts (the Mooncake trace has them) queues behind it and adds to
        everyone's TTFT. Matches are consecutive from block 0, so
        once every worker's match ends inside a head of the prompt, the rest of the
        prompt cannot change them: routing needs only its length. Heads grow fourfold
        from ``PROBE_CHARS``. The placement records the probed head; a worker without
        KV events gets the whole prompt recorded once the first byte is on its way.
        """
        store = self.store
        tok = store.tokenizer_for(model)
        messages, text_prompt = prompt.get("messages"), prompt.get("prompt")
        if messages is not None and len(messages) > 1:
            # A later turn extends its conversation's line: only what it adds is tokenized
            # and keyed, and a last message the router never saw is left out.
            plan = tok.plan_chat(messages, head=True)
            if plan is not None and plan.new_chars <= OFFLOAD_CHARS:
                return await self._probe_line(tok, plan, salt, candidates, lora)
        if messages is not None:
            # Earlier turns come from the message cache: at most a turn's new text is left.
            # A single new message is probed at its head below, whatever its length: most
            # of the Mooncake trace's prompts are one message under ``OFFLOAD_CHARS``, and
            # tokenizing them whole costs CPU for no better routing (see
            # docs/benchmarks.md, router_cpu).
            new_chars = tok.uncached_chars(messages)
            single = len(messages) == 1 and new_chars is not None and new_chars > PROBE_CHARS
            if new_chars is not None and new_chars <= OFFLOAD_CHARS and not single:
                return await self._probe_chat(tok, messages, salt, candidates, lora)
        text = tok.chat_text(messages) if messages is not None else text_prompt
        if not tok.exact or not isinstance(text, str):
            return None
        smallest = min(store.block_size_of(c) for c in candidates) if candidates else 0
        chars = PROBE_CHARS
        while True:
            head = await tok.aencode_head(text, chars, prompt=messages is None)
            if head is None or len(head) < max(smallest, 1):
                return None
            result = await store.match_tokens(head, candidates, lora, salt)
            if result.degraded:
                return None
            if not any(
                m.matched_tokens >= _full(len(head), result, m.instance) for m in result.matches
            ):
                break
            chars *= PROBE_GROWTH
        result.total_tokens = round(len(text) * len(head) / chars)
        result.exact = False
        return result

    async def _probe_line(
        self,
        tok: RoutingTokenizer,
        plan: ChatPlan,
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult | None:
        """Matches of a chat from its conversation line: the whole prompt where the line
        holds every message (exact), else without the last message (``_probe_chat``)."""
        t0 = time.perf_counter()
        prefix = await tok.aencode_plan(plan)
        self.store.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
        result = await self.store.match_prefix(prefix, candidates, lora, salt)
        if result.degraded:
            return None
        if plan.left_out:
            result.total_tokens = prefix.tokens + -(-plan.left_out // CHARS_PER_TOKEN)
            result.exact = False
        return result

    async def _probe_chat(
        self,
        tok: RoutingTokenizer,
        messages: list[dict[str, Any]],
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult | None:
        """Matches of a chat without a last message no engine can hold (one this router
        never saw): it is tokenized once the answer is on its way (``warm``), for the next
        turn. None when the whole lookup is the one to make."""
        head = await tok.aencode_chat_head(messages)
        if head is None:
            return None
        ids, left_out_chars = head
        result = await self.store.match_tokens(ids, candidates, lora, salt)
        if result.degraded:
            return None
        result.total_tokens = len(ids) + -(-left_out_chars // CHARS_PER_TOKEN)
        result.exact = False
        return result

    async def warm(self, model: str, prompt: Prompt) -> None:
        messages = prompt.get("messages")
        if messages is not None and await self.store.tokenize_chat(model, messages) is not None:
            return  # its line holds it now, with no copy of its ids made
        await self.store.tokenize(model, **prompt)

    async def place(self, keys: list[int], instance: str, rank: int, ttl_s: float) -> None:
        await self.store.record_placement(keys, instance, rank, ttl_s)
        if self.siblings is not None and keys:
            self.siblings.publish(PLACE, packb((keys, instance, rank, ttl_s)), lazy=True)

    async def place_prompt(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        instance: str,
        rank: int,
        ttl_s: float,
        lora: str | None = None,
    ) -> None:
        tokens, _ = await self.store.tokenize(model, **prompt)
        keys = self.store.keys_for(tokens, lora, salt, self.store.block_size_of(instance))
        await self.place(keys, instance, rank, ttl_s)

    async def _on_sibling_place(self, origin: str, payload: bytes) -> None:
        keys, instance, rank, ttl_s = msgpack.unpackb(payload)
        await self.store.record_placement(keys, instance, rank, ttl_s)

    async def occupancy(self) -> dict[str, int]:
        """From a snapshot at most ``OCCUPANCY_TTL_S`` old."""
        now = self.clock()
        if now - self._occupancy_at > OCCUPANCY_TTL_S:
            self._occupancy_at = now
            counts: dict[str, int] = {}
            for info in await self.store.locations():
                instance = info.location.instance
                counts[instance] = counts.get(instance, 0) + info.blocks
            self._occupancy = counts
        return self._occupancy

    def parity_monitor(
        self, fleet: FleetView, registry: CollectorRegistry, interval_s: float
    ) -> ParityMonitor | None:
        if not self.store.tokenizer.exact:
            return None
        return ParityMonitor(
            self.store, fleet, registry, interval_s=interval_s, siblings=self.siblings
        )

    def expose(self, registry: CollectorRegistry) -> None:
        registry.register(self.store.metrics.registry)


def _pack_ops(instance: str, block_size: int | None, ops: list[Op]) -> bytes:
    """Index operations of one instance as the bus carries them (msgpack)."""
    wire: list[tuple[int, int | None, str, list[int]]] = []
    for op in ops:
        if isinstance(op, Clear):
            wire.append((_CLEAR, op.dp_rank, "", []))
        else:
            loc = op.location
            wire.append((_ADD if isinstance(op, Add) else _REMOVE, loc.dp_rank, loc.tier, op.keys))
    packed: bytes = packb((instance, block_size, wire))
    return packed


def _unpack_ops(payload: bytes) -> tuple[str, int | None, list[Op]]:
    instance, block_size, wire = msgpack.unpackb(payload)
    ops: list[Op] = []
    for kind, rank, tier, keys in wire:
        if kind == _CLEAR:
            ops.append(Clear(instance, rank))
        elif kind == _ADD:
            ops.append(Add(keys, Location(instance, rank, tier)))
        else:
            ops.append(Remove(keys, Location(instance, rank, tier)))
    return instance, block_size, ops


def _full(head_tokens: int, result: LookupResult, instance: str) -> int:
    """Tokens in the full blocks of a head, in the block size of ``instance``."""
    size = result.block_size_of(instance)
    return head_tokens // size * size


class RemotePrefixes:
    """A kvstore service: it tokenizes and follows the engines itself; placements are posted
    without waiting, and it has no cheap occupancy call, so the scheduler goes without."""

    def __init__(self, store: RemoteKVStore) -> None:
        self.store = store
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.store.start()

    async def stop(self) -> None:
        await self.store.stop()

    def follow(self, fleet: FleetView) -> None:
        return None

    def has_events(self, worker: Worker) -> bool:
        return bool(worker.spec.kv_events)

    async def lookup(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult:
        return await self.store.lookup(
            model, candidates=candidates, lora_name=lora, cache_salt=salt, **prompt
        )

    async def probe(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        candidates: list[str],
        lora: str | None = None,
    ) -> LookupResult | None:
        return None

    async def warm(self, model: str, prompt: Prompt) -> None:
        """Nothing: the service tokenizes its own lookups (and ``probe`` defers none)."""

    async def place(self, keys: list[int], instance: str, rank: int, ttl_s: float) -> None:
        task = asyncio.get_running_loop().create_task(
            self.store.record_placement(keys, instance, rank, ttl_s)
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def place_prompt(
        self,
        model: str,
        prompt: Prompt,
        salt: str | None,
        instance: str,
        rank: int,
        ttl_s: float,
        lora: str | None = None,
    ) -> None:
        result = await self.lookup(model, prompt, salt, [instance], lora)
        await self.place(result.keys_for(instance), instance, rank, ttl_s)

    async def occupancy(self) -> dict[str, int]:
        return {}

    def parity_monitor(
        self, fleet: FleetView, registry: CollectorRegistry, interval_s: float
    ) -> ParityMonitor | None:
        return None

    def expose(self, registry: CollectorRegistry) -> None:
        """Nothing: the kvstore service serves its metrics on its own ``/metrics``."""


def prefix_source(
    store: KVStore | RemoteKVStore,
    clock: Callable[[], float] = time.monotonic,
    siblings: SiblingBus | None = None,
) -> PrefixSource:
    if isinstance(store, RemoteKVStore):
        return RemotePrefixes(store)
    return EmbeddedPrefixes(store, clock, siblings)


class KVAwareness:
    def __init__(
        self,
        store: KVStore | RemoteKVStore,
        fleet: FleetView,
        metrics: RouterMetrics,
        *,
        speculative_ttl_s: float,
        event_lag_ttl_s: float = 2.0,
        parity_interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        siblings: SiblingBus | None = None,
    ) -> None:
        self.source = prefix_source(store, clock, siblings)
        self.fleet = fleet
        self.speculative_ttl_s = speculative_ttl_s
        self.event_lag_ttl_s = event_lag_ttl_s
        self._pending: set[asyncio.Task[None]] = set()
        self.source.follow(fleet)
        self.source.expose(metrics.registry)
        self.parity = (
            self.source.parity_monitor(fleet, metrics.registry, parity_interval_s)
            if parity_interval_s is not None
            else None
        )
        counters = KVMetrics(metrics.registry)
        self.predicted = counters.predicted
        self.actual = counters.actual
        self.prompt = counters.prompt
        self.degraded = counters.degraded
        self.tokenize_cache = counters.tokenize_cache
        self._cache_seen: dict[tuple[int, str, str], int] = {}
        self.key_cache_hit = counters.key_cache_hit
        self.key_cache_miss = counters.key_cache_miss
        self.conversations = counters.conversations
        self.conversation_bytes = counters.conversation_bytes
        self._keys_seen = (0, 0)
        self._syncing: asyncio.Task[None] | None = None
        metrics.before_scrape.append(self.sync_counters)

    def has_events(self, worker: Worker) -> bool:
        return self.source.has_events(worker)

    def estimating(self, worker: Worker) -> bool:
        """Approximate mode for this worker: no KV events, so placements are estimated."""
        return not self.has_events(worker)

    async def start(self) -> None:
        await self.source.start()
        if self.parity is not None:
            self.parity.start()
        if METRICS_DIR_ENV in os.environ:  # the others' samples come from their metric files
            self._syncing = asyncio.get_running_loop().create_task(
                self._sync_counters_every(COUNTER_SYNC_S), name="kv:counter-sync"
            )

    async def stop(self) -> None:
        if self._syncing is not None:
            self._syncing.cancel()
            await asyncio.gather(self._syncing, return_exceptions=True)
            self._syncing = None
        if self.parity is not None:
            await self.parity.stop()
        await self.source.stop()

    async def annotate(self, ctx: Context, req: RoutedRequest, candidates: list[Worker]) -> None:
        """Fill the context with the prefix matches of the candidates."""
        data: dict[str, Any] = req.data
        prompt: Prompt = {}
        if req.route == CHAT:
            prompt["messages"] = data["messages"]
        elif req.route == COMPLETIONS:
            text = data["prompt"]
            if isinstance(text, list) and text and not isinstance(text[0], int):
                text = text[0]
            prompt["prompt"] = text
        elif req.messages is not None:  # Messages, Responses: the chat the engine renders
            prompt["messages"] = req.messages
        else:
            return
        salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
        ids = [w.id for w in candidates]
        # An adapter's blocks are keyed with its name (as the engine hashes them), and its
        # prompt tokenized as its base model's.
        lora = ctx.lora_name
        model = (self.fleet.parent_of(lora) or req.model) if lora else req.model
        result = await self.source.probe(model, prompt, salt, ids, lora)
        if result is not None:
            if not result.exact:  # the rest is tokenized once the answer is on its way
                ctx.deferred_keys = (model, prompt, salt, lora)
        else:
            result = await self.source.lookup(model, prompt, salt, ids, lora)
            if result.degraded:
                self.degraded.inc()
        ctx.set_prefix(result)
        ctx.cached_blocks = await self.source.occupancy()

    def sync_counters(self) -> None:
        """Move the tokenizer and block-key cache counters by what those caches counted
        since the last sync: run before each /metrics, and every ``COUNTER_SYNC_S`` under
        ``--processes``, not on every request: ``cache_stats`` builds its dicts each
        time, a visible cost on the fixed backend."""
        if not isinstance(self.source, EmbeddedPrefixes):
            return
        store = self.source.store
        lines = held = 0
        for tok in (store.tokenizer, *store.model_tokenizers.values()):
            self._count_cache(tok)
            lines += len(tok.conversations)
            held += tok.conversations.bytes
        self._count_keys(store.key_cache)
        self.conversations.set(lines)
        self.conversation_bytes.set(held)

    async def _sync_counters_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.sync_counters()

    def _count_cache(self, tok: RoutingTokenizer) -> None:
        """Move the cache counters by what the tokenizer counted since the last sync."""
        seen = self._cache_seen
        for kind, (hits, misses) in tok.cache_stats["by_kind"].items():
            for outcome, total in (("hit", hits), ("miss", misses)):
                key = (id(tok), kind, outcome)
                delta = total - seen.get(key, 0)
                if delta:
                    seen[key] = total
                    self.tokenize_cache.labels(kind, outcome).inc(delta)

    def _count_keys(self, cache: KeyCache) -> None:
        """Move the block-key cache counters by what it counted since the last sync."""
        hits, misses = self._keys_seen
        if cache.hits != hits:
            self.key_cache_hit.inc(cache.hits - hits)
        if cache.misses != misses:
            self.key_cache_miss.inc(cache.misses - misses)
        self._keys_seen = (cache.hits, cache.misses)

    async def occupancy(self) -> dict[str, int]:
        return await self.source.occupancy()

    async def placed(self, ctx: Context, worker: Worker, rank: int | None) -> None:
        """Record where the prompt is going, as a speculative entry.

        Without events this is all the router knows (approximate mode, long TTL). With
        events it bridges the moments until the engine's BlockStored arrives: a burst of
        requests sharing a new prefix follows the first one instead of scattering
        (events confirm the entry, or it expires after ``event_lag_ttl_s``). There only
        the blocks past what the lookup found at the worker are recorded: the rest is
        held there, or on its way with an earlier request whose events confirm it. On a
        multi-turn chat that is most of a prompt, recorded in each process, and recording
        it whole was a large share of each process's CPU under ``bench.kv_throughput``.
        Estimated entries are all recorded again, which renews
        their TTL.
        """
        if ctx.prefix is None:
            return
        if self.estimating(worker):
            ttl = self.speculative_ttl_s
            keys = ctx.prefix.keys_for(worker.id)
        else:
            ttl = self.event_lag_ttl_s
            keys = ctx.prefix.unheld_keys(worker.id, rank or 0)
        if keys:
            await self.source.place(keys, worker.id, rank or 0, ttl)

    def answered(self, ctx: Context, worker: Worker, rank: int | None) -> None:
        """The worker answered: pay the tokenization the probe skipped, where needed.

        Spawned once the first byte is on its way (any earlier, it would hold the event
        loop while the request or its first token waits). Without KV events the placement
        is all the router will know, so the whole prompt is recorded. With them the probed
        head bridges the moments until the engine's own events arrive; a conversation is
        still tokenized whole, so that its next turn finds every earlier message cached (a
        single message is not: a later request holding it would hold it with more).
        """
        deferred, ctx.deferred_keys = ctx.deferred_keys, None
        if deferred is None:
            return
        model, prompt, salt, lora = deferred
        if self.estimating(worker):
            self._spawn(
                self.source.place_prompt(
                    model, prompt, salt, worker.id, rank or 0, self.speculative_ttl_s, lora
                )
            )
        elif len(prompt.get("messages") or ()) > 1:
            self._spawn(self.source.warm(model, prompt))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def observe_usage(self, ctx: Context, worker_id: str, usage: Usage) -> None:
        prompt, cached = usage.prompt, usage.cached
        self.prompt.inc(prompt)
        self.actual.inc(cached)
        matched = ctx.matched.get(worker_id, 0.0)
        self.predicted.inc(matched if matched < prompt else prompt)
