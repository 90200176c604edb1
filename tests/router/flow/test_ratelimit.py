"""Tenant rate limits: buckets of tokens and requests per minute, reserved at admission and
settled on usage, held across router processes (sibling bus) and replicas (Redis)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from redis.exceptions import RedisError

from switchyard.balancer.siblings import SiblingBus
from switchyard.router.flow.ratelimit import (
    DEFAULT_MAX_TOKENS,
    PRUNE_AT,
    Apply,
    RateLimited,
    RateLimits,
    RedisRateShare,
    Share,
    SiblingRateShare,
    TenantRateLimiter,
)
from switchyard.router.settings import Flow
from tests.support import eventually_async, redis_server

pytestmark = pytest.mark.timeout(60)

TPM = 6000  # 100 tokens a second


class Clock:
    """A virtual clock (also a wall clock, started mid-window)."""

    def __init__(self, now: float = 600_030.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def limiter(
    tokens: dict[str, int] | None = None,
    requests: dict[str, int] | None = None,
    clock: Clock | None = None,
    share: Share | None = None,
) -> TenantRateLimiter:
    limits = RateLimits(tokens if tokens is not None else {"a": TPM}, requests or {})
    return TenantRateLimiter(limits, clock or Clock(), share)


def available(rl: TenantRateLimiter, tenant: str = "a") -> tuple[float, float]:
    got = rl.available(tenant)
    assert got is not None
    return got


# Who is limited


def test_a_tenant_without_a_limit_gets_no_reservation() -> None:
    rl = limiter({"a": TPM})
    assert rl.reserve("b", 10_000, 10_000) is None
    assert rl.available("b") is None


def test_the_star_limits_every_tenant_not_named_and_a_zero_exempts_one() -> None:
    rl = limiter({"*": TPM, "big": 10 * TPM, "admin": 0})
    assert rl.reserve("anyone", 100, 100) is not None
    assert available(rl, "anyone")[0] == TPM - 200
    assert available(rl, "big")[0] == 10 * TPM
    assert rl.reserve("admin", 10**6, 10**6) is None


def test_limits_that_are_all_zero_limit_nobody() -> None:
    assert not RateLimits().enabled
    assert not RateLimits({"*": 0}, {"a": 0}).enabled
    assert RateLimits({}, {"a": 5}).enabled


def test_a_negative_limit_is_refused_by_the_settings() -> None:
    with pytest.raises(ValueError, match="rate limit of 'a' is negative"):
        Flow(tenant_tokens_per_minute={"a": -1})
    with pytest.raises(ValueError, match="rate limit of '\\*' is negative"):
        Flow(tenant_requests_per_minute={"*": -5})


# Reserve, settle, cancel


def test_a_reservation_takes_the_prompt_plus_max_tokens_and_one_request() -> None:
    rl = limiter({"a": TPM}, {"a": 10})
    reservation = rl.reserve("a", 100, 400)
    assert reservation is not None and reservation.tokens == 500
    assert available(rl) == (TPM - 500, 9)


def test_a_request_without_max_tokens_reserves_the_default() -> None:
    rl = limiter()
    reservation = rl.reserve("a", 100, None)
    assert reservation is not None and reservation.tokens == 100 + DEFAULT_MAX_TOKENS


def test_settling_refunds_what_the_engine_did_not_use() -> None:
    rl = limiter()
    reservation = rl.reserve("a", 100, 400)
    assert reservation is not None
    rl.settle(reservation, 100, 50)
    assert available(rl)[0] == TPM - 150


def test_settling_charges_what_the_engine_used_beyond_the_estimate() -> None:
    rl = limiter()
    reservation = rl.reserve("a", 100, None)
    assert reservation is not None
    rl.settle(reservation, 100, 1000)
    assert available(rl)[0] == TPM - 1100


def test_cancelling_refunds_the_tokens_and_the_request() -> None:
    rl = limiter({"a": TPM}, {"a": 10})
    reservation = rl.reserve("a", 100, 400)
    assert reservation is not None
    rl.cancel(reservation)
    assert available(rl) == (TPM, 10)


def test_a_reservation_is_settled_or_cancelled_once() -> None:
    rl = limiter()
    reservation = rl.reserve("a", 100, 400)
    assert reservation is not None
    rl.settle(reservation, 100, 100)
    rl.settle(reservation, 100, 0)
    rl.cancel(reservation)
    assert available(rl)[0] == TPM - 200


# Refill and Retry-After


def test_the_budget_refills_at_the_limit_per_minute_up_to_one_minutes_worth() -> None:
    clock = Clock()
    rl = limiter(clock=clock)
    assert rl.reserve("a", 3000, 1000) is not None
    clock.now += 15
    assert available(rl)[0] == TPM - 4000 + 1500
    clock.now += 600
    assert available(rl)[0] == TPM


def test_an_over_budget_request_is_told_when_enough_tokens_are_back() -> None:
    clock = Clock()
    rl = limiter(clock=clock)
    assert rl.reserve("a", 5000, 900) is not None  # 100 tokens left
    with pytest.raises(RateLimited) as refused:
        rl.reserve("a", 100, 500)
    assert refused.value.kind == "tokens"
    assert refused.value.retry_after_s == pytest.approx(5.0)  # 500 more at 100 a second
    assert refused.value.reason == "rate_limited"
    assert available(rl)[0] == 100, "a refusal takes nothing"
    clock.now += refused.value.retry_after_s
    assert rl.reserve("a", 100, 500) is not None


def test_an_over_budget_request_count_is_told_when_the_next_request_is_allowed() -> None:
    rl = limiter({}, {"a": 2})
    assert rl.reserve("a", 1, 1) is not None
    assert rl.reserve("a", 1, 1) is not None
    with pytest.raises(RateLimited) as refused:
        rl.reserve("a", 1, 1)
    assert refused.value.kind == "requests"
    assert refused.value.retry_after_s == pytest.approx(30.0)


def test_the_refusal_names_the_limit_that_takes_longest_to_allow_the_request() -> None:
    rl = limiter({"a": TPM}, {"a": 1})
    assert rl.reserve("a", 5000, 900) is not None
    with pytest.raises(RateLimited) as refused:
        rl.reserve("a", 100, 100)
    assert (refused.value.kind, refused.value.retry_after_s) == ("requests", pytest.approx(60.0))


def test_a_request_larger_than_a_minutes_budget_waits_for_a_full_bucket_not_for_ever() -> None:
    clock = Clock()
    rl = limiter(clock=clock)
    assert rl.reserve("a", 100, 100) is not None
    with pytest.raises(RateLimited) as refused:
        rl.reserve("a", 2 * TPM, 0)
    assert refused.value.retry_after_s == pytest.approx(2.0)  # until the bucket is full
    clock.now += 2
    assert rl.reserve("a", 2 * TPM, 0) is not None
    assert available(rl)[0] == -TPM, "the debt is bounded by one bucket"


def test_buckets_of_tenants_whose_budget_refilled_are_dropped_once_there_are_many() -> None:
    clock = Clock()
    rl = limiter({"*": TPM}, clock=clock)
    for n in range(PRUNE_AT):
        assert rl.reserve(f"t{n}", 10, 0) is not None
    assert len(rl) == PRUNE_AT
    clock.now += 1  # long enough to refill 10 tokens
    assert rl.reserve("busy", 10, 0) is not None
    assert len(rl) == 1


# Shared budgets


class Counted:
    """A share that counts the messages it sent and heard, so a test knows when an
    exchange is complete."""

    def __init__(self, inner: Share) -> None:
        self.inner = inner
        self.sent = self.heard = 0

    def attach(self, apply: Apply) -> None:
        def counted(tenant: str, tokens: int, requests: int) -> None:
            self.heard += 1
            apply(tenant, tokens, requests)

        self.inner.attach(counted)

    def consumed(self, tenant: str, tokens: int, requests: int) -> None:
        self.sent += 1
        self.inner.consumed(tenant, tokens, requests)

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()


@asynccontextmanager
async def bus_pair(directory: Path) -> AsyncIterator[list[Counted]]:
    """Two processes' buses, once each hears the other; messages go at the end of the
    loop turn."""
    buses = [SiblingBus(directory, rescan_s=0.05, lazy_s=0.0) for _ in range(2)]
    for bus in buses:
        await bus.start()
    try:
        await eventually_async(lambda: all(bus.peers == 1 for bus in buses))
        yield [Counted(SiblingRateShare(bus)) for bus in buses]
    finally:
        for bus in buses:
            await bus.stop()


# The simulated load: each request reserves 60 + 60 and uses 60 + 30 tokens.
PROMPT, MAX_TOKENS, OUTPUT = 60, 60, 30
USED = PROMPT + OUTPUT
SHARED_TPM = 54_000  # 10 requests' usage a second


async def offered_twice_the_limit(
    limiters: list[TenantRateLimiter],
    clock: Clock,
    exchange: Callable[[], Awaitable[None]],
    minutes: int = 5,
) -> list[int]:
    """Offer each limiter the whole limit (ten requests a second), one second at a time:
    each decides alone within the second, then they exchange what they consumed (a lag
    of a second, far more than either share's). Returns the tokens used a minute, all
    limiters together."""
    per_minute = [0] * minutes
    for second in range(60 * minutes):
        for rl in limiters:
            for _ in range(SHARED_TPM // 60 // USED):
                try:
                    reservation = rl.reserve("a", PROMPT, MAX_TOKENS)
                except RateLimited:
                    break
                assert reservation is not None
                rl.settle(reservation, PROMPT, OUTPUT)
                per_minute[second // 60] += USED
        await exchange()
        clock.now += 1
    return per_minute


def assert_within_the_limit(per_minute: list[int]) -> None:
    """The first minute spends the full bucket on top of the refill (as one process
    would); every later minute uses the limit within 10 %."""
    assert per_minute[0] <= 2 * SHARED_TPM * 1.1
    for used in per_minute[1:]:
        assert abs(used - SHARED_TPM) <= 0.1 * SHARED_TPM, per_minute
    minutes = len(per_minute)
    assert sum(per_minute) <= (SHARED_TPM * (minutes + 1)) * 1.1


async def test_one_process_limits_its_tenant_to_the_limit_alone() -> None:
    clock = Clock()
    rl = limiter({"a": SHARED_TPM}, clock=clock)

    async def nothing() -> None:
        return None

    per_minute = await offered_twice_the_limit([rl, rl], clock, nothing)
    assert_within_the_limit(per_minute)


async def test_two_processes_that_share_nothing_admit_twice_the_limit() -> None:
    clock = Clock()
    limiters = [limiter({"a": SHARED_TPM}, clock=clock) for _ in range(2)]

    async def nothing() -> None:
        return None

    per_minute = await offered_twice_the_limit(limiters, clock, nothing, minutes=2)
    assert per_minute[1] == 2 * SHARED_TPM


async def test_a_siblings_consumption_is_taken_from_this_processs_budget(tmp_path: Path) -> None:
    async with bus_pair(tmp_path) as (sa, sb):
        clock = Clock()
        a, b = limiter(clock=clock, share=sa), limiter(clock=clock, share=sb)
        reservation = a.reserve("a", 1000, 1000)
        assert reservation is not None
        a.settle(reservation, 1000, 500)
        await eventually_async(lambda: sb.heard == 2)
        assert available(b)[0] == TPM - 1500


async def test_two_processes_on_the_bus_hold_a_tenant_at_twice_its_limit_to_the_limit(
    tmp_path: Path,
) -> None:
    async with bus_pair(tmp_path) as shares:
        clock = Clock()
        limiters = [limiter({"a": SHARED_TPM}, clock=clock, share=share) for share in shares]

        async def exchange() -> None:
            await eventually_async(
                lambda: all(s.heard == o.sent for s, o in zip(shares, shares[::-1], strict=True)),
                interval_s=0.001,
            )

        per_minute = await offered_twice_the_limit(limiters, clock, exchange)
    assert_within_the_limit(per_minute)


def redis_pair(url: str, clock: Clock) -> list[RedisRateShare]:
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    return [RedisRateShare(url, prefix=prefix, wall=clock) for _ in range(2)]


async def test_two_replicas_through_redis_hold_a_tenant_at_twice_its_limit_to_the_limit() -> None:
    clock = Clock()
    with redis_server() as (url, _):
        shares = redis_pair(url, clock)
        limiters = [limiter({"a": SHARED_TPM}, clock=clock, share=share) for share in shares]

        async def exchange() -> None:
            for share in shares:
                await share.sync()

        try:
            per_minute = await offered_twice_the_limit(limiters, clock, exchange)
        finally:
            for share in shares:
                await share.stop()
    assert_within_the_limit(per_minute)


async def test_a_replica_new_to_a_tenant_takes_the_others_last_minute_from_redis() -> None:
    clock = Clock()
    with redis_server() as (url, _):
        sa, sb = redis_pair(url, clock)
        a, b = limiter(clock=clock, share=sa), limiter(clock=clock, share=sb)
        try:
            assert a.reserve("a", 4000, 0) is not None
            await sa.sync()
            clock.now += 40  # into the next window: the first one's count is still read
            assert b.reserve("a", 100, 0) is not None
            await sb.sync()
            # the last minute holds 50 s of the first window: 5/6 of its count
            assert available(b)[0] == TPM - 100 - 4000 * 5 // 6
        finally:
            await sa.stop()
            await sb.stop()


async def test_a_replica_keeps_its_limit_while_redis_is_down_and_sends_its_counts_after() -> None:
    clock = Clock()
    with redis_server() as (url, _):
        sa, sb = redis_pair(url, clock)
    a, b = limiter(clock=clock, share=sa), limiter(clock=clock, share=sb)
    assert b.reserve("a", 1, 0) is not None
    assert a.reserve("a", 3000, 0) is not None
    with pytest.raises(RedisError):
        await sa.sync()
    with pytest.raises(RateLimited):
        a.reserve("a", 4000, 0)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with redis_server(port):
        try:
            await sb.sync()
            await sa.sync()
            await sb.sync()
            assert available(b)[0] == TPM - 3001
        finally:
            await sa.stop()
            await sb.stop()
