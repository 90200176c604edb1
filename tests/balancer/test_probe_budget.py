"""Probe and scrape cost stays bounded for large fleets; small fleets keep their intervals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.probe import busy, stretched
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import EngineSample, Outcome, Worker, WorkerSpec
from tests.balancer.fleet_stubs import StubEngine, eventually
from tests.router.stub_backend import StubReply, StubRequest

pytestmark = pytest.mark.timeout(30)

IDLE_VLLM = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


class CountingStub(StubEngine):
    """A stub engine that also counts its ``/metrics`` scrapes."""

    def __init__(self, metrics: str = IDLE_VLLM, health_delay_s: float = 0.0) -> None:
        super().__init__(("m",), metrics)
        self.scrapes = 0
        self.scraped_at: list[float] = []
        self.health_delay_s = health_delay_s

    async def _health(self, request: StubRequest) -> StubReply:
        await asyncio.sleep(self.health_delay_s)
        return await super()._health(request)

    async def _metrics(self, request: StubRequest) -> StubReply:
        self.scrapes += 1
        self.scraped_at.append(time.monotonic())
        return await super()._metrics(request)


@pytest.fixture
async def stub() -> AsyncIterator[CountingStub]:
    engine = CountingStub()
    await engine.start()
    yield engine
    await engine.stop()


def test_small_fleet_keeps_its_base_intervals() -> None:
    s = BalancerSettings()
    assert stretched(s, s.probe_interval_s, 8) == s.probe_interval_s
    assert stretched(s, s.scrape_interval_s, 8) == s.scrape_interval_s


def test_large_fleet_is_spread_over_the_budget() -> None:
    s = BalancerSettings(probe_budget_per_s=100.0)
    assert stretched(s, s.probe_interval_s, 2000) == 20.0
    assert stretched(s, s.scrape_interval_s, 2000) == 20.0


def test_stretched_interval_is_capped() -> None:
    s = BalancerSettings(probe_budget_per_s=100.0, probe_max_interval_s=30.0)
    assert stretched(s, s.probe_interval_s, 100_000) == 30.0


def test_worker_is_idle_only_without_requests_and_with_an_idle_scrape() -> None:
    worker = Worker(WorkerSpec("http://127.0.0.1:1"), BalancerSettings())
    worker.engine = EngineSample(running=0, waiting=0, kv_usage=0.0)
    assert not busy(worker)
    worker.sent_since_scrape = 1
    assert busy(worker)
    worker.sent_since_scrape = 0
    worker.engine = EngineSample(running=0, waiting=2, kv_usage=0.1)
    assert busy(worker), "another client's queued requests keep it busy"


def tiny_budget(**overrides: float) -> BalancerSettings:
    """One worker over a budget of 0.2/s: its intervals may stretch to 5 s."""
    values = {
        "probe_interval_s": 0.05,
        "probe_timeout_s": 0.5,
        "scrape_interval_s": 0.05,
        "probe_budget_per_s": 0.2,
        "probe_max_interval_s": 5.0,
    }
    values.update(overrides)
    return BalancerSettings.model_validate(values)


async def test_stable_worker_is_probed_less_and_less_often(stub: CountingStub) -> None:
    fleet = Fleet(tiny_budget(), [WorkerSpec(stub.url)])
    await fleet.start()
    try:
        await asyncio.sleep(1.2)
        probes = stub.probes
    finally:
        await fleet.stop()
    assert 2 <= probes <= 8, "0.05 s doubling: about 5 probes in 1.2 s, not 24"


async def test_worker_within_budget_is_probed_at_the_base_interval(stub: CountingStub) -> None:
    fleet = Fleet(tiny_budget(probe_budget_per_s=1000.0), [WorkerSpec(stub.url)])
    await fleet.start()
    try:
        await asyncio.sleep(1.2)
        probes = stub.probes
    finally:
        await fleet.stop()
    assert probes >= 10, "0.05 s interval: about 24 probes in 1.2 s"


async def test_connect_error_probes_a_backed_off_worker_at_once(stub: CountingStub) -> None:
    fleet = Fleet(tiny_budget(), [WorkerSpec(stub.url)])
    await fleet.start()
    try:
        await asyncio.sleep(1.0)  # the interval has grown past 0.4 s
        worker = fleet.get(stub.url)
        assert worker is not None
        before = stub.probes
        fleet.end(fleet.begin(worker), Outcome.CONNECT_ERROR)
        took = await eventually(lambda: stub.probes > before, timeout=2.0)
    finally:
        await fleet.stop()
    assert took < 0.3


async def test_idle_worker_is_scraped_rarely_and_at_once_when_sent_a_request(
    stub: CountingStub,
) -> None:
    fleet = Fleet(tiny_budget(), [WorkerSpec(stub.url)])
    await fleet.start()
    try:
        worker = fleet.get(stub.url)
        assert worker is not None
        await eventually(lambda: worker.scraped_at is not None)
        await asyncio.sleep(1.0)
        idle_scrapes = stub.scrapes
        ticket = fleet.begin(worker)
        took = await eventually(lambda: stub.scrapes > idle_scrapes, timeout=2.0)
        fleet.end(ticket, Outcome.SUCCESS)
    finally:
        await fleet.stop()
    assert idle_scrapes <= 2, "an idle worker's scrape stretches to 5 s, not every 0.05 s"
    assert took < 0.3


async def test_probes_waiting_for_a_connection_slot_do_not_time_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three workers answering in 0.3 s, one probe at a time, a 0.5 s timeout: the third
    probe waits 0.6 s for its turn, which must not count against its timeout."""
    monkeypatch.setattr("switchyard.balancer.probe._MAX_CONNECTIONS", 1)
    stubs = [CountingStub(health_delay_s=0.3) for _ in range(3)]
    for engine in stubs:
        await engine.start()
    settings = BalancerSettings(probe_interval_s=5.0, probe_timeout_s=0.5, scrape_interval_s=5.0)
    fleet = Fleet(settings, [WorkerSpec(engine.url) for engine in stubs])
    await fleet.start()
    try:
        await eventually(lambda: all(engine.probes >= 1 for engine in stubs), timeout=5.0)
        await asyncio.sleep(0.1)
        unhealthy = [w.url for w in fleet.workers() if not w.healthy]
    finally:
        await fleet.stop()
        for engine in stubs:
            await engine.stop()
    assert unhealthy == []


async def test_a_small_fleets_workers_are_scraped_together_on_one_grid() -> None:
    """One wake-up of the loop serves every worker: each scrape after the first falls just
    after a multiple of the interval, the same one for every worker (jittered by ±10%
    they would spread over ±100 ms)."""
    stubs = [CountingStub() for _ in range(3)]
    for engine in stubs:
        await engine.start()
    settings = BalancerSettings(probe_interval_s=2.0, scrape_interval_s=1.0)
    fleet = Fleet(settings, [WorkerSpec(engine.url) for engine in stubs])
    await fleet.start()
    try:
        await asyncio.sleep(3.3)
    finally:
        await fleet.stop()
        for engine in stubs:
            await engine.stop()
    later = [engine.scraped_at[1:] for engine in stubs]
    assert all(len(times) >= 2 for times in later)
    for times in later:
        assert all(t % 1.0 < 0.04 for t in times), times
    grid = [{round(t) for t in times} for times in later]
    assert grid[0] & grid[1] & grid[2], "the workers share their grid points"
