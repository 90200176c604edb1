"""The router's scaling signals on /metrics, in-process: spare workers, the share saturated
and what waits in the queue, per model; what an autoscaler (KEDA, an HPA through
prometheus-adapter) reads. One stub worker is saturated by a router-side cap of one
request in flight and holds each request until the test lets it finish."""

from __future__ import annotations

import asyncio

import pytest

from tests.router.flow.test_flow_router import flow_of, saturated_router, send
from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend
from tests.support import eventually_async, metric

pytestmark = pytest.mark.timeout(60)

MODEL = {"model": "stub-model", "role": "unified"}


async def scrape(router: InProcessRouter) -> str:
    answer = await router.get("/metrics")
    assert answer.status_code == 200
    return answer.text


async def test_an_idle_worker_is_spare_capacity_and_nothing_waits() -> None:
    async with saturated_router() as (router, _worker):
        text = await scrape(router)
    assert metric(text, "switchyard_router_routable_workers") == 1
    assert metric(text, "switchyard_router_model_workers", **MODEL) == 1
    assert metric(text, "switchyard_router_model_free_workers", **MODEL) == 1
    assert metric(text, "switchyard_router_model_saturation", **MODEL) == 0
    assert metric(text, "switchyard_router_model_queued", model="stub-model") == 0
    assert metric(text, "switchyard_router_model_queue_oldest_seconds", model="stub-model") == 0


async def test_a_saturated_fleet_shows_no_spare_worker_and_its_queue_and_oldest_wait() -> None:
    async with saturated_router() as (router, worker):
        first = send(router, "a")
        await worker.reached("a")  # in flight: the worker is at its cap of one
        second, third = send(router, "b"), send(router, "c")
        flow = flow_of(router)
        await eventually_async(lambda: flow.queue.size == 2)
        (count, enqueued_at) = flow.queue.by_model()["stub-model"]
        real_clock = flow.clock
        flow.clock = lambda: enqueued_at + 7.5  # the first waiter has waited 7.5 s
        try:
            text = await scrape(router)
        finally:
            flow.clock = real_clock
        assert count == 2
        assert metric(text, "switchyard_router_model_free_workers", **MODEL) == 0
        assert metric(text, "switchyard_router_model_saturation", **MODEL) == 1
        assert metric(text, "switchyard_router_model_queued", model="stub-model") == 2
        oldest = metric(text, "switchyard_router_model_queue_oldest_seconds", model="stub-model")
        assert oldest == 7.5
        # the router still takes requests: saturated is not unroutable
        assert metric(text, "switchyard_router_routable_workers") == 1
        for name in ("a", "b", "c"):
            await worker.finish(name)
        answers = await asyncio.gather(first, second, third)
        assert [a.status_code for a in answers] == [200, 200, 200]
        text = await scrape(router)
    assert metric(text, "switchyard_router_model_queued", model="stub-model") == 0
    assert metric(text, "switchyard_router_model_free_workers", **MODEL) == 1


async def test_without_flow_control_saturation_is_still_measured_and_no_queue_is_shown() -> None:
    stub = StubBackend()
    config = {"router": {"flow": {"enabled": False}}}
    async with stub, running_router(stub.url, config=config) as router:
        text = await scrape(router)
    assert metric(text, "switchyard_router_model_free_workers", **MODEL) == 1
    assert "switchyard_router_model_queued" not in text


async def test_a_router_whose_only_worker_is_down_counts_none_routable() -> None:
    stub = StubBackend()
    async with stub, running_router(stub.url) as router:
        app = router.app
        (worker,) = app.fleet.workers()
        worker.healthy = False
        text = await scrape(router)
        ready = await router.get("/ready")
    assert metric(text, "switchyard_router_routable_workers") == 0
    assert ready.status_code == 503
    assert metric(text, "switchyard_router_model_saturation", **MODEL) == 1
    assert metric(text, "switchyard_router_model_free_workers", **MODEL) == 0
