"""`switchyard balancer` as real processes: picks, tickets, admin, metrics, Redis sharing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi.testclient import TestClient

from switchyard.balancer.remote import RemoteFleet
from switchyard.balancer.service import MAX_PROMPT_TOKENS, create_app
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, WorkerSpec
from tests.balancer.fleet_stubs import StubEngine, StubFactory
from tests.support import Server, eventually_async, free_port, redis_server

pytestmark = pytest.mark.timeout(60)

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(autouse=True)
def admin_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every balancer started here has the admin API on (it is off without a key)."""
    monkeypatch.setenv("SWITCHYARD_BALANCER_ADMIN_API_KEY", KEY)


@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_server() as (url, _proc):
        yield url


@asynccontextmanager
async def balancer(*args: str) -> AsyncIterator[Server]:
    port = free_port()
    server = Server(
        ["balancer", "--port", str(port), "--probe-interval", "0.2", *args],
        port,
    )
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


async def workers(client: httpx.AsyncClient, server: Server) -> dict[str, dict]:
    resp = await client.get(server.url + "/v1/workers")
    resp.raise_for_status()
    return {w["id"]: w for w in resp.json()["workers"]}


def shared(redis_url: str) -> tuple[str, ...]:
    return ("--redis", redis_url, "--sync-interval", "0.1", "--lease-seconds", "1")


