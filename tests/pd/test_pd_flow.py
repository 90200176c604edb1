"""Flow control holds disaggregated requests too: while every prefill or every decode
worker is saturated, a P/D request waits in the router, and the queue's order (bands, the
tenants' fair share) decides which goes next. One vLLM prefill mock and one decode mock,
each saturated by a router-side cap of one request in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.worker import Role, WorkerSpec
from switchyard.router.app import RouterApp
from switchyard.router.flow.control import FlowControl
from switchyard.router.metrics import FlowMetrics, RouterMetrics
from switchyard.router.settings import Flow
from tests.pd.support_pd import LONG_PROMPT, MODEL, PDRouter, vllm_pair
from tests.support import eventually_async, metric

pytestmark = pytest.mark.timeout(60)

KEYS = "flood:key-f,quiet:key-q"


def flow_of(front: PDRouter) -> Any:
    app = front.app
    assert isinstance(app, RouterApp) and app.flow is not None
    return app.flow


async def test_a_disaggregated_request_waits_in_the_router_and_takes_its_fair_turn() -> None:
    finished: list[str] = []

    async def send(front: PDRouter, name: str, key: str, max_tokens: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"{name} {LONG_PROMPT}", "max_tokens": max_tokens}
        resp = await front.router.post(
            "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        finished.append(name)
        return resp

    async with vllm_pair(
        prefill={"speed": 1},
        decode={"speed": 1},
        api_key=KEYS,
        flow={"max_inflight_per_worker": 1},
    ) as (front, prefill, decode):
        flow = flow_of(front)
        first = asyncio.create_task(send(front, "f0", "key-f", 48))
        await eventually_async(lambda: decode.generations == 1, message="f0 never decoded")
        tasks = [asyncio.create_task(send(front, f"f{i}", "key-f", 2)) for i in (1, 2, 3)]
        await eventually_async(lambda: flow.queue.size == 3, message="the flood never queued")
        tasks.append(asyncio.create_task(send(front, "q0", "key-q", 2)))
        await eventually_async(lambda: flow.queue.size == 4, message="q0 never queued")
        assert decode.generations == 1  # the decode worker still holds only f0
        text = (await front.router.get("/metrics")).text
        saturated_then = metric(text, "switchyard_router_flow_saturated_models", model=MODEL)
        answers = [await first, *[await t for t in tasks]]
        text = (await front.router.get("/metrics")).text
    assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
    assert prefill.generations == 5 and decode.generations == 5  # every one disaggregated
    assert finished[:2] == ["f0", "q0"]  # the quiet tenant before the flood's backlog
    assert metric(text, "switchyard_router_flow_outcomes_total", outcome="dispatched") == 4
    assert saturated_then == 1


def test_a_pd_model_has_room_when_a_prefill_and_a_decode_worker_both_do() -> None:
    """A prefill worker is judged with the prompt under the prefill cap; a decode worker
    only on its engine and in-flight caps, as the prompt it gets is prefilled elsewhere."""
    fleet = Fleet()
    prefill = fleet.add(WorkerSpec("http://127.0.0.1:1", models=["m"], role=Role.PREFILL))
    decode = fleet.add(WorkerSpec("http://127.0.0.1:2", models=["m"], role=Role.DECODE))
    settings = Flow(max_queued_prefill_tokens=2048, max_inflight_per_worker=2)
    flow = FlowControl(fleet, settings, FlowMetrics(RouterMetrics()))
    assert flow.can_serve("m", 1000)
    decode.inflight = 1
    decode.totals.prefill_tokens = 10**6  # the decode legs' prompts: not its prefill
    assert flow.can_serve("m", 1000)
    prefill.inflight = 1
    prefill.totals.prefill_tokens = 1500
    assert flow.can_serve("m", 500)
    assert not flow.can_serve("m", 1000)  # past the prefill worker's cap
    decode.inflight = 2
    assert not flow.can_serve("m", 10)  # the decode worker is at its in-flight cap
    assert flow.can_serve("other", 10)  # no worker for it: routing answers
