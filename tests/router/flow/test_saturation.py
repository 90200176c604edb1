"""When a worker is saturated: each threshold alone, stale metrics, the work-conserving rule
(nothing in flight: never saturated), never-scraped workers, unhealthy and draining."""

from __future__ import annotations

import pytest

from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import EngineSample, Worker, WorkerSpec
from switchyard.router.flow.saturation import Thresholds, saturated

NOW = 1000.0
DEFAULTS = Thresholds()


def worker(
    *,
    inflight: int = 1,
    waiting: int | None = 0,
    kv: float | None = 0.1,
    scraped_ago: float | None = 0.5,
    prefill: int = 0,
    remote_prefill: int = 0,
) -> Worker:
    """A worker as the fleet leaves it; ``waiting=None``: never scraped."""
    w = Worker(WorkerSpec("http://127.0.0.1:1", models=["m"]), BalancerSettings())
    w.inflight = inflight
    w.totals.prefill_tokens = prefill
    w.totals.remote_prefill_tokens = remote_prefill
    if waiting is not None:
        w.engine = EngineSample(running=inflight, waiting=waiting, kv_usage=kv)
        w.scraped_at = None if scraped_ago is None else NOW - scraped_ago
    return w


def test_a_busy_worker_under_every_threshold_is_not_saturated() -> None:
    assert not saturated(worker(inflight=3, waiting=5, kv=0.8), DEFAULTS, NOW)


def test_more_engine_waiting_than_the_queue_depth_saturates() -> None:
    assert saturated(worker(waiting=6), DEFAULTS, NOW)
    assert saturated(worker(waiting=2), Thresholds(queue_depth=1), NOW)


def test_kv_usage_above_the_threshold_saturates() -> None:
    assert saturated(worker(kv=0.81), DEFAULTS, NOW)
    assert not saturated(worker(kv=0.81), Thresholds(kv_usage=0.9), NOW)


def test_an_engine_that_does_not_report_kv_usage_is_judged_on_the_rest() -> None:
    assert not saturated(worker(kv=None), DEFAULTS, NOW)


def test_stale_metrics_saturate_a_worker_with_work_in_flight() -> None:
    assert saturated(worker(scraped_ago=2.5), DEFAULTS, NOW)
    assert not saturated(worker(scraped_ago=2.5), Thresholds(metrics_staleness_s=3.0), NOW)
    assert saturated(worker(scraped_ago=None), DEFAULTS, NOW)


def test_router_in_flight_cap_saturates_only_when_set() -> None:
    assert not saturated(worker(inflight=50), DEFAULTS, NOW)
    assert saturated(worker(inflight=4), Thresholds(max_inflight=4), NOW)
    assert not saturated(worker(inflight=3), Thresholds(max_inflight=4), NOW)


def test_queued_prefill_tokens_cap_counts_peers_too() -> None:
    cap = Thresholds(max_queued_prefill_tokens=8000)
    assert not saturated(worker(prefill=5000), cap, NOW)
    assert saturated(worker(prefill=5000, remote_prefill=3000), cap, NOW)
    assert not saturated(worker(prefill=10**6), DEFAULTS, NOW)


def test_the_prefill_cap_counts_the_new_requests_own_prompt() -> None:
    """Queued prefill plus the new prompt must fit under the cap; a worker with nothing
    left to prefill takes any prompt, however long."""
    cap = Thresholds(max_queued_prefill_tokens=2048)
    one_long = worker(prefill=2000)
    assert saturated(one_long, cap, NOW, prompt_tokens=2000)
    assert saturated(one_long, cap, NOW, prompt_tokens=100)
    assert not saturated(one_long, cap, NOW, prompt_tokens=48)
    assert not saturated(worker(prefill=0), cap, NOW, prompt_tokens=10**6)
    assert not saturated(worker(prefill=1000), cap, NOW, prompt_tokens=1000)
    assert saturated(worker(prefill=2048), cap, NOW)  # full, even for an empty prompt
    # a sibling contending halves this process's part
    assert saturated(worker(prefill=1000), cap, NOW, contenders=2, prompt_tokens=300)
    assert not saturated(worker(prefill=500), cap, NOW, contenders=2, prompt_tokens=500)


def test_a_prompt_past_a_processs_part_waits_for_every_process_to_drain() -> None:
    """Under contention a short prompt fits its process's part beside a sibling's queued
    prefill; a long one goes only to a worker with no process's prefill left."""
    cap = Thresholds(max_queued_prefill_tokens=2048)
    siblings = worker(prefill=0, remote_prefill=2000)
    assert not saturated(siblings, cap, NOW, contenders=2, prompt_tokens=100)
    assert saturated(siblings, cap, NOW, contenders=2, prompt_tokens=2000)
    assert not saturated(worker(prefill=0), cap, NOW, contenders=2, prompt_tokens=2000)


