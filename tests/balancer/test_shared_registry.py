"""Admin changes to the registry reach every router sharing a real redis-server."""

from __future__ import annotations

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import WorkerSpec
from tests.balancer.fleet_stubs import StubFactory, eventually
from tests.support import redis_server

pytestmark = pytest.mark.timeout(30)


async def _drained_on_both(url: str, worker_url: str) -> tuple[Fleet, Fleet]:
    """Two started routers sharing ``url``; ``a`` added ``worker_url`` and drained it."""
    a, b = Fleet(BalancerSettings(redis_url=url)), Fleet(BalancerSettings(redis_url=url))
    await a.start()
    await b.start()
    a.add(WorkerSpec.parse(f"{worker_url};models=m"), source="admin")
    await eventually(lambda: b.get(worker_url) is not None)
    a.drain(worker_url)
    await eventually(lambda: b.candidates("m") == [])
    return a, b


async def test_undrain_reaches_another_router_through_redis(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    with redis_server() as (url, _):
        a, b = await _drained_on_both(url, stub.url)
        try:
            a.undrain(stub.url)
            await eventually(lambda: [w.id for w in b.candidates("m")] == [stub.url])
        finally:
            await a.stop()
            await b.stop()


async def test_a_router_started_after_an_undrain_knows_the_worker(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    with redis_server() as (url, _):
        a, b = await _drained_on_both(url, stub.url)
        a.undrain(stub.url)
        late = Fleet(BalancerSettings(redis_url=url))
        try:
            await eventually(lambda: bool(b.candidates("m")))
            await late.start()
            assert [w.id for w in late.candidates("m")] == [stub.url]
        finally:
            await late.stop()
            await a.stop()
            await b.stop()
