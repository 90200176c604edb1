"""A request that would wait past the queue's TTL is refused within a second, not when the
TTL has passed: the wait is estimated from the prompt tokens that stand before it in the
queue and the prompt tokens a second that left the queue lately, when it arrives and
again, with what left since, half a second later (an injected clock; no sleeps).
"""

from __future__ import annotations

import asyncio

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.worker import WorkerSpec
from switchyard.router.errors import RouterError
from switchyard.router.flow.control import _RATE_SAMPLES, SECOND_LOOK_S, FlowControl
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


def flow_control(ttl_s: float = 10.0, fleet: Fleet | None = None) -> tuple[FlowControl, Clock]:
    clock = Clock()
    settings = Flow(queue_ttl_s=ttl_s, max_queued_prefill_tokens=1000)
    flow = FlowControl(fleet or Fleet(), settings, FlowMetrics(RouterMetrics()), clock)
    return flow, clock


def drained_at(flow: FlowControl, tokens_per_s: float, size: int = 100) -> None:
    """The queue's recent history: ``_RATE_SAMPLES`` dispatches of ``size`` tokens, evenly
    spaced so that they left at ``tokens_per_s``, the last one a moment ago."""
    now = flow._busy_clock()
    gap = size / tokens_per_s
    for n in range(_RATE_SAMPLES):
        flow._dispatched.append((now - (_RATE_SAMPLES - n) * gap, size))
    flow._dispatched_tokens = _RATE_SAMPLES * size


def queue_up(flow: FlowControl, clock: Clock, identity: Identity, count: int, tokens: int) -> None:
    for _ in range(count):
        flow.queue.push(Queued(identity, "m", 100, tokens, clock.now, None))
    flow._busy()  # as a request queued through ``admit`` does


def test_no_estimate_until_enough_requests_left_the_queue() -> None:
    flow, clock = flow_control()
    queue_up(flow, clock, FLOOD, 500, 10)
    assert flow.expected_wait_s(FLOOD, 10) is None


def test_the_flooding_tenant_waits_behind_its_own_backlog_and_the_others_turns() -> None:
    flow, clock = flow_control()
    drained_at(flow, tokens_per_s=40.0)
    queue_up(flow, clock, FLOOD, 39, 10)
    queue_up(flow, clock, QUIET, 1, 10)
    # the flood's 40 requests, and the quiet tenant's one taking its turn before them
    assert flow.expected_wait_s(FLOOD, 10) == pytest.approx(410 / 40.0)
    # the quiet tenant's second goes after as many of the flood's tokens as its two
    assert flow.expected_wait_s(QUIET, 10) == pytest.approx(40 / 40.0)


def test_a_short_prompt_waits_behind_as_many_of_the_floods_tokens_not_requests() -> None:
    flow, clock = flow_control()
    drained_at(flow, tokens_per_s=2000.0, size=2000)
    queue_up(flow, clock, FLOOD, 10, 2000)
    assert flow.expected_wait_s(QUIET, 50) == pytest.approx(100 / 2000.0)
    assert flow.expected_wait_s(FLOOD, 2000) == pytest.approx(11.0)


def test_a_higher_band_waits_only_behind_its_own_band() -> None:
    flow, clock = flow_control()
    drained_at(flow, tokens_per_s=40.0)
    queue_up(flow, clock, FLOOD, 100, 10)
    assert flow.expected_wait_s(URGENT, 10) == pytest.approx(10 / 40.0)


def test_a_queue_that_stopped_draining_counts_as_slow() -> None:
    flow, clock = flow_control()
    drained_at(flow, tokens_per_s=40.0)
    queue_up(flow, clock, FLOOD, 3, 10)
    before = flow.expected_wait_s(FLOOD, 10)
    clock.now += 60.0  # nothing left the queue for a minute while requests waited
    after = flow.expected_wait_s(FLOOD, 10)
    span = _RATE_SAMPLES * 100 / 40.0
    assert before == pytest.approx(40 / 40.0)
    assert after == pytest.approx(40 * (span + 60.0) / (_RATE_SAMPLES * 100))