@pytest.mark.parametrize(
    "idle",
    [
        worker(inflight=0, waiting=50),
        worker(inflight=0, kv=1.0),
        worker(inflight=0, scraped_ago=3600.0),
        worker(inflight=0, prefill=10**6),
    ],
)
def test_a_worker_with_nothing_in_flight_is_never_saturated(idle: Worker) -> None:
    strict = Thresholds(queue_depth=0, kv_usage=0.0, max_inflight=1, max_queued_prefill_tokens=1)
    assert not saturated(idle, strict, NOW)


def test_a_never_scraped_worker_is_judged_on_router_counters_only() -> None:
    never = worker(inflight=3, waiting=None)
    assert never.engine is None
    assert not saturated(never, DEFAULTS, NOW)
    assert saturated(never, Thresholds(max_inflight=3), NOW)
    assert saturated(worker(waiting=None, prefill=9), Thresholds(max_queued_prefill_tokens=9), NOW)


def test_unhealthy_or_draining_workers_take_nothing_even_when_idle() -> None:
    sick = worker(inflight=0)
    sick.healthy = False
    leaving = worker(inflight=0)
    leaving.draining = True
    assert saturated(sick, DEFAULTS, NOW)
    assert saturated(leaving, DEFAULTS, NOW)


def test_a_short_prompt_joins_the_last_step_of_a_two_step_prompt() -> None:
    """A prompt of 2500 tokens leaves 1596 of its second 2048-token step empty: a short
    request put there has its first token with it, and adds no step."""
    cap = Thresholds(max_queued_prefill_tokens=2048)
    two_steps = worker(prefill=2500)
    assert not saturated(two_steps, cap, NOW, prompt_tokens=200)
    assert not saturated(two_steps, cap, NOW, contenders=2, prompt_tokens=200, turn=False)
    assert saturated(two_steps, cap, NOW, prompt_tokens=300)  # not short: it fills the step
    assert saturated(worker(prefill=4000), cap, NOW, prompt_tokens=200)  # adds a step
    assert saturated(worker(prefill=5000), cap, NOW, prompt_tokens=10)  # three steps queued
    assert saturated(worker(prefill=2048), cap, NOW, prompt_tokens=10)  # one full step
    strict = Thresholds(max_queued_prefill_tokens=2048, max_inflight=1)
    assert saturated(two_steps, strict, NOW, prompt_tokens=200)  # the other caps still hold


def test_while_siblings_wait_each_process_keeps_to_its_part_of_the_caps() -> None:
    cap = Thresholds(max_queued_prefill_tokens=8000, max_inflight=4)
    # this process holds 3000 of the worker's prefill, a sibling 1000: 4000 of 8000 in all
    shared = worker(inflight=2, prefill=3000, remote_prefill=1000)
    shared.local_inflight = 1
    assert not saturated(shared, cap, NOW, contenders=1)
    # two processes wait: this one's part is 4000 tokens and 2 requests
    assert not saturated(shared, cap, NOW, contenders=2)
    # three wait: its part is 2666 tokens, and it holds 3000 of them
    assert saturated(shared, cap, NOW, contenders=3, prompt_tokens=2000)
    # a short prompt needs only one step ahead of it, whatever the parts
    assert not saturated(shared, cap, NOW, contenders=3, prompt_tokens=200)
    # the sibling's share is not this process's: under its part, the total does not bind
    mine_small = worker(inflight=3, prefill=1000, remote_prefill=16000)
    mine_small.local_inflight = 1
    assert saturated(mine_small, cap, NOW, contenders=1)
    assert not saturated(mine_small, cap, NOW, contenders=2)
    many = worker(inflight=3, prefill=0)
    many.local_inflight = 2
    assert saturated(many, cap, NOW, contenders=2)


def test_a_short_prompt_needs_one_step_ahead_and_leaves_a_worker_drained() -> None:
    """A short prompt goes where at most one step of the cap is queued ahead of it, every
    process's prefill counted and no part, turn or stall of theirs applied: the engine
    starts it in its next step. It does not count against a drained worker either: a
    long prompt may go beside it, so short requests do not keep a flood from its turn."""
    cap = Thresholds(max_queued_prefill_tokens=4096)
    busy = worker(prefill=2500, remote_prefill=1000)
    for stall in (False, True):
        assert not saturated(
            busy, cap, NOW, contenders=3, prompt_tokens=300, turn=False, drained_only=stall
        )
    assert saturated(worker(prefill=2500, remote_prefill=1500), cap, NOW, prompt_tokens=300)
    short_only = worker(prefill=300, remote_prefill=200)
    assert not saturated(short_only, cap, NOW, prompt_tokens=4000)
    assert not saturated(short_only, cap, NOW, contenders=3, prompt_tokens=4000)
    assert saturated(short_only, cap, NOW, contenders=3, prompt_tokens=4000, turn=False)
    assert saturated(worker(prefill=600), cap, NOW, prompt_tokens=4000)  # a long one queued
