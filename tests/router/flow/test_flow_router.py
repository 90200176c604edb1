"""Flow control in the router, in-process: while every worker is saturated requests wait in
the router and leave it by priority band, then by the tenants' fair share; refusals are
429/503 answers with a reason header. One stub worker is saturated by a router-side cap of
one request in flight (``max_inflight_per_worker``), and holds each request until the test
lets it finish, so the order requests reach it is the order flow control dispatched them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from switchyard.router.app import RouterApp
from tests.router.inprocess import InProcessRouter, running_router
from tests.router.stub_backend import StubBackend, StubReply, StubRequest
from tests.support import eventually_async, metric

pytestmark = pytest.mark.timeout(60)

KEYS = "flood:key-f,quiet:key-q"
USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


class HeldWorker:
    """A worker that records who reached it and answers each request when told to."""

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.priorities: dict[str, object] = {}  # the body's ``priority`` field, if any
        self.held: dict[str, asyncio.Event] = {}
        self.stub = StubBackend(self.route)

    async def route(self, request: StubRequest) -> StubReply | None:
        if request.method != "POST" or request.path != "/v1/completions":
            return None
        body = request.json()
        name = body["prompt"]
        self.arrived.append(name)
        self.priorities[name] = body.get("priority")
        gate = self.held[name] = asyncio.Event()
        await gate.wait()
        answer = {"id": name, "object": "text_completion", "choices": [], "usage": USAGE}
        return StubReply.json(answer)

    async def reached(self, name: str) -> None:
        await eventually_async(lambda: name in self.held, message=f"{name} never arrived")

    async def finish(self, name: str) -> None:
        """Answer ``name`` (waiting for it to arrive first)."""
        await self.reached(name)
        self.held[name].set()


@contextlib.asynccontextmanager
async def saturated_router(
    flow: dict[str, Any] | None = None, **router: Any
) -> AsyncIterator[tuple[InProcessRouter, HeldWorker]]:
    worker = HeldWorker()
    config = {"router": {"flow": {"max_inflight_per_worker": 1, **(flow or {})}, **router}}
    async with worker.stub, running_router(worker.stub.url, config=config, api_key=KEYS) as r:
        yield r, worker


def flow_of(router: InProcessRouter) -> Any:
    app = router.app
    assert isinstance(app, RouterApp) and app.flow is not None
    return app.flow


def send(
    router: InProcessRouter,
    name: str,
    key: str = "key-f",
    priority: int | None = None,
    **headers: str,
) -> asyncio.Task[httpx.Response]:
    body: dict[str, Any] = {"model": "stub-model", "prompt": name, "max_tokens": 5}
    if priority is not None:
        body["priority"] = priority
    headers = {"authorization": f"Bearer {key}", **headers}
    return asyncio.create_task(router.post("/v1/completions", json=body, headers=headers))


async def queued(router: InProcessRouter, count: int) -> None:
    flow = flow_of(router)
    await eventually_async(lambda: flow.queue.size == count, message=f"never {count} queued")


async def finish_in_turn(worker: HeldWorker, count: int) -> None:
    """Answer requests one by one in the order they reach the worker, ``count`` in all."""
    for index in range(count):
        await eventually_async(lambda i=index: len(worker.arrived) > i)
        await worker.finish(worker.arrived[index])


def refused(resp: httpx.Response, status: int, reason: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["x-switchyard-reason"] == reason
    assert resp.json()["error"]["code"] == reason


async def test_requests_pass_straight_through_while_no_worker_is_saturated() -> None:
    worker = HeldWorker()
    async with worker.stub, running_router(worker.stub.url, api_key=KEYS) as router:
        tasks = [send(router, f"r{i}") for i in range(4)]
        for i in range(4):
            await worker.reached(f"r{i}")  # all four at the worker at once: none waited
        assert flow_of(router).queue.size == 0
        for i in range(4):
            await worker.finish(f"r{i}")
        statuses = [(await task).status_code for task in tasks]
        text = (await router.get("/metrics")).text
    assert statuses == [200] * 4
    assert metric(text, "switchyard_router_flow_outcomes_total", outcome="dispatched") == 0
    assert "switchyard_router_flow_queued{" not in text
    served = metric(text, "switchyard_router_flow_served_tokens_total", tenant="flood")
    assert served == 4 * (USAGE["prompt_tokens"] + USAGE["completion_tokens"])


async def test_a_quiet_tenant_goes_before_a_flooding_tenants_backlog() -> None:
    async with saturated_router() as (router, worker):
        tasks = [send(router, "f0")]
        await worker.reached("f0")
        for i in range(1, 5):
            tasks.append(send(router, f"f{i}"))
            await queued(router, i)
        tasks.append(send(router, "q0", key="key-q"))
        await queued(router, 5)
        text = (await router.get("/metrics")).text
        assert metric(text, "switchyard_router_flow_queued", tenant="flood", band="0") == 4
        assert metric(text, "switchyard_router_flow_saturated_models", model="stub-model") == 1
        await finish_in_turn(worker, 6)
        statuses = [(await task).status_code for task in tasks]
        text = (await router.get("/metrics")).text
    assert worker.arrived == ["f0", "q0", "f1", "f2", "f3", "f4"]
    assert statuses == [200] * 6
    assert metric(text, "switchyard_router_flow_outcomes_total", outcome="dispatched") == 5
    assert metric(text, "switchyard_router_flow_queue_wait_seconds_count", band="0") == 5


async def test_a_high_priority_request_overtakes_queued_normal_ones() -> None:
    async with saturated_router() as (router, worker):
        tasks = [send(router, "n0")]
        await worker.reached("n0")
        tasks += [send(router, "n1"), send(router, "n2")]
        await queued(router, 2)
        tasks.append(send(router, "h", **{"x-priority": "high"}))
        await queued(router, 3)
        await finish_in_turn(worker, 4)
        statuses = [(await task).status_code for task in tasks]
    assert worker.arrived == ["n0", "h", "n1", "n2"]
    assert statuses == [200] * 4


async def test_engine_priority_tells_the_engine_the_routers_order() -> None:
    """vLLM's ``priority`` (lower first) goes with each request: a band's requests get less
    than a lower band's, and a tenant whose backlog still waits in the router gets one
    more than a tenant with none, so a priority-scheduling engine serves the quiet
    tenant's request before the flood's next prompt queued there."""
    async with saturated_router(flow={"engine_priority": True}) as (router, worker):
        tasks = [send(router, "f0", priority=-5)]  # the client's own value is replaced
        await worker.reached("f0")
        tasks += [send(router, "f1"), send(router, "f2")]
        await queued(router, 2)
        tasks.append(send(router, "q0", key="key-q"))
        tasks.append(send(router, "h", **{"x-priority": "high"}))
        await queued(router, 4)
        await finish_in_turn(worker, 5)
        statuses = [(await task).status_code for task in tasks]
    assert worker.arrived == ["f0", "h", "q0", "f1", "f2"]
    # h: band 1 (-2), its tenant's f1 and f2 still waiting (+1)
    assert worker.priorities == {"f0": 0, "h": -1, "q0": 0, "f1": 1, "f2": 0}
    assert statuses == [200] * 5


async def test_without_engine_priority_the_clients_priority_field_goes_through() -> None:
    async with saturated_router() as (router, worker):
        tasks = [send(router, "mine", priority=7), send(router, "none")]
        await finish_in_turn(worker, 2)
        statuses = [(await task).status_code for task in tasks]
    assert worker.priorities == {"mine": 7, "none": None}
    assert statuses == [200] * 2


async def test_a_sheddable_request_is_refused_at_once_under_saturation() -> None:
    async with saturated_router() as (router, worker):
        first = send(router, "n0")
        await worker.reached("n0")
        shed = await send(router, "low", **{"x-priority": "-2"})
        await worker.finish("n0")
        assert (await first).status_code == 200
        text = (await router.get("/metrics")).text
    refused(shed, 429, "shed")
    assert int(shed.headers["retry-after"]) >= 1
    assert "low" not in worker.arrived
    assert metric(text, "switchyard_router_flow_outcomes_total", outcome="shed") == 1


async def test_a_full_queue_refuses_with_retry_after_and_every_request_ends() -> None:
    async with saturated_router({"max_requests_per_band": 2}) as (router, worker):
        tasks = [send(router, "f0")]
        await worker.reached("f0")
        tasks += [send(router, "f1"), send(router, "f2")]
        await queued(router, 2)
        tasks += [send(router, f"over{i}") for i in range(3)]
        over = await asyncio.gather(*tasks[3:])
        await finish_in_turn(worker, 3)
        answered = await asyncio.gather(*tasks[:3])
    for resp in over:
        refused(resp, 429, "queue_full")
        assert int(resp.headers["retry-after"]) >= 1
    assert [resp.status_code for resp in answered] == [200, 200, 200]
    assert len(over) + len(answered) == 6  # every request sent was answered or refused
    assert worker.arrived == ["f0", "f1", "f2"]


async def test_a_request_waiting_past_the_ttl_gets_429_queue_timeout() -> None:
    async with saturated_router({"queue_ttl_s": 0.05}) as (router, worker):
        first = send(router, "f0")
        await worker.reached("f0")
        late = await send(router, "f1")
        assert flow_of(router).queue.size == 0
        await worker.finish("f0")
        assert (await first).status_code == 200
    refused(late, 429, "queue_timeout")
    assert "retry-after" in late.headers
    assert worker.arrived == ["f0"]


async def test_a_client_that_leaves_while_queued_never_reaches_a_worker() -> None:
    async with saturated_router() as (router, worker):
        first = send(router, "f0")
        await worker.reached("f0")
        leave = asyncio.Event()
        body = orjson.dumps({"model": "stub-model", "prompt": "gone", "max_tokens": 5})
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await leave.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def record(message: Any) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"router.test"),
                (b"authorization", b"Bearer key-q"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
        }
        call = asyncio.create_task(router.app(scope, receive, record))
        await queued(router, 1)
        leave.set()
        await call
        assert flow_of(router).queue.size == 0
        await worker.finish("f0")
        assert (await first).status_code == 200
        after = send(router, "f1")
        await worker.finish("f1")
        assert (await after).status_code == 200
        text = (await router.get("/metrics")).text
    assert worker.arrived == ["f0", "f1"]
    assert sent == []  # nothing written to a client that is gone
    assert metric(text, "switchyard_router_flow_outcomes_total", outcome="client_gone") == 1


async def test_shutdown_answers_every_queued_request_503_at_once_and_serves_the_rest() -> None:
    async with saturated_router() as (router, worker):
        first = send(router, "f0")
        await worker.reached("f0")
        waiting = [send(router, "f1"), send(router, "q1", key="key-q")]
        await queued(router, 2)
        app = router.app
        assert isinstance(app, RouterApp)
        app.draining = True
        answers = await asyncio.gather(*waiting)
        await worker.finish("f0")
        assert (await first).status_code == 200
        with_room = send(router, "f2")  # a draining router still serves what need not wait
        await worker.finish("f2")
        assert (await with_room).status_code == 200
        text = (await router.get("/metrics")).text
    for resp in answers:
        refused(resp, 503, "shutting_down")
    assert worker.arrived == ["f0", "f2"]
    assert metric(text, "switchyard_router_flow_outcomes_total", outcome="shutdown") == 2


async def test_a_tenant_over_its_requests_per_minute_gets_429_rate_limited() -> None:
    flow = {"max_inflight_per_worker": 0, "tenant_requests_per_minute": {"quiet": 2}}
    async with saturated_router(flow) as (router, worker):
        answers = []
        for name in ("q0", "q1", "q2"):
            task = send(router, name, key="key-q")
            if name != "q2":
                await worker.finish(name)
            answers.append(await task)
        other = send(router, "f0")
        await worker.finish("f0")
        assert (await other).status_code == 200  # another tenant is not limited
        text = (await router.get("/metrics")).text
    assert [resp.status_code for resp in answers[:2]] == [200, 200]
    refused(answers[2], 429, "rate_limited")
    assert int(answers[2].headers["retry-after"]) >= 1
    assert worker.arrived == ["q0", "q1", "f0"]
    assert metric(text, "switchyard_router_flow_outcomes_total", outcome="rate_limited") == 1


async def test_flow_control_switched_off_sends_everything_to_the_worker_at_once() -> None:
    async with saturated_router({"enabled": False}) as (router, worker):
        app = router.app
        assert isinstance(app, RouterApp) and app.flow is None
        tasks = [send(router, f"r{i}") for i in range(3)]
        for i in range(3):
            await worker.finish(f"r{i}")
        statuses = [(await task).status_code for task in tasks]
    assert statuses == [200] * 3
    assert sorted(worker.arrived) == ["r0", "r1", "r2"]


async def test_a_bad_priority_header_is_a_400() -> None:
    async with saturated_router() as (router, _):
        resp = await send(router, "bad", **{"x-priority": "urgent"})
    assert resp.status_code == 400
    assert "x-priority" in resp.json()["error"]["message"]
