"""Subscriptions taken from a worker registry (the balancer's fleet) instead of a static list.

The registry calls ``follower(event, worker)`` with event "added", "changed" or "removed".
A worker is duck-typed so this package depends on nothing of ours: it needs ``id`` (its
base URL, the store's instance id), ``dp_size``, ``flavor`` and ``spec.kv_events`` (the
rank-0 ZMQ endpoint; rank r publishes on port + r, as vLLM offsets it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

log = logging.getLogger("switchyard.kvstore.registry")


class Subscribable(Protocol):
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


class FleetFollower:
    """Keeps a store's ZMQ subscriptions equal to what the registry announces."""

    def __init__(self, store: Subscribable) -> None:
        self.store = store
        self.endpoints: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self, event: str, worker: Any) -> None:
        instance = str(worker.id)
        if event == "removed":
            self._drop(instance, self.endpoints.pop(instance, []), clear=True)
            return
        kv = getattr(getattr(worker, "spec", None), "kv_events", None)
        flavor = getattr(worker, "flavor", None) or "vllm"
        wanted = (
            [rank_endpoint(kv, r) for r in range(int(getattr(worker, "dp_size", 1)))] if kv else []
        )
        old = self.endpoints.get(instance, [])
        self._drop(instance, [e for e in old if e not in wanted], clear=False)
        for rank, endpoint in enumerate(wanted):
            if endpoint not in old:
                self.store.subscribe(instance, endpoint, None, flavor, rank)
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
        """Let pending unsubscriptions finish (tests, shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks)
