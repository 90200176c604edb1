"""Subscriptions taken from a worker registry (the balancer's fleet) instead of a static list.

The registry calls ``follower(event, worker)`` with event "added", "changed" or "removed".
A worker is duck-typed so this package depends on nothing of ours: it needs ``id`` (its
base URL, the store's instance id), ``dp_size``, ``flavor`` and ``spec.kv_events``.

A worker with ``kv_events`` (the rank-0 ZMQ endpoint; rank r publishes on port + r, as
vLLM offsets it) is followed there. Any other worker that is not SGLang is asked for its
``/kv_event_sources`` (vLLM's list of every DP rank's publisher), so a vLLM fleet needs
no KV configuration at all. Engines that connect to the store's ``--kv-listen`` socket
are not subscribed to; their topics are mapped to the worker instead.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from switchyard.kvstore.discovery import EventSource, SourceDiscovery
from switchyard.kvstore.listener import TopicMap, same_socket

log = logging.getLogger("switchyard.kvstore.registry")


class Subscribable(Protocol):
    topics: TopicMap

    @property
    def listen_endpoint(self) -> str | None:
        """The bound socket engines connect to, if any."""

    def subscribe(
        self,
        instance: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        flavor: str = "vllm",
        dp_rank: int = 0,
    ) -> None:
        """Follow one publisher endpoint (one DP rank of an instance)."""

    async def unsubscribe(self, endpoint: str) -> None:
        """Stop following a publisher endpoint."""

    async def clear_instance(self, instance: str, dp_rank: int | None = None) -> None:
        """Forget the instance's indexed blocks."""


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """vLLM's per-rank publisher endpoint: the TCP port plus the rank."""
    if dp_rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + dp_rank}" if port.isdigit() else endpoint


@dataclass
class _Spec:
    kv_events: str | None = None
    rank_urls: list[str] = field(default_factory=list)


@dataclass
class StaticWorker:
    """A worker known only by its URL (``switchyard kvstore --worker URL``)."""

    id: str
    flavor: str | None = None
    dp_size: int = 1
    spec: _Spec = field(default_factory=_Spec)


class FleetFollower:
    """Keeps a store's ZMQ subscriptions equal to what the registry announces."""

    def __init__(self, store: Subscribable, *, discovery_retry_s: float = 1.0) -> None:
        self.store = store
        self.endpoints: dict[str, list[str]] = {}
        self.discovery = SourceDiscovery(self._discovered, retry_s=discovery_retry_s)
        self._pending: dict[str, list[str]] = {}
        self._started = False
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Begin discovery of the workers announced before the event loop ran."""
        self._started = True
        for url, rank_urls in self._pending.items():
            self.discovery.watch(url, rank_urls)
        self._pending.clear()

    async def stop(self) -> None:
        await self.discovery.close()

    def __call__(self, event: str, worker: Any) -> None:
        instance = str(worker.id)
        spec = getattr(worker, "spec", None)
        if event == "removed":
            self.discovery.forget(instance)
            self._pending.pop(instance, None)
            self.store.topics.remove_worker(instance)
            self._drop(instance, self.endpoints.pop(instance, []), clear=True)
            return
        self.store.topics.add_worker(instance)
        kv = getattr(spec, "kv_events", None)
        flavor = getattr(worker, "flavor", None) or "vllm"
        if kv:
            wanted = [rank_endpoint(kv, r) for r in range(int(getattr(worker, "dp_size", 1)))]
            self._follow(instance, [(e, None, r) for r, e in enumerate(wanted)], flavor)
            return
        if flavor == "sglang":
            self._follow(instance, [], flavor)
            return
        if instance in self.discovery.sources:
            self._discovered(instance, self.discovery.sources[instance])
            return
        rank_urls = [str(u) for u in getattr(spec, "rank_urls", None) or []]
        if self._started:
            self.discovery.watch(instance, rank_urls)
        else:
            self._pending[instance] = rank_urls

    def _discovered(self, instance: str, sources: list[EventSource]) -> None:
        listen = self.store.listen_endpoint
        targets: list[tuple[str, str | None, int]] = []
        for src in sources:
            self.store.topics.map(src.topic, instance, src.dp_rank, src.replay_endpoint)
            if listen is not None and same_socket(src.endpoint, listen):
                continue
            if not src.engine_binds:
                log.info(
                    "%s rank %d publishes to %s (it connects there); without --kv-listen "
                    "at that address its events may not arrive",
                    instance,
                    src.dp_rank,
                    src.endpoint,
                )
            targets.append((src.endpoint, src.replay_endpoint, src.dp_rank))
        self._follow(instance, targets, "vllm")

    def _follow(
        self, instance: str, targets: list[tuple[str, str | None, int]], flavor: str
    ) -> None:
        wanted = [endpoint for endpoint, _, _ in targets]
        old = self.endpoints.get(instance, [])
        self._drop(instance, [e for e in old if e not in wanted], clear=False)
        for endpoint, replay, rank in targets:
            if endpoint not in old:
                self.store.subscribe(instance, endpoint, replay, flavor, rank)
        if wanted:
            self.endpoints[instance] = wanted
        else:
            self.endpoints.pop(instance, None)

    def _drop(self, instance: str, endpoints: list[str], clear: bool) -> None:
        if not endpoints and not clear:
            return
        task = asyncio.get_running_loop().create_task(self._unsubscribe(instance, endpoints, clear))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unsubscribe(self, instance: str, endpoints: list[str], clear: bool) -> None:
        for endpoint in endpoints:
            await self.store.unsubscribe(endpoint)
        if clear:
            await self.store.clear_instance(instance)
        log.info("%s: stopped following %d publisher(s)", instance, len(endpoints))

    async def wait(self) -> None:
        """Let pending discoveries and unsubscriptions finish (tests, shutdown)."""
        await self.discovery.wait()
        if self._tasks:
            await asyncio.gather(*self._tasks)
