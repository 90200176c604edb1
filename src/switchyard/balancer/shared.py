"""Sharing fleet state across router replicas through Redis.

In-flight counts: each fleet instance writes a snapshot of its own per-rank
counters into one hash whose TTL is a lease it renews every sync; peers sum the
snapshots of the live instances. A crashed instance stops renewing, its hash
expires, and its counts vanish from everyone's view after one lease.

Registry: workers added, removed, drained or undrained through the admin API are
broadcast on a pub/sub channel; the hash a new replica starts from holds the admin
workers that take requests (a drain takes a worker out of it, an undrain puts it back).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from switchyard.balancer.worker import RankCounters, Worker, WorkerSpec

if TYPE_CHECKING:
    from switchyard.balancer.fleet import Fleet

log = logging.getLogger("switchyard.balancer.redis")

Counts = tuple[int, int, int, int]


def set_remote(counters: RankCounters, values: Sequence[int]) -> None:
    """Replace the peers' part of a rank's (or a worker's total) counters."""
    (
        counters.remote_inflight,
        counters.remote_prefill_tokens,
        counters.remote_decode_seqs,
        counters.remote_decode_tokens,
    ) = values


class FleetShare(Protocol):
    """How a fleet shares its counts and admin registry with its peers: ``RedisShare``
    across router replicas, ``SiblingShare`` across the processes of one router."""

    @property
    def peers(self) -> int:
        """How many peers' counts are folded in."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def changed(self, worker: Worker) -> None:
        """A request began, reached its first token or ended on ``worker``."""

    def publish_add(self, spec: WorkerSpec) -> None: ...

    def publish_remove(self, worker_id: str) -> None: ...

    def publish_drain(self, worker_id: str) -> None: ...

    def publish_undrain(self, spec: WorkerSpec) -> None: ...


def own_counts(fleet: Fleet) -> dict[tuple[str, int], tuple[int, int, int, int]]:
    """This instance's non-zero counts per (worker, rank)."""
    out: dict[tuple[str, int], tuple[int, int, int, int]] = {}
    for worker in fleet.workers():
        for rank, counters in enumerate(worker.ranks):
            values = counters.local_tuple()
            if any(values):
                out[worker.id, rank] = values
    return out


def fold_peers(fleet: Fleet, totals: dict[tuple[str, int], list[int]]) -> None:
    """Make the peers' summed counts per (worker, rank) the remote part of every worker."""
    for worker in fleet.workers():
        ranks = range(len(worker.ranks))
        fold_worker(worker, [totals.get((worker.id, r), (0, 0, 0, 0)) for r in ranks])


def fold_worker(worker: Worker, per_rank: Sequence[Sequence[int]]) -> None:
    """Make ``per_rank`` (the peers' summed counts of each rank) the worker's remote part."""
    summed = [0, 0, 0, 0]
    for counters, values in zip(worker.ranks, per_rank, strict=False):
        set_remote(counters, values)
        summed = [a + b for a, b in zip(summed, values, strict=True)]
    set_remote(worker.totals, summed)
    worker.inflight = worker.local_inflight + summed[0]


def apply_change(fleet: Fleet, data: dict[str, Any]) -> None:
    """Apply a registry change a peer broadcast (the messages of ``publish_*``)."""
    try:
        op = data.get("op")
        if op == "add":
            fleet.add(WorkerSpec.from_any(data["spec"]), source="admin")
        elif op == "remove":
            fleet.remove(str(data["id"]))
        elif op == "drain":
            fleet.drain(str(data["id"]))
        elif op == "undrain":
            fleet.undrain(str(data["id"]))
    except (KeyError, ValueError, TypeError) as exc:
        log.error("bad registry message %r: %s", data, exc)


class RedisShare:
    """One fleet instance's link to the shared state."""

    def __init__(self, fleet: Fleet, url: str) -> None:
        self.fleet = fleet
        self.url = url
        self.instance = uuid.uuid4().hex[:12]
        prefix = fleet.settings.redis_prefix
        self.instances_key = f"{prefix}:instances"
        self.counts_prefix = f"{prefix}:inflight:"
        self.registry_key = f"{prefix}:workers"
        self.channel = f"{prefix}:registry"
        self.redis: aioredis.Redis = aioredis.from_url(url, decode_responses=True)
        self.peers = 0
        self._applying = False
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Connect and load the shared registry; if Redis is down, keep retrying in the
        background while the fleet runs on its local counts alone."""
        pubsub = None
        try:
            pubsub = await self._subscribe()
            await self.sync()
        except (aioredis.RedisError, OSError) as exc:
            log.warning("redis %s unavailable, running local-only until it is: %s", self.url, exc)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._sync_loop(), name="balancer:redis-sync"),
            loop.create_task(self._listen(pubsub), name="balancer:redis-registry"),
        ]

    async def _subscribe(self) -> Any:
        """Subscribe to registry changes, then load the stored registry (none is missed)."""
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            for raw in (await self.redis.hgetall(self.registry_key)).values():
                self._apply({"op": "add", "spec": orjson.loads(raw), "origin": ""})
        except BaseException:
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
            raise
        return pubsub

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._pending, return_exceptions=True)
        self._tasks.clear()
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.counts_prefix + self.instance)
                pipe.zrem(self.instances_key, self.instance)
                await pipe.execute()
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not withdraw counts from redis: %s", exc)
        await self.redis.aclose()

    # In-flight counts

    def changed(self, worker: Worker) -> None:
        """Nothing: counts reach Redis on the next sync (a round trip per request would
        cost more than it saves across replicas)."""

    def _own_counts(self) -> dict[FieldT, EncodableT]:
        return {
            f"{worker_id}\t{rank}": ",".join(map(str, values))
            for (worker_id, rank), values in own_counts(self.fleet).items()
        }

    async def sync(self) -> None:
        """Publish our counts, renew our lease, and fold in the live peers' counts."""
        lease = self.fleet.settings.lease_s
        now = time.time()
        own_key = self.counts_prefix + self.instance
        own = self._own_counts()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(own_key)
            if own:
                pipe.hset(own_key, mapping=own)
                pipe.pexpire(own_key, int(lease * 1000))
            pipe.zadd(self.instances_key, {self.instance: now + lease})
            pipe.zremrangebyscore(self.instances_key, "-inf", now)
            pipe.zrangebyscore(self.instances_key, now, "+inf")
            results = await pipe.execute()
        peers = [p for p in results[-1] if p != self.instance]
        async with self.redis.pipeline(transaction=False) as pipe:
            for peer in peers:
                pipe.hgetall(self.counts_prefix + peer)
            snapshots = await pipe.execute() if peers else []
        self.peers = len(peers)
        totals: dict[tuple[str, int], list[int]] = {}
        for snapshot in snapshots:
            for field, value in snapshot.items():
                worker_id, _, rank = field.rpartition("\t")
                acc = totals.setdefault((worker_id, int(rank)), [0, 0, 0, 0])
                for i, n in enumerate(value.split(",")):
                    acc[i] += int(n)
        fold_peers(self.fleet, totals)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.fleet.settings.sync_interval_s)
            try:
                await self.sync()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("redis sync failed: %s", exc)

    # Registry broadcast

    def publish_add(self, spec: WorkerSpec) -> None:
        data = spec.to_dict()
        self._send({"op": "add", "spec": data}, hset=(spec.url, orjson.dumps(data).decode()))

    def publish_remove(self, worker_id: str) -> None:
        self._send({"op": "remove", "id": worker_id}, hdel=worker_id)

    def publish_drain(self, worker_id: str) -> None:
        self._send({"op": "drain", "id": worker_id}, hdel=worker_id)

    def publish_undrain(self, spec: WorkerSpec) -> None:
        data = spec.to_dict()
        self._send({"op": "undrain", "id": spec.url}, hset=(spec.url, orjson.dumps(data).decode()))

    def _send(
        self,
        message: dict[str, Any],
        hset: tuple[str, str] | None = None,
        hdel: str | None = None,
    ) -> None:
        if self._applying:
            return
        message["origin"] = self.instance

        async def send() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                if hset is not None:
                    pipe.hset(self.registry_key, hset[0], hset[1])
                if hdel is not None:
                    pipe.hdel(self.registry_key, hdel)
                pipe.publish(self.channel, orjson.dumps(message))
                await pipe.execute()

        task = asyncio.get_running_loop().create_task(send())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _listen(self, pubsub: Any) -> None:
        while True:
            try:
                if pubsub is None:
                    pubsub = await self._subscribe()
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        data = orjson.loads(message["data"])
                    except orjson.JSONDecodeError:
                        continue
                    if data.get("origin") != self.instance:
                        self._apply(data)
            except (aioredis.RedisError, OSError) as exc:
                log.warning("redis registry channel lost, resubscribing: %s", exc)
                await asyncio.sleep(1.0)
            finally:
                if pubsub is not None:
                    await pubsub.aclose()
                    pubsub = None

    def _apply(self, data: dict[str, Any]) -> None:
        self._applying = True
        try:
            apply_change(self.fleet, data)
        finally:
            self._applying = False
