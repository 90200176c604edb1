"""The KV store the router holds: tokenize, key, look up; ingest engine events.

Backend failures never reach the caller of ``lookup``: when the backend (Redis) is
unreachable or slower than ``lookup_timeout_s``, the answer is "no information"
(``degraded=True``, no matches), so routing goes on without cache affinity. A
background probe notices when the backend is back; nothing needs a restart.

Length (about 630 lines): ``KVStore`` is the one facade the router and the kvstore service
hold, and it owns three lifecycles that share its index and per-instance block sizes:
lookups and placements, event feeds (subscribe, listen, follow a fleet, replay after a gap)
and backend health. The feed half is the natural next module to split out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from switchyard.kvstore.conversation import ChatPrefix
from switchyard.kvstore.events import EventBatch, EventDecodeError, decode_batch, decode_batch_obj
from switchyard.kvstore.feed import Feed, FeedInfo, Verdict
from switchyard.kvstore.index import (
    Add,
    Clear,
    KVIndex,
    Location,
    LocationInfo,
    Match,
    Op,
    rank_matches,
)
from switchyard.kvstore.ingest import Ingestor
from switchyard.kvstore.keys import KEY_CACHE_BYTES, KeyCache, key_extra
from switchyard.kvstore.listener import Listener, TopicMap
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.metrics import KVStoreMetrics
from switchyard.kvstore.registry import FleetFollower, StaticWorker
from switchyard.kvstore.subscriber import Subscriber, request_replay
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.net.zmqrecv import ZmqContext
from switchyard.net.zmtp import FrameTooLarge, PeerSilent, ZmtpError, ZmtpOptions

log = logging.getLogger("switchyard.kvstore")

T = TypeVar("T")

DEFAULT_SPECULATIVE_TTL_S = 30.0
# A catch-up replay (up to vLLM's 10,000 buffered batches) lets the event loop run between
# this many batches, so a router starting in front of busy engines answers meanwhile.
CATCH_UP_BATCHES_PER_YIELD = 64


@dataclass
class LookupResult:
    """Matches of one prompt; ``keys`` are its block keys at ``block_size``.

    Engines of one fleet may use different block sizes: ``sized_keys`` holds the keys
    at every size a candidate uses and ``instance_block_sizes`` the candidates whose
    size is not ``block_size``, so a placement is recorded in the worker's own keys.
    """

    block_size: int
    total_tokens: int
    keys: list[int]
    matches: list[Match]
    degraded: bool = False
    exact: bool = True  # False when the tokens came from the approximate character mode
    sized_keys: dict[int, list[int]] = field(default_factory=dict)
    instance_block_sizes: dict[str, int] = field(default_factory=dict)

    def block_size_of(self, instance: str) -> int:
        return self.instance_block_sizes.get(instance, self.block_size)

    def keys_for(self, instance: str) -> list[int]:
        """The prompt's block keys in the block size of ``instance``."""
        size = self.instance_block_sizes.get(instance)
        if size is None or size == self.block_size:
            return self.keys
        return self.sized_keys.get(size, [])

    def unheld_keys(self, instance: str, dp_rank: int) -> list[int]:
        """The keys of ``instance`` past the prefix this lookup found in its rank's GPU
        memory: what a request sent there adds to what the index says it holds."""
        held = max(
            (
                m.matched_tokens
                for m in self.matches
                if m.instance == instance and m.dp_rank == dp_rank and m.tier == "gpu"
            ),
            default=0,
        )
        return self.keys_for(instance)[held // self.block_size_of(instance) :]


class KVStore:
    """Tokenization, block keys, one index backend and the event feeds, behind one API.

    ``block_size`` is the default: each instance's own size is learned from its events
    (``block_size_of``), and its blocks are keyed in that size. Lookups in approximate
    tokenizer mode cannot match engine events (those carry real token ids); they match
    the router's own ``record_placement`` entries.
    """

    def __init__(
        self,
        index: KVIndex | None = None,
        *,
        block_size: int,
        seed: int = 0,
        tokenizer: RoutingTokenizer | None = None,
        model_tokenizers: dict[str, RoutingTokenizer] | None = None,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        lookup_timeout_s: float = 0.02,
        update_timeout_s: float = 1.0,
        probe_interval_s: float = 0.25,
        replay_timeout_s: float = 1.0,
        metrics: KVStoreMetrics | None = None,
        key_cache_bytes: int = KEY_CACHE_BYTES,
        zmtp: ZmtpOptions | None = None,
    ) -> None:
        """``zmtp``: frame cap and heartbeats of the subscriptions to engines' publishers."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.index: KVIndex = index if index is not None else MemoryIndex()
        self.block_size = block_size
        # Block sizes learned from the instances' events (instance -> tokens per block).
        self.instance_block_sizes: dict[str, int] = {}
        self.seed = seed
        self.tokenizer = tokenizer or RoutingTokenizer.approximate()
        self.model_tokenizers = dict(model_tokenizers or {})
        self.speculative_ttl_s = speculative_ttl_s
        self.lookup_timeout_s = lookup_timeout_s
        self.update_timeout_s = update_timeout_s
        self.probe_interval_s = probe_interval_s
        self.replay_timeout_s = replay_timeout_s
        self.metrics = metrics or KVStoreMetrics()
        self.zmtp = zmtp or ZmtpOptions()
        # Block keys of prompts seen before: turn k+1 of a chat keys only its new blocks.
        self.key_cache = KeyCache(key_cache_bytes)
        self.degraded = False
        self._ctx: ZmqContext | None = None
        self._subscribers: dict[str, Subscriber] = {}
        self._http_feeds: dict[str, Feed] = {}
        # Engines that connect to us (--kv-listen): one feed per topic.
        self.topics = TopicMap()
        self._listener: Listener | None = None
        self._topic_feeds: dict[bytes, Feed] = {}
        self._unresolved: set[bytes] = set()
        self.follower: FleetFollower | None = None
        self._probe: asyncio.Task[None] | None = None
        self._started = False
        self._timeouts_in_row = 0
        # Another process of the router follows the engines' events and shares the index
        # operations they become (``apply_shared``): this one's subscribers stay stopped.
        self.events_from_sibling = False
        # Told of the operations each applied event batch (or a feed's clear) became.
        self.on_ops: Callable[[str, int | None, list[Op]], None] | None = None
        # Told when an instance's feeds go stale or resync, so processes that take the
        # index operations from this one also stop trusting that instance's entries.
        self.on_stale: Callable[[str, bool], None] | None = None
        self._stale_from_sibling: set[str] = set()
        # Instances with a stale feed here or in the sibling, kept at each change: ``stale``
        # is asked for every candidate of every request.
        self._stale: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self._ctx is None:
            self._ctx = ZmqContext()
        if not self.events_from_sibling:
            for sub in self._subscribers.values():
                sub.start()
        if self._listener is not None:
            self._listener.start()
            await self._listener.bound()
        if self.follower is not None:
            self.follower.start()
        if self.index.kind != "memory":
            try:
                await asyncio.wait_for(self.index.ping(), self.update_timeout_s)
            except Exception as exc:
                self._mark_down(exc)

    async def stop(self) -> None:
        for sub in self._subscribers.values():
            await sub.stop()
        if self._listener is not None:
            await self._listener.stop()
        if self.follower is not None:
            await self.follower.stop()
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        await self.index.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        for tok in (self.tokenizer, *self.model_tokenizers.values()):
            await tok.aclose()  # its thread pool and engine client; a second is a no-op
        self._started = False

    # -- lookups ---------------------------------------------------------------------------

    def tokenizer_for(self, model: str | None) -> RoutingTokenizer:
        if model is not None and model in self.model_tokenizers:
            return self.model_tokenizers[model]
        return self.tokenizer

    async def tokenize(
        self,
        model: str | None,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
    ) -> tuple[list[int], bool]:
        """Token ids of a request and whether they are exact."""
        if token_ids is not None:
            return list(token_ids), True
        tok = self.tokenizer_for(model)
        t0 = time.perf_counter()
        if messages is not None:
            ids = await tok.aencode_chat(messages)
        elif prompt is not None:
            ids = await tok.aencode_prompt(prompt)
        else:
            raise ValueError("one of prompt, messages or token_ids is required")
        self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
        return ids, tok.exact or isinstance(prompt, list)

    def block_size_of(self, instance: str) -> int:
        """The instance's block size: learned from its events, else the default."""
        return self.instance_block_sizes.get(instance, self.block_size)

    def keys_for(
        self,
        token_ids: list[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        block_size: int | None = None,
    ) -> list[int]:
        size = block_size or self.block_size
        return self.key_cache.block_keys(
            token_ids, size, self.seed, key_extra(lora_name, cache_salt)
        )

    async def lookup(
        self,
        model: str | None,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
        candidates: list[str] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LookupResult:
        if messages is not None and token_ids is None:
            prefix = await self.tokenize_chat(model, messages)
            if prefix is not None:
                return await self.match_prefix(prefix, candidates, lora_name, cache_salt)
        tokens, exact = await self.tokenize(
            model, prompt=prompt, messages=messages, token_ids=token_ids
        )
        return await self.match_tokens(tokens, candidates, lora_name, cache_salt, exact=exact)

    async def tokenize_chat(
        self, model: str | None, messages: list[dict[str, Any]], *, head: bool = False
    ) -> ChatPrefix | None:
        """A chat as the conversation line it extends (``kvstore.conversation``), or None
        where its tokenizer cannot; ``head``: as ``RoutingTokenizer.plan_chat``."""
        tok = self.tokenizer_for(model)
        plan = tok.plan_chat(messages, head=head)
        if plan is None:
            return None
        t0 = time.perf_counter()
        prefix = await tok.aencode_plan(plan)
        self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
        return prefix

    async def match_prefix(
        self,
        prefix: ChatPrefix,
        candidates: list[str] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LookupResult:
        """``match_tokens`` of a chat's prefix, its keys from its conversation line."""
        extra = key_extra(lora_name, cache_salt)
        return await self._match(
            prefix.tokens, lambda size: prefix.keys(size, self.seed, extra), candidates, True
        )

    def _size_groups(self, candidates: list[str] | None) -> dict[int, list[str] | None]:
        """Candidates by block size; ``None`` (everyone) is looked up at every known size."""
        sizes = self.instance_block_sizes
        if candidates is None:
            return {b: None for b in {self.block_size, *sizes.values()}}
        groups: dict[int, list[str] | None] = {}
        for c in candidates:
            group = groups.setdefault(sizes.get(c, self.block_size), [])
            assert group is not None
            group.append(c)
        return groups or {self.block_size: []}

    async def match_tokens(
        self,
        tokens: list[int],
        candidates: list[str] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        *,
        exact: bool = True,
    ) -> LookupResult:
        """Matches of a tokenized prompt, each instance keyed in its own block size."""
        extra = key_extra(lora_name, cache_salt)
        return await self._match(
            len(tokens),
            lambda size: self.key_cache.block_keys(tokens, size, self.seed, extra),
            candidates,
            exact,
        )

    async def _match(
        self,
        total_tokens: int,
        keys_at: Callable[[int], list[int]],
        candidates: list[str] | None,
        exact: bool,
    ) -> LookupResult:
        """Matches of a prompt of ``total_tokens`` whose block keys at a size ``keys_at``
        gives, each instance keyed in its own block size."""
        groups = self._size_groups(candidates)
        sized = {b: keys_at(b) for b in groups}
        primary = next(iter(groups)) if len(groups) == 1 else self.block_size
        if primary not in sized:
            primary = max(groups, key=lambda b: len(groups[b] or ()))
        result = LookupResult(primary, total_tokens, sized[primary], [], exact=exact)
        if len(groups) > 1:
            result.sized_keys = sized
            result.instance_block_sizes = dict(self.instance_block_sizes)
        if not any(sized.values()):
            self.metrics.child(self.metrics.lookups, "empty").inc()
            return result
        for size, members in groups.items():
            if not sized[size]:
                continue
            found, degraded = await self.lookup_keys(sized[size], members, size)
            if members is None and len(groups) > 1:
                found = [m for m in found if self.block_size_of(m.instance) == size]
            result.matches.extend(found)
            result.degraded = result.degraded or degraded
        if len(groups) > 1:
            result.matches = rank_matches(result.matches)
        return result

    async def lookup_keys(
        self, keys: list[int], candidates: list[str] | None = None, block_size: int | None = None
    ) -> tuple[list[Match], bool]:
        """Matches for precomputed keys of ``block_size`` blocks, and whether degraded."""
        size = block_size or self.block_size
        m = self.metrics
        if self.degraded:
            m.child(m.lookups, "degraded").inc()
            return [], True
        t0 = time.perf_counter()
        try:
            if self.index.kind == "memory":
                matches = await self.index.lookup(keys, candidates, block_size=size)
            else:
                matches = await asyncio.wait_for(
                    self.index.lookup(keys, candidates, block_size=size), self.lookup_timeout_s
                )
        except TimeoutError:
            m.child(m.lookups, "timeout").inc()
            m.backend_errors.labels("lookup").inc()
            self._timeouts_in_row += 1
            if self._timeouts_in_row >= 3:
                self._mark_down(TimeoutError(f"3 lookups over {self.lookup_timeout_s * 1e3:g} ms"))
            return [], True
        except Exception as exc:
            m.child(m.lookups, "error").inc()
            m.backend_errors.labels("lookup").inc()
            self._mark_down(exc)
            return [], True
        self._timeouts_in_row = 0
        m.lookup_seconds.observe(time.perf_counter() - t0)
        m.child(m.lookups, "ok").inc()
        return matches, False

    # -- updates ---------------------------------------------------------------------------

    async def _guard(self, op: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """Run a backend update unless degraded; failures are counted, never raised."""
        if self.degraded:
            self.metrics.backend_errors.labels(op).inc()
            return None
        try:
            if self.index.kind == "memory":
                return await call()
            return await asyncio.wait_for(call(), self.update_timeout_s)
        except Exception as exc:
            self.metrics.backend_errors.labels(op).inc()
            self._mark_down(exc)
            return None

    async def record_placement(
        self,
        keys: list[int],
        instance: str,
        dp_rank: int = 0,
        ttl_s: float | None = None,
    ) -> None:
        """Speculative entries: where the router sent a request, until ``ttl_s`` passes."""
        ttl = self.speculative_ttl_s if ttl_s is None else ttl_s
        loc = Location(instance, dp_rank, "gpu")
        await self._guard("record_placement", lambda: self.index.add(keys, loc, ttl))

    async def clear_instance(self, instance: str, dp_rank: int | None = None) -> None:
        await self._guard("clear", lambda: self.index.clear(instance, dp_rank))
        self.metrics.clears.labels(instance, "api").inc()

    async def locations(self) -> list[LocationInfo]:
        return await self._guard("locations", self.index.locations) or []

    async def index_size(self) -> int:
        size = await self._guard("size", self.index.size) or 0
        self.metrics.index_blocks.set(size)
        return size

    def _all_feeds(self) -> list[Feed]:
        return [
            *(s.feed for s in self._subscribers.values()),
            *self._topic_feeds.values(),
            *self._http_feeds.values(),
        ]

    def feeds(self) -> list[FeedInfo]:
        return [f.info() for f in self._all_feeds()]

    def expects_events(self, instance: str) -> bool:
        """Whether events of ``instance`` are followed: subscribed, mapped to a topic of the
        ``--kv-listen`` socket, or already arriving; and none of its feeds is stale (its
        publisher's connection lost and not yet resynced), when its entries may be out of
        date and placements are the better guess."""
        if instance in self._stale:
            return False
        follower = self.follower
        if follower is not None and instance in follower.endpoints:
            return True
        # Each collection looked at only when it holds something: this runs for every
        # placement, and a router without events has none.
        by_topic = self.topics.by_topic
        if by_topic and any(src.instance == instance for src in by_topic.values()):
            return True
        if instance in self._http_feeds:
            return True
        if self._topic_feeds and any(f.instance == instance for f in self._topic_feeds.values()):
            return True
        return bool(self._subscribers) and any(
            s.feed.instance == instance for s in self._subscribers.values()
        )

    def stale(self, instance: str) -> bool:
        """Whether a feed of ``instance`` lost its publisher and has not resynced yet (here,
        or in the sibling process that follows the events for this one)."""
        return instance in self._stale

    def stale_from_sibling(self, instance: str, stale: bool) -> None:
        """The sibling process that follows the events found ``instance``'s feed stale, or
        resynced."""
        if stale:
            self._stale_from_sibling.add(instance)
        else:
            self._stale_from_sibling.discard(instance)
        self._show_stale(instance)

    def stale_instances(self) -> list[str]:
        """Every instance with a stale feed (for a sibling process that starts late)."""
        feeds = {s.feed.instance for s in self._subscribers.values() if s.feed.stale}
        return sorted(feeds | self._stale_from_sibling)

    def _subscribers_of(self, instance: str) -> list[Feed]:
        return [s.feed for s in self._subscribers.values() if s.feed.instance == instance]

    def feeds_of(self, instance: str) -> list[Feed]:
        """The event feeds of one instance (one per DP rank publisher)."""
        return [f for f in self._all_feeds() if f.instance == instance]

    # -- event ingestion -------------------------------------------------------------------

    def _ingestor(self, instance: str, dp_rank: int) -> Ingestor:
        return Ingestor(instance, self.seed, default_rank=dp_rank)

    def subscribe(
        self,
        instance: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        flavor: str = "vllm",
        dp_rank: int = 0,
    ) -> None:
        """Follow an engine's ZMQ publisher (vLLM or SGLang: the envelope is the same).

        ``dp_rank`` is used only for batches that do not carry ``data_parallel_rank``.
        """
        if flavor not in ("vllm", "sglang"):
            raise ValueError(f"unknown event flavor {flavor!r}")
        if endpoint in self._subscribers:
            return
        if self._ctx is None:
            self._ctx = ZmqContext()
        feed = Feed(self._ingestor(instance, dp_rank), flavor, endpoint, replay_endpoint)
        sub = Subscriber(
            self._ctx,
            feed,
            self._on_frame,
            self._catch_up,
            self.take_frame,
            self.zmtp,
            self._feed_lost,
            self._feed_resynced,
        )
        self._subscribers[endpoint] = sub
        self._show_stale(instance)
        if self._started and not self.events_from_sibling:
            sub.start()

    def _fleet_follower(self) -> FleetFollower:
        if self.follower is None:
            self.follower = FleetFollower(self)
            if self._started:
                self.follower.start()
        return self.follower

    def follow_fleet(self, fleet: Any) -> FleetFollower:
        """Follow what a worker registry announces (``subscribe(callback)``, ``workers()``)."""
        follower = self._fleet_follower()
        fleet.subscribe(follower)
        for worker in fleet.workers():
            follower("added", worker)
        return follower

    def follow_workers(self, urls: list[str]) -> FleetFollower:
        """Follow workers known only by URL: their ``/kv_event_sources`` name the publishers."""
        follower = self._fleet_follower()
        for url in urls:
            follower("added", StaticWorker(url.rstrip("/")))
        return follower

    def listen(self, endpoint: str) -> None:
        """Bind one SUB socket that engines connect to (their topic names them)."""
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--kv-listen wants tcp://HOST:PORT, not {endpoint!r}")
        if self._listener is not None:
            raise ValueError("one --kv-listen endpoint per store")
        if self._ctx is None:
            self._ctx = ZmqContext()
        self._listener = Listener(self._ctx, endpoint, self._on_topic_frame)

    @property
    def listen_endpoint(self) -> str | None:
        return self._listener.endpoint if self._listener is not None else None

    async def _on_topic_frame(self, topic: bytes, seq: int, payload: bytes) -> None:
        feed = self._topic_feeds.get(topic)
        if feed is None:
            name = topic.decode(errors="replace")
            source = self.topics.resolve(name)
            if source is None:
                if topic not in self._unresolved:
                    self._unresolved.add(topic)
                    log.warning(
                        "KV events on topic %r name no known worker; dropped until a worker's "
                        "/kv_event_sources lists the topic or its host matches one worker",
                        name,
                    )
                self.metrics.decode_errors.inc()
                return
            self._unresolved.discard(topic)
            feed = Feed(
                self._ingestor(source.instance, source.dp_rank),
                "listen",
                self._listener.endpoint if self._listener else None,
                source.replay_endpoint,
            )
            self._topic_feeds[topic] = feed
            log.info("KV events on topic %r: instance %s", name, source.instance)
        await self._on_frame(feed, seq, payload)

    async def unsubscribe(self, endpoint: str) -> None:
        sub = self._subscribers.pop(endpoint, None)
        if sub is not None:
            await sub.stop()
            self._show_stale(sub.feed.instance)

    def _feed_lost(self, feed: Feed, reason: BaseException | None) -> None:
        """The publisher's connection went (or never came): the feed is stale until a frame
        of a new connection has been handled."""
        if isinstance(reason, FrameTooLarge):
            kind = "frame_too_large"
        elif isinstance(reason, PeerSilent):
            kind = "silent"
        elif isinstance(reason, ZmtpError):
            kind = "protocol"
        else:
            kind = "lost"
        self.metrics.child(self.metrics.feed_disconnects, feed.instance, kind).inc()
        if feed.stale:
            return
        feed.stale = True
        feed.stale_since = time.monotonic()
        self._show_stale(feed.instance)
        log.warning(
            "%s: KV events from %s stopped (%s%s); its cache is estimated from placements "
            "until the feed resyncs",
            feed.instance,
            feed.endpoint,
            kind,
            f": {reason}" if reason is not None and str(reason) else "",
        )

    def _feed_resynced(self, feed: Feed) -> None:
        since = feed.stale_since
        feed.stale = False
        feed.stale_since = None
        self._show_stale(feed.instance)
        log.warning(
            "%s: KV events from %s resynced after %.1f s",
            feed.instance,
            feed.endpoint,
            time.monotonic() - since if since is not None else 0.0,
        )

    def _show_stale(self, instance: str) -> None:
        stale = instance in self._stale_from_sibling or any(
            f.stale for f in self._subscribers_of(instance)
        )
        if stale:
            self._stale.add(instance)
        else:
            self._stale.discard(instance)
        m = self.metrics
        m.child(m.feed_stale, instance).set(1 if stale else 0)
        if self.on_stale is not None and not self.events_from_sibling:
            self.on_stale(instance, stale)

    async def _on_frame(self, feed: Feed, seq: int, payload: bytes) -> None:
        verdict = feed.classify(seq)
        if verdict is Verdict.DUPLICATE:
            return
        if verdict is Verdict.RESTART:
            log.warning("%s: publisher restarted (seq %s -> %d)", feed.instance, feed.last_seq, seq)
            await self._clear_feed(feed, "restart")
            feed.ingestor.forget()
            feed.dup_floor = None
        elif verdict is Verdict.GAP:
            await self._handle_gap(feed, seq)
            if feed.last_seq is not None and seq <= feed.last_seq:
                return
        try:
            batch = decode_batch(payload)
        except EventDecodeError:
            self.metrics.decode_errors.inc()
            feed.last_seq = seq
            raise
        await self._apply(feed, batch)
        feed.last_seq = seq

    async def _catch_up(self, feed: Feed) -> None:
        """Learn what the publisher buffered before this subscription: run right after every
        new one, before its first live frame.

        A subscriber that starts after the engine (a router process started after its
        siblings, a router restarted in front of running engines, a worker added) otherwise
        knows none of the blocks announced before it, and one that comes back after an
        outage none of those announced meanwhile: a batch that went out while no
        subscription was in place reached no one, and with no later batch no gap shows it.
        The publisher's replay socket still buffers its recent batches (vLLM keeps 10,000
        steps by default). A first subscription asks from sequence 0; a later one from the
        last batch it applied, whose echo tells the same publisher (the rest follows on) from
        a restarted one (forgotten, then replayed from 0) and from a buffer that moved past
        it (a gap: cleared). Live frames the replay already covered are then duplicates.
        """
        if feed.replay_endpoint is None or self._ctx is None:
            return
        last = feed.last_seq
        feed.catching_up = True
        try:
            start = 0 if last is None else last
            got = await request_replay(
                self._ctx, feed.replay_endpoint, start, self.replay_timeout_s
            )
            if got is None or feed.last_seq != last:
                return  # unanswered: a gap still shows at the next live frame
            if last is not None:
                if got and got[0][0] == last and self._same_batch(feed, got[0][1]):
                    got = got[1:]
                elif got and got[0][0] > last:
                    feed.gaps += 1
                    self.metrics.gaps.labels(feed.instance).inc()
                    log.warning("%s: sequence gap %d..%d", feed.instance, last + 1, got[0][0] - 1)
                    await self._clear_feed(feed, "gap")
                else:
                    log.warning("%s: publisher restarted while unsubscribed", feed.instance)
                    await self._clear_feed(feed, "restart")
                    feed.ingestor.forget()
                    feed.dup_floor = None
                    feed.last_seq = last = None
                    got = await request_replay(
                        self._ctx, feed.replay_endpoint, 0, self.replay_timeout_s
                    )
                    if got is None:
                        return
            for n, (rseq, payload) in enumerate(got, 1):
                try:
                    await self._apply(feed, decode_batch(payload))
                except EventDecodeError:
                    self.metrics.decode_errors.inc()
                feed.last_seq = rseq
                if n % CATCH_UP_BATCHES_PER_YIELD == 0:
                    await asyncio.sleep(0)  # requests go on being served meanwhile
            if got:
                feed.dup_floor = got[0][0] - 1
                log.info("%s: caught up on %d buffered event batches", feed.instance, len(got))
            if feed.stale:  # everything published up to the subscription is known
                self._feed_resynced(feed)
        finally:
            feed.catching_up = False

    @staticmethod
    def _same_batch(feed: Feed, payload: bytes) -> bool:
        """Whether a replayed batch is the one this feed applied last (same timestamp): a
        restarted publisher numbers its batches from 0 again."""
        if feed.last_ts is None:
            return True
        try:
            return decode_batch(payload).ts == feed.last_ts
        except EventDecodeError:
            return False

    def catching_up(self, instance: str) -> bool:
        """Whether a feed of ``instance`` is still replaying what it missed before joining."""
        return any(feed.catching_up for feed in self.feeds_of(instance))

    async def _handle_gap(self, feed: Feed, seq: int) -> None:
        assert feed.last_seq is not None
        start = feed.last_seq + 1
        feed.gaps += 1
        self.metrics.gaps.labels(feed.instance).inc()
        log.warning("%s: sequence gap %d..%d", feed.instance, start, seq - 1)
        if feed.replay_endpoint is not None and self._ctx is not None:
            feed.replays += 1
            got = await request_replay(
                self._ctx, feed.replay_endpoint, start, self.replay_timeout_s
            )
            if got and got[0][0] == start:
                self.metrics.replays.labels(feed.instance, "ok").inc()
                feed.dup_floor = feed.last_seq
                for rseq, payload in got:
                    if rseq > feed.last_seq:
                        try:
                            await self._apply(feed, decode_batch(payload))
                        except EventDecodeError:
                            self.metrics.decode_errors.inc()
                        feed.last_seq = rseq
                return
            self.metrics.replays.labels(feed.instance, "failed").inc()
        await self._clear_feed(feed, "gap")

    async def _clear_feed(self, feed: Feed, reason: str) -> None:
        """Forget what this publisher told us (its index entries); its hash map stays valid."""
        ranks: list[int | None] = [*sorted(feed.ingestor.ranks_seen)] or [None]
        for rank in ranks:
            await self._guard("clear", partial(self.index.clear, feed.instance, rank))
        self.metrics.clears.labels(feed.instance, reason).inc()
        if self.on_ops is not None:
            self.on_ops(feed.instance, None, [Clear(feed.instance, rank) for rank in ranks])

    async def follow_events(self) -> None:
        """Follow the engines' events here from now on (the sibling that did is gone).

        A subscriber that starts catches up from the publisher's replay buffer where it
        has one, as a process that starts after its engines does.
        """
        if not self.events_from_sibling:
            return
        self.events_from_sibling = False
        cleared, self._stale_from_sibling = self._stale_from_sibling, set()
        for instance in cleared:  # this process's own feeds say it from now on
            self._show_stale(instance)
        if self._started:
            for sub in self._subscribers.values():
                sub.start()

    def event_snapshot(self) -> list[tuple[str, int | None, list[Op]]]:
        """Per feed: its instance, block size and the operations that rewrite its entries
        from what its events said (for a sibling process that starts after them)."""
        return [
            (f.instance, f.ingestor.block_size, f.ingestor.snapshot()) for f in self._all_feeds()
        ]

    async def apply_shared(self, instance: str, block_size: int | None, ops: list[Op]) -> None:
        """Index operations a sibling process made of ``instance``'s events. Added blocks
        count as stored here too, as when each process followed the events itself."""
        if block_size is not None and self.instance_block_sizes.get(instance) != block_size:
            self.instance_block_sizes[instance] = block_size
        await self._guard("apply", lambda: self.index.apply(ops))
        self.metrics.blocks_stored.inc(sum(len(op.keys) for op in ops if isinstance(op, Add)))

    def take_frame(self, feed: Feed, seq: int, payload: bytes) -> bool:
        """Apply a live frame on the caller's stack when nothing in it can suspend: the
        next of its feed, to a memory index, with no rewrite of the feed under way. False
        leaves it to ``_on_frame`` (gaps, restarts, duplicates, undecodable frames, Redis)."""
        index = self.index
        last = feed.last_seq
        if not isinstance(index, MemoryIndex) or last is None or seq != last + 1:
            return False
        if self.degraded or feed.catching_up or feed.lock.locked():
            return False
        try:
            batch = decode_batch(payload)
        except EventDecodeError:
            return False
        ops, before = self._ops(feed, batch)
        if ops:
            index.apply_sync(ops)
        self._applied(feed, ops, before)
        feed.last_seq = seq
        return True

    async def _apply(self, feed: Feed, batch: EventBatch) -> None:
        async with feed.lock:
            ops, before = self._ops(feed, batch)
            if ops:
                await self._guard("apply", lambda: self.index.apply(ops))
        self._applied(feed, ops, before)

    def _ops(self, feed: Feed, batch: EventBatch) -> tuple[list[Op], tuple[int, int, int]]:
        """The batch's index operations, and the feed's block counts before them."""
        st = feed.ingestor.stats
        before = (st.blocks_stored, st.blocks_removed, st.orphan_blocks)
        m = self.metrics
        m.child(m.event_batches, feed.instance).inc()
        m.events.inc(len(batch.events))
        if batch.ts:
            feed.last_ts = batch.ts
            m.child(m.lag, feed.instance).set(max(0.0, time.time() - batch.ts))
        return feed.ingestor.ops(batch), before

    def _applied(self, feed: Feed, ops: list[Op], before: tuple[int, int, int]) -> None:
        self._learn_block_size(feed)
        if ops and self.on_ops is not None:
            self.on_ops(feed.instance, feed.ingestor.block_size, ops)
        st, m = feed.ingestor.stats, self.metrics
        for counter, now, then in (
            (m.blocks_stored, st.blocks_stored, before[0]),
            (m.blocks_removed, st.blocks_removed, before[1]),
            (m.orphan_blocks, st.orphan_blocks, before[2]),
        ):
            if now != then:
                counter.inc(now - then)

    def _learn_block_size(self, feed: Feed) -> None:
        size = feed.ingestor.block_size
        instance = feed.instance
        if size is None or self.instance_block_sizes.get(instance) == size:
            return
        known = self.instance_block_sizes.get(instance)
        if known is not None:
            log.warning("%s: block size %d -> %d (from its events)", instance, known, size)
        self.instance_block_sizes[instance] = size

    async def ingest(
        self,
        instance: str,
        batch: bytes | dict[str, Any] | list[Any] | EventBatch,
        seq: int | None = None,
        dp_rank: int = 0,
    ) -> None:
        """Events pushed over HTTP (``POST /v1/events``): same payload, same semantics.

        Without a replay channel a gap clears the instance; without ``seq`` no gap
        can be seen, so every batch is applied as it comes.
        """
        feed = self._http_feeds.get(instance)
        if feed is None:
            feed = self._http_feeds[instance] = Feed(self._ingestor(instance, dp_rank), "http")
        if isinstance(batch, bytes):
            decoded = decode_batch(batch)
        elif isinstance(batch, EventBatch):
            decoded = batch
        else:
            decoded = decode_batch_obj(batch)
        if seq is not None:
            verdict = feed.classify(seq)
            if verdict is Verdict.DUPLICATE:
                return
            if verdict is Verdict.GAP:
                feed.gaps += 1
                self.metrics.gaps.labels(instance).inc()
                await self._clear_feed(feed, "gap")
            elif verdict is Verdict.RESTART:
                await self._clear_feed(feed, "restart")
                feed.ingestor.forget()
        await self._apply(feed, decoded)
        if seq is not None:
            feed.last_seq = seq

    # -- degraded mode ---------------------------------------------------------------------

    def _mark_down(self, exc: BaseException) -> None:
        if self.degraded:
            return
        self.degraded = True
        self.metrics.degraded.set(1)
        self.metrics.degraded_incidents.inc()
        log.warning(
            "kvstore backend %s unreachable (%s: %s); lookups answer 'no information' until it "
            "returns",
            self.index.kind,
            type(exc).__name__,
            exc,
        )
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        down_since = time.monotonic()
        while self.degraded:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await asyncio.wait_for(self.index.ping(), max(self.probe_interval_s, 0.2))
            except Exception:
                continue
            self.degraded = False
            self._timeouts_in_row = 0
            self.metrics.degraded.set(0)
            log.warning(
                "kvstore backend %s is back after %.1f s",
                self.index.kind,
                time.monotonic() - down_since,
            )
            await self._resync()

    async def _resync(self) -> None:
        """Rewrite every publisher's entries from its event state after an outage.

        Updates that arrived while the backend was down were dropped, and a restarted
        Redis may have lost everything: each instance is cleared and written again
        from the blocks its events say it holds now.
        """
        for feed in self._all_feeds():
            async with feed.lock:
                ops = feed.ingestor.snapshot()
                if not ops:
                    continue
                await self._guard("resync", partial(self.index.apply, ops))
            if self.degraded:
                return
            self.metrics.resyncs.labels(feed.instance).inc()
