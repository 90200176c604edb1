"""A request that would wait past the queue's TTL is refused when it arrives, not when the
TTL has passed: the wait is estimated from what stands before it in the queue and the rate
requests left the queue lately (an injected clock; no worker, no sleeps)."""

from __future__ import annotations

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.router.errors import RouterError
from switchyard.router.flow.control import _RATE_SAMPLES, FlowControl
from switchyard.router.flow.identity import Identity
from switchyard.router.flow.queue import Queued
from switchyard.router.metrics import FlowMetrics, RouterMetrics
from switchyard.router.settings import Flow

FLOOD = Identity("flood", 0, None)
QUIET = Identity("quiet", 0, None)
URGENT = Identity("quiet", 1, None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def flow_control(ttl_s: float = 10.0) -> tuple[FlowControl, Clock]:
    clock = Clock()
    flow = FlowControl(Fleet(), Flow(queue_ttl_s=ttl_s), FlowMetrics(RouterMetrics()), clock)
    return flow, clock


def drained_at(flow: FlowControl, clock: Clock, per_s: float) -> None:
    """The queue's recent history: a dispatch every 1/per_s seconds, the last one now."""
    for n in range(_RATE_SAMPLES):
        flow._dispatched_at.append(clock.now - (_RATE_SAMPLES - 1 - n) / per_s)


def queue_up(flow: FlowControl, clock: Clock, identity: Identity, count: int) -> None:
    for _ in range(count):
        flow.queue.push(Queued(identity, "m", 100, 10, clock.now, None))


def test_no_estimate_until_enough_requests_left_the_queue() -> None:
    flow, clock = flow_control()
    queue_up(flow, clock, FLOOD, 500)
    assert flow.expected_wait_s(FLOOD) is None


def test_the_flooding_tenant_waits_behind_its_own_backlog_and_the_others_turns() -> None:
    flow, clock = flow_control()
    drained_at(flow, clock, per_s=4.0)
    queue_up(flow, clock, FLOOD, 39)
    queue_up(flow, clock, QUIET, 1)
    # the flood's 40th, and the quiet tenant's one request taking its turn before it
    flood = flow.expected_wait_s(FLOOD)
    assert flood == pytest.approx(41 * (_RATE_SAMPLES - 1) / 4.0 / _RATE_SAMPLES)
    # the quiet tenant's second goes after one more of the flood's: two turns each
    quiet = flow.expected_wait_s(QUIET)
    assert quiet == pytest.approx(4 * (_RATE_SAMPLES - 1) / 4.0 / _RATE_SAMPLES)


def test_a_higher_band_waits_only_behind_its_own_band() -> None:
    flow, clock = flow_control()
    drained_at(flow, clock, per_s=4.0)
    queue_up(flow, clock, FLOOD, 100)
    assert flow.expected_wait_s(URGENT) == pytest.approx((_RATE_SAMPLES - 1) / 4.0 / _RATE_SAMPLES)


def test_a_queue_that_stopped_draining_counts_as_slow() -> None:
    flow, clock = flow_control()
    drained_at(flow, clock, per_s=4.0)
    queue_up(flow, clock, FLOOD, 3)
    before = flow.expected_wait_s(FLOOD)
    clock.now += 60.0  # nothing left the queue for a minute
    after = flow.expected_wait_s(FLOOD)
    span = (_RATE_SAMPLES - 1) / 4.0
    assert before == pytest.approx(4 * span / _RATE_SAMPLES)
    assert after == pytest.approx(4 * (span + 60.0) / _RATE_SAMPLES)


def test_a_request_that_would_wait_past_the_ttl_is_refused_at_once_with_retry_after() -> None:
    flow, clock = flow_control(ttl_s=10.0)
    drained_at(flow, clock, per_s=4.0)
    queue_up(flow, clock, FLOOD, 60)  # 15 s of the flood's backlog at 4 a second
    with pytest.raises(RouterError) as refused:
        flow._refuse_if_hopeless(FLOOD)
    assert refused.value.status == 429
    assert refused.value.headers["x-switchyard-reason"] == "queue_full"
    assert 1 <= float(refused.value.headers["retry-after"]) <= 10
    flow._refuse_if_hopeless(QUIET)  # two turns away: it waits its turn


def test_a_request_expected_to_wait_most_of_the_ttl_is_refused_too() -> None:
    """Let in near the TTL, a request may time out after all of it: the slowest refusal."""
    flow, clock = flow_control(ttl_s=10.0)
    drained_at(flow, clock, per_s=4.0)
    queue_up(flow, clock, FLOOD, 8)  # its 9th request: about 2.25 s
    flow._refuse_if_hopeless(FLOOD)
    queue_up(flow, clock, FLOOD, 4)  # its 13th: about 3.25 s, past a quarter of the TTL
    with pytest.raises(RouterError) as refused:
        flow._refuse_if_hopeless(FLOOD)
    assert refused.value.headers["x-switchyard-reason"] == "queue_full"