def test_time_with_nothing_queued_does_not_slow_the_estimate() -> None:
    flow, clock = flow_control()
    flow.pump()  # an empty queue: the busy clock stands still
    drained_at(flow, tokens_per_s=40.0)
    clock.now += 3600.0  # an idle hour
    queue_up(flow, clock, FLOOD, 3, 10)
    assert flow.expected_wait_s(FLOOD, 10) == pytest.approx(40 / 40.0)


def test_a_request_that_would_wait_past_the_ttl_is_refused_at_once_with_retry_after() -> None:
    flow, clock = flow_control(ttl_s=10.0)
    drained_at(flow, tokens_per_s=40.0)
    queue_up(flow, clock, FLOOD, 60, 10)  # 15 s of the flood's backlog
    with pytest.raises(RouterError) as refused:
        flow._refuse_if_hopeless(FLOOD, 10)
    assert refused.value.status == 429
    assert refused.value.headers["x-switchyard-reason"] == "queue_full"
    assert 1 <= float(refused.value.headers["retry-after"]) <= 10
    flow._refuse_if_hopeless(QUIET, 10)  # two turns away: it waits its turn


def test_a_request_expected_to_wait_most_of_the_ttl_is_refused_too() -> None:
    """Let in near the TTL, a request may time out after all of it: the slowest refusal."""
    flow, clock = flow_control(ttl_s=10.0)
    drained_at(flow, tokens_per_s=40.0)
    queue_up(flow, clock, FLOOD, 8, 10)  # its 9th request: about 2.25 s
    flow._refuse_if_hopeless(FLOOD, 10)
    queue_up(flow, clock, FLOOD, 4, 10)  # its 13th: about 3.25 s, past a quarter of the TTL
    with pytest.raises(RouterError) as refused:
        flow._refuse_if_hopeless(FLOOD, 10)
    assert refused.value.headers["x-switchyard-reason"] == "queue_full"


async def test_a_request_let_in_without_an_estimate_is_refused_at_its_second_look() -> None:
    fleet = Fleet()
    worker = fleet.add(WorkerSpec("http://127.0.0.1:1", models=["m"]))
    flow, clock = flow_control(ttl_s=10.0, fleet=fleet)
    worker.inflight = worker.local_inflight = 1
    worker.totals.prefill_tokens = 5000  # saturated: every request waits
    first = asyncio.ensure_future(flow.admit(FLOOD, "m", 100, 400))
    quiet = asyncio.ensure_future(flow.admit(QUIET, "m", 100, 10))
    await asyncio.sleep(0)
    assert not first.done()  # no dispatch seen yet: no estimate, so it waits
    # what left the queue since: 40 tokens a second, 10 s for the flood's 400 tokens
    drained_at(flow, tokens_per_s=40.0)
    clock.now += SECOND_LOOK_S
    flow.pump()
    with pytest.raises(RouterError) as refused:
        await asyncio.wait_for(first, 1.0)
    assert refused.value.status == 429
    assert refused.value.headers["x-switchyard-reason"] == "queue_full"
    assert "retry-after" in refused.value.headers
    assert not quiet.done()  # a quarter-second away: it keeps its place
    assert flow.queue.size == 1
    worker.totals.prefill_tokens = 0
    flow.prefilled()
    grant = await asyncio.wait_for(quiet, 1.0)
    assert grant.tenant == "quiet"


def test_a_line_whose_head_has_waited_long_takes_no_more_whatever_the_estimate() -> None:
    """The estimate runs short when the engines slow down after the dispatches it saw:
    the head of the tenant's line has then waited longer than it said, and the tenant
    is refused until its line moves, while another tenant still gets in."""
    flow, clock = flow_control(ttl_s=10.0)
    drained_at(flow, tokens_per_s=4000.0)  # fast lately: the estimate is short
    queue_up(flow, clock, FLOOD, 3, 10)
    flow._refuse_if_hopeless(FLOOD, 10)
    clock.now += 3.0  # the head of the flood's line has waited past a quarter of the TTL
    with pytest.raises(RouterError) as refused:
        flow._refuse_if_hopeless(FLOOD, 10)
    assert refused.value.headers["x-switchyard-reason"] == "queue_full"
    flow._refuse_if_hopeless(QUIET, 10)  # its own line is empty