async def test_pick_counts_the_request_until_its_ticket_ends(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    async with balancer("--worker", stub.url) as svc, httpx.AsyncClient() as client:
        await eventually_async(lambda: _has_models(client, svc, stub), 5.0, 0.05)
        pick = (await client.post(svc.url + "/v1/pick", json={"model": "m"})).json()
        assert pick["url"] == stub.url and pick["rank"] is None and pick["ticket"]
        assert (await workers(client, svc))[stub.url]["inflight"] == 1
        end = await client.post(
            f"{svc.url}/v1/tickets/{pick['ticket']}/end", json={"outcome": "success"}
        )
        assert end.status_code == 200
        assert (await workers(client, svc))[stub.url]["inflight"] == 0
        missing = await client.post(svc.url + "/v1/pick", json={"model": "nope"})
        assert missing.status_code == 503
        retry = await client.post(svc.url + "/v1/pick", json={"model": "m", "exclude": [stub.url]})
        assert retry.status_code == 503, "a retry can exclude the worker that failed"


async def _has_models(client: httpx.AsyncClient, svc: Server, stub: StubEngine) -> bool:
    return (await workers(client, svc)).get(stub.url, {}).get("models") == stub.models


async def test_pick_spreads_requests_over_dp_ranks_with_the_rank_header(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    async with balancer("--worker", f"{stub.url};dp=4;models=m") as svc:
        async with httpx.AsyncClient() as client:
            picks = [
                (await client.post(svc.url + "/v1/pick", json={"prompt_tokens": 100})).json()
                for _ in range(4)
            ]
            assert sorted(p["rank"] for p in picks) == [0, 1, 2, 3]
            assert all(p["headers"] == {"X-data-parallel-rank": str(p["rank"])} for p in picks)
            ranks = (await workers(client, svc))[stub.url]["ranks"]
            assert [r["inflight"] for r in ranks] == [1, 1, 1, 1]


async def test_a_worker_added_then_drained_through_the_admin_api_is_not_picked(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    async with balancer() as svc, httpx.AsyncClient() as client:
        body = {"url": f"{stub.url};models=m"}
        added = await client.post(svc.url + "/admin/workers", json=body, headers=AUTH)
        assert added.status_code == 201 and added.json()["id"] == stub.url
        await eventually_async(lambda: _has_models(client, svc, stub), 5.0, 0.05)
        assert (await client.post(svc.url + "/v1/pick", json={"model": "m"})).status_code == 200
        drain = {"url": stub.url}
        await client.post(svc.url + "/admin/workers/drain", params=drain, headers=AUTH)
        assert (await client.post(svc.url + "/v1/pick", json={"model": "m"})).status_code == 503
        removed = await client.delete(svc.url + "/admin/workers", params=drain, headers=AUTH)
        assert removed.json() == {"removed": stub.url}
        assert await workers(client, svc) == {}


async def test_metrics_expose_worker_and_rank_gauges(stub_engine: StubFactory) -> None:
    stub = await stub_engine()
    async with balancer("--worker", f"{stub.url};dp=2;models=m") as svc:
        async with httpx.AsyncClient() as client:
            await client.post(svc.url + "/v1/pick", json={"model": "m", "prompt_tokens": 7})
            text = (await client.get(svc.url + "/metrics")).text
    assert f'switchyard_balancer_worker_inflight{{role="unified",worker="{stub.url}"}} 1.0' in text
    assert "switchyard_balancer_rank_tokens" in text


async def test_two_balancers_sharing_redis_see_each_others_inflight_counts(
    stub_engine: StubFactory, redis_url: str
) -> None:
    stub = await stub_engine()
    worker = f"{stub.url};dp=2;models=m"
    async with (
        balancer("--worker", worker, *shared(redis_url)) as a,
        balancer("--worker", worker, *shared(redis_url)) as b,
        httpx.AsyncClient() as client,
    ):
        tickets = [
            (await client.post(a.url + "/v1/pick", json={"model": "m"})).json()["ticket"]
            for _ in range(3)
        ]

        async def b_sees(n: int) -> bool:
            w = (await workers(client, b))[stub.url]
            return w["inflight"] == n and w["local_inflight"] == 0

        await eventually_async(lambda: b_sees(3), 5.0, 0.05)
        await client.post(f"{a.url}/v1/tickets/{tickets[0]}/end", json={"outcome": "success"})
        await eventually_async(lambda: b_sees(2), 5.0, 0.05)
        pick = (await client.post(b.url + "/v1/pick", json={"model": "m"})).json()
        ranks_a = {r["rank"]: r["inflight"] for r in (await workers(client, a))[stub.url]["ranks"]}
        assert sum(ranks_a.values()) >= 2
        assert pick["ticket"]


async def test_a_crashed_balancers_counts_expire_with_its_lease(
    stub_engine: StubFactory, redis_url: str
) -> None:
    stub = await stub_engine()
    worker = f"{stub.url};models=m"
    async with (
        balancer("--worker", worker, *shared(redis_url)) as a,
        balancer("--worker", worker, *shared(redis_url)) as b,
        httpx.AsyncClient() as client,
    ):
        for _ in range(4):
            await client.post(a.url + "/v1/pick", json={"model": "m"})

        async def b_sees(n: int) -> bool:
            return (await workers(client, b))[stub.url]["inflight"] == n

        await eventually_async(lambda: b_sees(4), 5.0, 0.05)
        await asyncio.to_thread(a.kill)
        loop = asyncio.get_running_loop()
        killed = loop.time()
        await eventually_async(lambda: b_sees(0), 5.0, 0.05)
        assert loop.time() - killed <= 1.0 + 1.0, "one lease (1 s) plus sync and scheduling slack"


async def test_admin_changes_reach_every_balancer_sharing_redis(
    stub_engine: StubFactory, redis_url: str
) -> None:
    stub = await stub_engine()
    async with (
        balancer(*shared(redis_url)) as a,
        balancer(*shared(redis_url)) as b,
        httpx.AsyncClient() as client,
    ):
        await client.post(a.url + "/admin/workers", json={"url": stub.url}, headers=AUTH)

        async def listed(server: Server, present: bool) -> bool:
            return (stub.url in await workers(client, server)) is present

        await eventually_async(lambda: listed(b, True), 5.0, 0.05)
        async with balancer(*shared(redis_url)) as late:
            assert await listed(late, True), "a new replica loads admin-added workers"
        await client.delete(b.url + "/admin/workers", params={"url": stub.url}, headers=AUTH)
        await eventually_async(lambda: listed(a, False), 5.0, 0.05)


async def test_remote_fleet_routes_from_the_service_and_reports_tickets(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    async with balancer("--worker", f"{stub.url};dp=2;models=m") as svc:
        fleet = RemoteFleet(svc.url, api_key=KEY, refresh_interval=0.1)
        await fleet.start()
        try:
            assert fleet.models() == ["m"]
            (worker,) = fleet.candidates("m")
            rank = fleet.choose_rank(worker, prompt_tokens=10)
            ticket = fleet.begin(worker, prompt_tokens=10, dp_rank=rank)
            fleet.first_token(ticket)
            async with httpx.AsyncClient() as client:
                await eventually_async(lambda: _inflight(client, svc, stub.url, 1), 5.0, 0.05)
                fleet.end(ticket, Outcome.SUCCESS)
                await eventually_async(lambda: _inflight(client, svc, stub.url, 0), 5.0, 0.05)
                fleet.drain(worker.id)
                await eventually_async(lambda: _draining(client, svc, stub.url), 5.0, 0.05)
            await asyncio.sleep(0.3)
            assert fleet.candidates("m") == []
        finally:
            await fleet.stop()


async def _inflight(client: httpx.AsyncClient, svc: Server, url: str, n: int) -> bool:
    return (await workers(client, svc))[url]["inflight"] == n


async def _draining(client: httpx.AsyncClient, svc: Server, url: str) -> bool:
    return bool((await workers(client, svc))[url]["draining"])


async def test_remote_fleet_registers_workers_added_before_start(
    stub_engine: StubFactory,
) -> None:
    stub = await stub_engine()
    async with balancer() as svc:
        fleet = RemoteFleet(svc.url, api_key=KEY, refresh_interval=0.1)
        fleet.add(WorkerSpec.parse(f"{stub.url};models=m"))
        await fleet.start()
        try:
            assert [w.url for w in fleet.candidates("m")] == [stub.url]
            async with httpx.AsyncClient() as client:
                assert stub.url in await workers(client, svc)
        finally:
            await fleet.stop()


# -- numeric inputs are bounded ------------------------------------------------------------

WORKER = "http://127.0.0.1:9"


@pytest.fixture
def service() -> Iterator[TestClient]:
    settings = BalancerSettings.load(None, workers=[f"{WORKER};dp=2"])
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client


def bad_request(resp: httpx.Response, param: str) -> str:
    """The param a 400 in OpenAI shape names (and fails on any other answer)."""
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    return str(error["param"])


@pytest.mark.parametrize("tokens", [10**29, -5, MAX_PROMPT_TOKENS + 1])
def test_prompt_tokens_outside_their_bounds_are_a_400(service: TestClient, tokens: int) -> None:
    ticket = {"worker_id": WORKER, "prompt_tokens": tokens}
    named = [
        bad_request(service.post("/v1/pick", json={"prompt_tokens": tokens}), "prompt_tokens"),
        bad_request(service.post("/v1/tickets", json=ticket), "prompt_tokens"),
    ]
    assert named == ["prompt_tokens", "prompt_tokens"]


def test_a_ticket_for_a_rank_the_worker_does_not_have_is_a_400(service: TestClient) -> None:
    bad_request(service.post("/v1/tickets", json={"worker_id": WORKER, "rank": 2}), "rank")
    bad_request(service.post("/v1/tickets", json={"worker_id": WORKER, "rank": -1}), "rank")
    assert service.post("/v1/tickets", json={"worker_id": WORKER, "rank": 1}).status_code == 200


def test_tickets_need_the_data_key_when_one_is_set() -> None:
    settings = BalancerSettings.load(None, workers=[WORKER], api_key="reader")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        assert client.post("/v1/tickets", json={"worker_id": WORKER}).status_code == 401
        reader = {"Authorization": "Bearer reader"}
        opened = client.post("/v1/tickets", json={"worker_id": WORKER}, headers=reader)
        assert opened.status_code == 200
