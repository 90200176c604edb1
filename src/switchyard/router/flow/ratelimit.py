"""Tenant rate limits: tokens and requests per minute, reserved at admission, settled on
the engine's usage, and shared by every process and replica of the router.

Each tenant has two token buckets (tokens, requests), each refilling at its limit / 60 a
second up to one minute's budget: a bucket, not a sliding window, because it needs no
history (two floats a tenant), forgives an idle tenant a burst of one minute's budget,
and takes a debit or a refund at any moment, which is how settling and sharing work. A
request reserves its prompt plus ``max_tokens`` (``DEFAULT_MAX_TOKENS`` when it sets
none) and one request; ``settle`` replaces the estimate by the usage, ``cancel`` refunds
it all. A request larger than a bucket waits for a full bucket and then takes it below
zero, so it is slowed, never refused for ever. A bucket falls to ``-capacity`` at most:
a tenant never waits more than two minutes' refill.

Sharing: what one process consumes is debited from every other process's buckets too
(``Share``), so each bucket refills at the limit's rate while every process's
consumption drains it, and N processes admit the limit, not N times it. What a process
admits before it hears the others' consumption is an overshoot, and the next debits
take it back from the same buckets (they go negative), so over minutes the combined
rate holds the limit; the lag bounds the transient:

- ``SiblingRateShare``: the processes of one router send each consumption on the sibling
  bus (lazy: with the next frame, ``LAZY_S`` at most). Lag: one frame.
- ``RedisRateShare``: router replicas add their consumption to a per-tenant counter of
  the current 60 s window (``HINCRBY`` + ``EXPIRE``) every ``sync_interval_s`` and read
  back what the others added since the last sync, so a request never waits on Redis. A
  replica that meets a tenant for the first time takes the others' last minute from
  the window counts (the current one plus the elapsed share of the previous one).
  Overshoot bound: the others' admissions of one sync interval plus a round trip, about
  ``(N - 1) * limit / 60 * sync_interval_s`` in steady flow (at most each replica's
  bucket at once for a tenant that was idle), taken back by the next syncs. Redis down:
  each replica enforces alone (its consumption is sent once Redis answers again).

Under ``--processes N`` with Redis, every process is its own Redis client and the Redis
share covers its siblings too; the bus share is for a router without Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import redis.asyncio as aioredis

from switchyard.balancer.siblings import SiblingBus
from switchyard.core.packing import packb

log = logging.getLogger("switchyard.router.flow.ratelimit")

# Tokens reserved for a request's output when it sets no ``max_tokens``: a fixed guess,
# not a setting, because ``settle`` corrects it to the engine's usage either way.
DEFAULT_MAX_TOKENS = 256
ANY_TENANT = "*"
REASON = "rate_limited"  # the x-switchyard-reason of a refusal
TOPIC = b"ratelimit"  # sibling-bus topic: (tenant, tokens, requests) one process consumed
WINDOW_S = 60.0
# Buckets are dropped once full (they hold nothing a new one would not) when their count
# reaches this, then twice what remained: tenants named by a header are unbounded.
PRUNE_AT = 1024

Apply = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Per-minute limits by tenant; ``"*"`` is every tenant not named; 0 is no limit (to
    exempt a named tenant from ``"*"``). None is negative: the ``Flow`` settings they
    come from refuse that."""

    tokens_per_minute: Mapping[str, int] = field(default_factory=dict)
    requests_per_minute: Mapping[str, int] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether some tenant is limited (else no limiter is needed at all)."""
        return any(self.tokens_per_minute.values()) or any(self.requests_per_minute.values())


class RateLimited(Exception):
    """A tenant is over its limit of ``kind`` ("tokens" or "requests"); enough budget is
    back after ``retry_after_s``."""

    reason = REASON

    def __init__(self, kind: str, retry_after_s: float) -> None:
        super().__init__(f"tenant over its {kind} per minute; retry after {retry_after_s:.1f} s")
        self.kind = kind
        self.retry_after_s = retry_after_s


@dataclass(slots=True, eq=False)
class Reservation:
    """What a request took from its tenant's buckets, until ``settle`` or ``cancel``."""

    tenant: str
    tokens: int
    open: bool = True


@dataclass(frozen=True, slots=True)
class _Plan:
    tokens: int  # per minute; 0: no limit
    requests: int


@dataclass(slots=True)
class _Bucket:
    plan: _Plan
    tokens: float
    requests: float
    at: float

    def refill(self, now: float) -> None:
        elapsed = now - self.at
        if elapsed > 0:
            plan = self.plan
            self.tokens = min(plan.tokens, self.tokens + elapsed * plan.tokens / WINDOW_S)
            self.requests = min(plan.requests, self.requests + elapsed * plan.requests / WINDOW_S)
            self.at = now

    def full(self) -> bool:
        return self.tokens >= self.plan.tokens and self.requests >= self.plan.requests


