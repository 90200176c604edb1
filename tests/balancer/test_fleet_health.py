"""Health of the fleet against real stub engines: probes, circuit breaker, drain, removal."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, WorkerSpec
from switchyard.net.errors import ConnectError
from switchyard.net.httpclient import ConnectionPool
from tests.balancer.fleet_stubs import StubFactory, eventually

pytestmark = pytest.mark.timeout(30)

PROBE = 0.2
# One probe interval, plus the probe round trip and event-loop scheduling on a busy machine.
SLACK = 0.15


def fast(**overrides: object) -> BalancerSettings:
    values: dict[str, object] = dict(
        probe_interval_s=PROBE,
        probe_timeout_s=0.2,
        scrape_interval_s=0.2,
        model_refresh_interval_s=0.5,
        cb_open_timeout_s=0.3,
    )
    values.update(overrides)
    return BalancerSettings(**values)


async def started_fleet(settings: BalancerSettings, *urls: str) -> Fleet:
    fleet = Fleet(settings, [WorkerSpec(url) for url in urls])
    await fleet.start()
    await eventually(lambda: all(w.models for w in fleet.workers()))
    return fleet


async def test_models_are_learned_from_v1_models(stub_engine: StubFactory) -> None:
    stub = await stub_engine(models=("llama", "qwen"))
    fleet = await started_fleet(fast(), stub.url)
    try:
        assert fleet.models() == ["llama", "qwen"]
        assert fleet.has_model("qwen") and not fleet.has_model("other")
        assert [w.url for w in fleet.candidates("llama")] == [stub.url]
    finally:
        await fleet.stop()


async def test_worker_answering_5xx_stops_being_candidate_within_one_probe_interval(
    stub_engine: StubFactory,
) -> None:
    bad, good = await stub_engine(), await stub_engine()
    fleet = await started_fleet(fast(), bad.url, good.url)
    try:
        bad.health_status = 503
        took = await eventually(lambda: len(fleet.candidates("m")) == 1)
        assert took <= PROBE + SLACK
        assert [w.url for w in fleet.candidates("m")] == [good.url]
        assert fleet.get(bad.url).healthy is False
    finally:
        await fleet.stop()


async def test_worker_refusing_connections_stops_being_candidate_within_one_probe_interval(
    stub_engine: StubFactory,
) -> None:
    dead, good = await stub_engine(), await stub_engine()
    fleet = await started_fleet(fast(), dead.url, good.url)
    try:
        await dead.stop()
        took = await eventually(lambda: len(fleet.candidates("m")) == 1)
        assert took <= PROBE + SLACK
        assert fleet.get(dead.url).last_error is not None
    finally:
        await fleet.stop()


async def test_unhealthy_worker_returns_after_healthy_threshold_probes(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    fleet = await started_fleet(fast(healthy_threshold=2), stub.url)
    try:
        stub.health_status = 500
        await eventually(lambda: not fleet.candidates("m"))
        stub.health_status = 200
        took = await eventually(lambda: bool(fleet.candidates("m")))
        assert took >= PROBE * 0.9
    finally:
        await fleet.stop()


async def test_retrying_client_sees_no_errors_when_a_worker_dies(
    stub_engine: StubFactory,
) -> None:
    """A client that retries on connect errors (as the router does) never fails."""
    victim, survivor = await stub_engine(), await stub_engine()
    fleet = await started_fleet(fast(cb_failure_threshold=2), victim.url, survivor.url)
    errors = 0
    sent_to_victim_late = 0
    pool = ConnectionPool(connect_timeout_s=1.0)
    try:

        async def one(i: int) -> None:
            nonlocal errors, sent_to_victim_late
            for _attempt in range(3):
                candidates = fleet.candidates("m")
                worker = candidates[i % len(candidates)]
                if worker.url == victim.url and stop_at is not None:
                    if loop.time() - stop_at > PROBE:
                        sent_to_victim_late += 1
                ticket = fleet.begin(worker)
                try:
                    resp = await pool.get(worker.url + "/work")
                    try:
                        await resp.read()
                    finally:
                        resp.close()
                    fleet.end(ticket, Outcome.SUCCESS)
                    return
                except ConnectError:
                    fleet.end(ticket, Outcome.CONNECT_ERROR)
            errors += 1

        loop = asyncio.get_running_loop()
        stop_at: float | None = None
        for i in range(120):
            if i == 30:
                await victim.stop()
                stop_at = loop.time()
            await one(i)
            await asyncio.sleep(0.005)
        assert errors == 0
        assert sent_to_victim_late == 0
        assert survivor.hits > 90
    finally:
        await pool.close()
        await fleet.stop()


async def test_consecutive_failures_open_the_circuit(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    fleet = await started_fleet(fast(cb_failure_threshold=3, cb_open_timeout_s=10), stub.url)
    try:
        worker = fleet.get(stub.url)
        for _ in range(2):
            fleet.end(fleet.begin(worker), Outcome.SERVER_ERROR)
        assert worker.circuit == "closed"
        fleet.end(fleet.begin(worker), Outcome.TIMEOUT)
        assert worker.circuit == "open"
        assert fleet.candidates("m") == []
    finally:
        await fleet.stop()


async def test_success_in_between_resets_consecutive_failures(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    fleet = await started_fleet(fast(cb_failure_threshold=2), stub.url)
    try:
        worker = fleet.get(stub.url)
        for outcome in (Outcome.SERVER_ERROR, Outcome.SUCCESS, Outcome.SERVER_ERROR):
            fleet.end(fleet.begin(worker), outcome)
        assert worker.circuit == "closed"
    finally:
        await fleet.stop()


async def test_circuit_half_opens_after_timeout_and_closes_on_success(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    fleet = await started_fleet(fast(cb_failure_threshold=1, cb_open_timeout_s=0.3), stub.url)
    try:
        worker = fleet.get(stub.url)
        fleet.end(fleet.begin(worker), Outcome.SERVER_ERROR)
        assert worker.circuit == "open" and fleet.candidates("m") == []
        await asyncio.sleep(0.35)
        assert fleet.candidates("m") == [worker]
        assert worker.circuit == "half_open"
        trial = fleet.begin(worker)
        assert trial.trial
        assert fleet.candidates("m") == [], "only one trial request at a time"
        fleet.end(trial, Outcome.SUCCESS)
        assert worker.circuit == "closed"
        assert fleet.candidates("m") == [worker]
    finally:
        await fleet.stop()


async def test_failed_trial_reopens_the_circuit(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    fleet = await started_fleet(fast(cb_failure_threshold=1, cb_open_timeout_s=0.2), stub.url)
    try:
        worker = fleet.get(stub.url)
        fleet.end(fleet.begin(worker), Outcome.CONNECT_ERROR)
        await asyncio.sleep(0.25)
        assert fleet.candidates("m") == [worker]
        fleet.end(fleet.begin(worker), Outcome.SERVER_ERROR)
        assert worker.circuit == "open"
        assert fleet.candidates("m") == []
    finally:
        await fleet.stop()


async def test_client_abort_is_not_held_against_the_worker(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    fleet = await started_fleet(fast(cb_failure_threshold=1), stub.url)
    try:
        worker = fleet.get(stub.url)
        for _ in range(5):
            fleet.end(fleet.begin(worker), Outcome.CLIENT_ABORT)
        assert worker.circuit == "closed" and worker.inflight == 0
    finally:
        await fleet.stop()


async def test_drain_lets_inflight_finish_while_no_new_requests_arrive(
    stub_engine: StubFactory,
) -> None:
    slow, other = await stub_engine(), await stub_engine()
    slow.work_delay = 0.3
    fleet = await started_fleet(fast(), slow.url, other.url)
    try:
        worker = fleet.get(slow.url)
        ticket = fleet.begin(worker)
        pool = ConnectionPool(connect_timeout_s=1.0)
        pending = asyncio.create_task(pool.get(slow.url + "/work"))
        await asyncio.sleep(0.05)
        assert fleet.drain(slow.url)
        assert worker.draining
        assert [w.url for w in fleet.candidates("m")] == [other.url]
        resp = await pending
        assert resp.status == 200 and await resp.read() == b"done"
        await pool.close()
        fleet.end(ticket, Outcome.SUCCESS)
        assert worker.inflight == 0
        assert fleet.get(slow.url) is worker, "a plain drain keeps the worker listed"
        assert [w.url for w in fleet.candidates("m")] == [other.url]
    finally:
        await fleet.stop()


async def test_drain_with_remove_when_idle_removes_after_last_request(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    fleet = await started_fleet(fast(), stub.url)
    events: list[str] = []
    fleet.subscribe(lambda event, w: events.append(event))
    try:
        ticket = fleet.begin(fleet.get(stub.url))
        fleet.drain(stub.url, remove_when_idle=True)
        assert fleet.get(stub.url) is not None
        fleet.end(ticket, Outcome.SUCCESS)
        assert fleet.get(stub.url) is None
        assert events[-1] == "removed"
    finally:
        await fleet.stop()


async def test_removed_worker_is_no_candidate_and_is_no_longer_probed(
    stub_engine: StubFactory,
) -> None:
    gone, kept = await stub_engine(), await stub_engine()
    fleet = await started_fleet(fast(), gone.url, kept.url)
    try:
        assert fleet.remove(gone.url)
        assert [w.url for w in fleet.candidates("m")] == [kept.url]
        assert fleet.candidates(None) == [fleet.get(kept.url)]
        probes = gone.probes
        await asyncio.sleep(PROBE * 2)
        assert gone.probes == probes
        assert not fleet.remove(gone.url)
    finally:
        await fleet.stop()


async def test_outlier_ejection_is_capped_to_a_fraction_of_the_fleet(
    stub_engine: StubFactory,
) -> None:
    stubs = [await stub_engine() for _ in range(4)]
    settings = fast(
        cb_failure_threshold=1000,
        outlier_min_requests=10,
        outlier_error_rate=0.5,
        outlier_max_ejected_fraction=0.5,
        outlier_ejection_s=10,
    )
    fleet = await started_fleet(settings, *(s.url for s in stubs))
    try:
        for stub in stubs[:3]:
            worker = fleet.get(stub.url)
            for _ in range(10):
                fleet.end(fleet.begin(worker), Outcome.SERVER_ERROR)
        ejected = [w for w in fleet.workers() if w.ejected]
        assert len(ejected) == 2
        assert len(fleet.candidates("m")) == 2
    finally:
        await fleet.stop()


async def test_slow_start_weight_ramps_after_a_worker_joins(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    settings = fast(slow_start_s=0.5, slow_start_min_weight=0.2)
    fleet = await started_fleet(settings, stub.url)
    try:
        worker = fleet.get(stub.url)
        early = worker.load().weight
        assert early < 1.0
        await asyncio.sleep(0.55)
        assert worker.load().weight == 1.0
        ticket = fleet.begin(worker)
        assert worker.load().score == pytest.approx(1.0)
        fleet.end(ticket, Outcome.SUCCESS)
    finally:
        await fleet.stop()


async def test_ejected_worker_returns_after_ejection_time_with_slow_start(
    stub_engine: StubFactory,
) -> None:
    a, b = await stub_engine(), await stub_engine()
    settings = fast(
        cb_failure_threshold=1000,
        outlier_min_requests=5,
        outlier_ejection_s=0.3,
        slow_start_s=1.0,
    )
    fleet = await started_fleet(settings, a.url, b.url)
    try:
        await asyncio.sleep(1.0)
        worker = fleet.get(a.url)
        for _ in range(5):
            fleet.end(fleet.begin(worker), Outcome.SERVER_ERROR)
        assert worker.ejected and worker not in fleet.candidates("m")
        await eventually(lambda: worker in fleet.candidates("m"), timeout=1.0)
        assert worker.load().weight < 0.5, "a returning worker ramps up again"
    finally:
        await fleet.stop()


async def test_a_started_fleet_knows_its_workers_models(stub_engine: StubFactory) -> None:
    stub = await stub_engine(models=("served-model",))
    fleet = Fleet(BalancerSettings(), [WorkerSpec.parse(stub.url)])
    await fleet.start()
    try:
        assert [w.id for w in fleet.candidates("served-model")] == [stub.url]
    finally:
        await fleet.stop()


async def test_a_worker_that_does_not_answer_delays_the_start_by_its_probe_timeouts_at_most(
    stub_engine: StubFactory,
) -> None:
    unanswered = socket.socket()
    unanswered.bind(("127.0.0.1", 0))
    unanswered.listen()  # accepts connections, never answers
    url = f"http://127.0.0.1:{unanswered.getsockname()[1]}"
    fleet = Fleet(BalancerSettings(probe_timeout_s=0.3), [WorkerSpec.parse(url)])
    started = time.monotonic()
    try:
        await fleet.start()
        assert time.monotonic() - started < 0.3 * 2 + 0.5
    finally:
        await fleet.stop()
        unanswered.close()
