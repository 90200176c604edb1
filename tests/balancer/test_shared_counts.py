"""Fleets in one process sharing a real redis-server: counts, leases, and Redis outages."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, WorkerSpec
from tests.balancer.fleet_stubs import StubFactory, eventually
from tests.support import free_port, redis_server

pytestmark = pytest.mark.timeout(30)


def shared_fleet(redis_url: str, worker_url: str) -> Fleet:
    settings = BalancerSettings(redis_url=redis_url, sync_interval_s=0.05, lease_s=0.5)
    return Fleet(settings, [WorkerSpec.parse(f"{worker_url};dp=2;models=m")])


async def test_peer_rank_counts_add_to_the_local_view(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    with redis_server() as (url, _):
        a, b = shared_fleet(url, stub.url), shared_fleet(url, stub.url)
        await a.start()
        await b.start()
        try:
            wa, wb = a.workers()[0], b.workers()[0]
            ticket = a.begin(wa, prompt_tokens=700, dp_rank=1)
            await eventually(lambda: wb.inflight == 1)
            assert wb.local_inflight == 0
            assert wb.rank_loads()[1].prefill_tokens == 700
            assert b.choose_rank(wb, prompt_tokens=10) == 0, "b avoids the rank a loaded"
            a.end(ticket, Outcome.SUCCESS)
            await eventually(lambda: wb.inflight == 0)
        finally:
            await a.stop()
            await b.stop()


async def test_fleet_runs_local_only_while_redis_is_down_and_joins_when_it_is_up(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    a, b = shared_fleet(url, stub.url), shared_fleet(url, stub.url)
    await a.start()
    await b.start()
    try:
        wa, wb = a.workers()[0], b.workers()[0]
        ticket = a.begin(wa)
        assert a.candidates("m") == [wa] and wa.inflight == 1
        with redis_server(port):
            await eventually(lambda: wb.inflight == 1, timeout=10)
            a.end(ticket, Outcome.SUCCESS)
            await eventually(lambda: wb.inflight == 0)
        await asyncio.sleep(0.2)
        assert b.candidates("m") == [wb]
    finally:
        await a.stop()
        await b.stop()
