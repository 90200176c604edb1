"""RemoteFleet: a FleetView over a balancer service, which it composes rather than inherits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import orjson
import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.remote import RemoteFleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.view import FleetView
from switchyard.balancer.worker import Outcome, Worker, WorkerSpec
from tests.balancer.fleet_stubs import StubFactory, eventually
from tests.router.stub_backend import StubBackend, StubReply, StubRequest

pytestmark = pytest.mark.timeout(30)


class StubService:
    """A balancer service that lists ``listed`` and records every call it gets."""

    def __init__(self) -> None:
        self.listed: list[Worker] = []
        self.calls: list[tuple[str, str, dict[str, str]]] = []
        self.keys: list[str | None] = []  # the authorization of each call, listings too
        self.bodies: list[bytes] = []
        self.report_status = 200
        self._server = StubBackend(self._route)

    @property
    def url(self) -> str:
        return self._server.url

    async def _route(self, request: StubRequest) -> StubReply:
        self.keys.append(request.headers.get("authorization"))
        if request.method == "GET" and request.path == "/v1/workers":
            return StubReply.json({"workers": [w.describe() for w in self.listed]})
        self.calls.append((request.method, request.path, request.query))
        self.bodies.append(request.body)
        return StubReply.json({}, self.report_status)

    async def start(self) -> None:
        await self._server.open()

    async def stop(self) -> None:
        await self._server.close()


@pytest.fixture
async def service() -> AsyncIterator[StubService]:
    svc = StubService()
    await svc.start()
    yield svc
    await svc.stop()


def _listing(url: str) -> Worker:
    return Worker(WorkerSpec(url, models=["m"]), BalancerSettings())


def routable_ids(fleet: FleetView, model: str) -> list[str]:
    """What the router asks of any fleet; typed, so mypy checks RemoteFleet against FleetView."""
    return [w.id for w in fleet.candidates(model)]


async def test_remote_fleet_forwards_undrain_to_the_service(service: StubService) -> None:
    service.listed = [_listing("http://w:1")]
    fleet = RemoteFleet(service.url, refresh_interval=60)
    await fleet.start()
    try:
        fleet.drain("http://w:1")
        assert fleet.undrain("http://w:1")
        undrain = ("POST", "/admin/workers/undrain", {"url": "http://w:1"})
        await eventually(lambda: undrain in service.calls)
    finally:
        await fleet.stop()


async def test_remote_fleet_is_no_fleet_subclass_but_routes_as_a_fleet_view(
    service: StubService,
) -> None:
    service.listed = [_listing("http://w:1")]
    fleet = RemoteFleet(service.url, refresh_interval=60)
    assert not isinstance(fleet, Fleet)
    await fleet.start()
    try:
        assert routable_ids(fleet, "m") == ["http://w:1"]
        (worker,) = fleet.candidates("m")
        ticket = fleet.begin(worker, prompt_tokens=5)
        assert worker.inflight == 1
        fleet.end(ticket, Outcome.SUCCESS)
        assert worker.inflight == 0
        ended: tuple[str, str, dict[str, str]] = ("POST", f"/v1/tickets/{ticket.id}/end", {})
        await eventually(lambda: ended in service.calls)
    finally:
        await fleet.stop()


async def test_remote_fleet_leaves_probing_to_the_service(
    service: StubService, stub_engine: StubFactory
) -> None:
    engine = await stub_engine()
    service.listed = [_listing(engine.url)]
    settings = BalancerSettings.model_validate({"probe_interval": 0.05})
    fleet = RemoteFleet(service.url, refresh_interval=0.05, settings=settings)
    await fleet.start()
    try:
        await asyncio.sleep(0.3)  # six probe intervals
        assert routable_ids(fleet, "m") == [engine.url]
        assert engine.probes == 0
    finally:
        await fleet.stop()


async def test_every_call_to_the_service_carries_the_key_listings_included(
    service: StubService,
) -> None:
    service.listed = [_listing("http://w:1")]
    fleet = RemoteFleet(service.url, api_key="k", refresh_interval=60)
    await fleet.start()
    try:
        (worker,) = fleet.candidates("m")
        fleet.end(fleet.begin(worker, prompt_tokens=7), Outcome.SUCCESS)
        await eventually(lambda: len(service.calls) == 2)
    finally:
        await fleet.stop()
    assert service.keys == ["Bearer k"] * 3
    begun = orjson.loads(service.bodies[0])
    assert (begun["worker_id"], begun["prompt_tokens"]) == ("http://w:1", 7)
    assert orjson.loads(service.bodies[1]) == {"outcome": "success"}


async def test_reports_the_service_refuses_are_logged_and_routing_goes_on(
    service: StubService, caplog: pytest.LogCaptureFixture
) -> None:
    service.listed = [_listing("http://w:1")]
    service.report_status = 503
    fleet = RemoteFleet(service.url, refresh_interval=60)
    await fleet.start()
    try:
        (worker,) = fleet.candidates("m")
        with caplog.at_level(logging.WARNING, "switchyard.balancer.remote"):
            ticket = fleet.begin(worker)
            await eventually(lambda: "HTTP 503" in caplog.text)
        assert "POST /v1/tickets" in caplog.text
        fleet.end(ticket, Outcome.SUCCESS)
        assert routable_ids(fleet, "m") == ["http://w:1"]
    finally:
        await fleet.stop()


async def test_a_service_gone_leaves_the_mirror_as_it_was_and_is_logged(
    service: StubService, caplog: pytest.LogCaptureFixture
) -> None:
    service.listed = [_listing("http://w:1")]
    fleet = RemoteFleet(service.url, refresh_interval=0.01)
    await fleet.start()
    try:
        with caplog.at_level(logging.WARNING, "switchyard.balancer.remote"):
            await service.stop()
            await eventually(lambda: "unreachable" in caplog.text)
        assert routable_ids(fleet, "m") == ["http://w:1"]
    finally:
        await fleet.stop()