class Share(Protocol):
    """How a limiter tells the other processes what it consumed and hears theirs."""

    def attach(self, apply: Apply) -> None:
        """Call ``apply(tenant, tokens, requests)`` with what the others consumed (negative:
        refunded)."""

    def consumed(self, tenant: str, tokens: int, requests: int) -> None:
        """This process consumed (or refunded, negative) so much of ``tenant``'s budget."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class TenantRateLimiter:
    """Tokens and requests per minute per tenant (see the module docstring)."""

    def __init__(
        self,
        limits: RateLimits,
        clock: Callable[[], float] = time.monotonic,
        share: Share | None = None,
    ) -> None:
        self.limits = limits
        self.clock = clock
        self.share = share
        tokens, requests = limits.tokens_per_minute, limits.requests_per_minute
        default = _Plan(tokens.get(ANY_TENANT, 0), requests.get(ANY_TENANT, 0))
        self._default = default if default.tokens or default.requests else None
        self._plans: dict[str, _Plan | None] = {}
        for tenant in {*tokens, *requests} - {ANY_TENANT}:
            plan = _Plan(tokens.get(tenant, default.tokens), requests.get(tenant, default.requests))
            self._plans[tenant] = plan if plan.tokens or plan.requests else None
        self._buckets: dict[str, _Bucket] = {}
        self._prune_at = PRUNE_AT
        if share is not None:
            share.attach(self._apply)

    def reserve(
        self, tenant: str, prompt_tokens: int, max_tokens: int | None
    ) -> Reservation | None:
        """Take a request's estimate from ``tenant``'s budget; None when the tenant has no
        limit. Raises ``RateLimited`` with the seconds until the budget suffices."""
        plan = self._plans.get(tenant, self._default)
        if plan is None:
            return None
        now = self.clock()
        bucket = self._bucket(tenant, plan, now)
        cost = prompt_tokens + (DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
        wait_requests = wait_tokens = 0.0
        if plan.requests and bucket.requests < 1:
            wait_requests = (1 - bucket.requests) * WINDOW_S / plan.requests
        if plan.tokens:
            need = min(cost, plan.tokens)  # a larger request waits for a full bucket
            if bucket.tokens < need:
                wait_tokens = (need - bucket.tokens) * WINDOW_S / plan.tokens
        if wait_requests or wait_tokens:
            if wait_tokens >= wait_requests:
                raise RateLimited("tokens", wait_tokens)
            raise RateLimited("requests", wait_requests)
        self._debit(bucket, cost, 1)
        if self.share is not None:
            self.share.consumed(tenant, cost, 1)
        return Reservation(tenant, cost)

    def settle(self, reservation: Reservation, prompt_tokens: int, output_tokens: int) -> None:
        """Replace the estimate by the engine's usage: a refund, or an extra charge."""
        if not reservation.open:
            return
        reservation.open = False
        delta = prompt_tokens + output_tokens - reservation.tokens
        if delta:
            self._apply(reservation.tenant, delta, 0)
            if self.share is not None:
                self.share.consumed(reservation.tenant, delta, 0)

    def cancel(self, reservation: Reservation) -> None:
        """Refund a request refused or failed before an engine did any work for it."""
        if not reservation.open:
            return
        reservation.open = False
        self._apply(reservation.tenant, -reservation.tokens, -1)
        if self.share is not None:
            self.share.consumed(reservation.tenant, -reservation.tokens, -1)

    def __len__(self) -> int:
        """Tenants whose buckets are held (a full one is dropped when many are)."""
        return len(self._buckets)

    def available(self, tenant: str) -> tuple[float, float] | None:
        """(tokens, requests) ``tenant`` may spend now; None when it has no limit."""
        plan = self._plans.get(tenant, self._default)
        if plan is None:
            return None
        bucket = self._bucket(tenant, plan, self.clock())
        return bucket.tokens, bucket.requests

    def _apply(self, tenant: str, tokens: int, requests: int) -> None:
        """Debit (or credit, negative) ``tenant``'s buckets: a settlement, or what another
        process consumed."""
        plan = self._plans.get(tenant, self._default)
        if plan is not None:
            self._debit(self._bucket(tenant, plan, self.clock()), tokens, requests)

    @staticmethod
    def _debit(bucket: _Bucket, tokens: int, requests: int) -> None:
        plan = bucket.plan
        bucket.tokens = min(plan.tokens, max(-plan.tokens, bucket.tokens - tokens))
        bucket.requests = min(plan.requests, max(-plan.requests, bucket.requests - requests))

    def _bucket(self, tenant: str, plan: _Plan, now: float) -> _Bucket:
        """``tenant``'s buckets refilled to ``now`` (new ones full)."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= self._prune_at:
                self._prune(now)
            bucket = self._buckets[tenant] = _Bucket(plan, plan.tokens, plan.requests, now)
        else:
            bucket.refill(now)
        return bucket

    def _prune(self, now: float) -> None:
        for tenant, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.full():
                del self._buckets[tenant]
        self._prune_at = max(PRUNE_AT, 2 * len(self._buckets))


class SiblingRateShare:
    """Consumption shared with the other processes of one router over its sibling bus
    (whose owner starts and stops it)."""

    def __init__(self, bus: SiblingBus) -> None:
        self.bus = bus

    def attach(self, apply: Apply) -> None:
        def heard(origin: str, payload: bytes) -> None:
            try:
                tenant, tokens, requests = msgpack.unpackb(payload)
            except (ValueError, TypeError, msgpack.UnpackException):
                return
            if isinstance(tenant, str) and isinstance(tokens, int) and isinstance(requests, int):
                apply(tenant, tokens, requests)

        self.bus.on(TOPIC, heard)

    def consumed(self, tenant: str, tokens: int, requests: int) -> None:
        self.bus.publish(TOPIC, packb((tenant, tokens, requests)), lazy=True)

    async def start(self) -> None:
        """Nothing: the bus is the router's."""

    async def stop(self) -> None:
        """Nothing: the bus is the router's."""


@dataclass(slots=True)
class _Tracked:
    """One tenant a replica consumed for: what it has not yet sent, and the window
    counts it last read (None: not read yet)."""

    tokens: int = 0
    requests: int = 0
    window: int = -1
    seen: tuple[int, int] | None = None  # the window's (tokens, requests) at the last read
    active_at: float = 0.0


class RedisRateShare:
    """Consumption shared with other router replicas through Redis: a hash per tenant
    and 60 s window, ``{prefix}:{tenant}:{window}`` with fields ``t`` and ``r``."""

    def __init__(
        self,
        url: str,
        prefix: str = "switchyard:ratelimit",
        sync_interval_s: float = 0.25,
        wall: Callable[[], float] = time.time,
        redis: aioredis.Redis | None = None,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.sync_interval_s = sync_interval_s
        self.wall = wall
        self.redis: aioredis.Redis = redis or aioredis.from_url(url, decode_responses=True)
        self._apply: Apply | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._task: asyncio.Task[None] | None = None

    def attach(self, apply: Apply) -> None:
        self._apply = apply

    def consumed(self, tenant: str, tokens: int, requests: int) -> None:
        tracked = self._tracked.get(tenant)
        if tracked is None:
            tracked = self._tracked[tenant] = _Tracked()
        tracked.tokens += tokens
        tracked.requests += requests
        tracked.active_at = self.wall()

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._sync_loop(), name="flow:ratelimit-sync"
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.sync()  # what this replica consumed still counts for the others
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not send the last rate-limit counts to redis: %s", exc)
        await self.redis.aclose()

    def _key(self, tenant: str, window: int) -> str:
        return f"{self.prefix}:{tenant}:{window}"

    async def sync(self) -> None:
        """Add this replica's consumption to the window counts, and debit what the others
        added since the last sync (at a tenant's first sync: their last minute)."""
        now = self.wall()
        window = int(now // WINDOW_S)
        elapsed = now / WINDOW_S - window  # of the current window, 0..1
        for tenant in [t for t, k in self._tracked.items() if now - k.active_at > 2 * WINDOW_S]:
            del self._tracked[tenant]  # idle: a bucket that refilled needs no more debits
        tenants = list(self._tracked.items())
        if not tenants:
            return
        sent = [(k.tokens, k.requests) for _, k in tenants]
        for _, tracked in tenants:
            tracked.tokens = tracked.requests = 0
        ttl = int(3 * WINDOW_S)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for (tenant, _), (tokens, requests) in zip(tenants, sent, strict=True):
                    key = self._key(tenant, window)
                    pipe.hincrby(key, "t", tokens)
                    pipe.hincrby(key, "r", requests)
                    pipe.expire(key, ttl)
                    pipe.hmget(self._key(tenant, window - 1), ["t", "r"])
                results: list[Any] = await pipe.execute()
        except BaseException:
            for (_, tracked), (tokens, requests) in zip(tenants, sent, strict=True):
                tracked.tokens += tokens  # sent with the next sync
                tracked.requests += requests
            raise
        for i, ((tenant, tracked), (tokens, requests)) in enumerate(
            zip(tenants, sent, strict=True)
        ):
            total_t, total_r = int(results[4 * i]), int(results[4 * i + 1])
            prev_t, prev_r = (int(v or 0) for v in results[4 * i + 3])
            if tracked.seen is None:  # the others' last minute, as the windows tell it
                share = 1.0 - elapsed
                others_t = total_t - tokens + int(prev_t * share)
                others_r = total_r - requests + int(prev_r * share)
            elif tracked.window == window:
                others_t = total_t - tokens - tracked.seen[0]
                others_r = total_r - requests - tracked.seen[1]
            elif tracked.window == window - 1:  # the rest of the window last read, and this
                others_t = prev_t - tracked.seen[0] + total_t - tokens
                others_r = prev_r - tracked.seen[1] + total_r - requests
            else:  # no sync for a window (Redis was down): the rest of the older one is lost
                others_t = prev_t + total_t - tokens
                others_r = prev_r + total_r - requests
            tracked.window, tracked.seen = window, (total_t, total_r)
            if (others_t or others_r) and self._apply is not None:
                self._apply(tenant, others_t, others_r)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("rate-limit sync with redis failed: %s", exc)
