"""An answer's tokens are summed per tenant and charged to its fair share before the queue
next orders requests, so the order is what charging each answer at once would give."""

from __future__ import annotations

import asyncio

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.worker import WorkerSpec
from switchyard.router.flow.control import FlowControl
from switchyard.router.flow.identity import Identity
from switchyard.router.metrics import FlowMetrics, RouterMetrics
from switchyard.router.settings import Flow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def flow_control() -> tuple[FlowControl, Fleet]:
    fleet = Fleet()
    fleet.add(WorkerSpec("http://127.0.0.1:1", models=["m"]))
    settings = Flow(output_weight=2.0, max_inflight_per_worker=1)  # the clock stands: no decay
    metrics = FlowMetrics(RouterMetrics())
    return FlowControl(fleet, settings, metrics, Clock()), fleet


async def test_a_served_answer_is_charged_before_the_queue_orders_requests() -> None:
    flow, fleet = flow_control()
    grant = flow.grant_now("heavy", "m", 100)
    assert grant is not None
    (worker,) = fleet.workers()
    worker.inflight = 1  # at its cap: the next requests wait
    heavy = asyncio.ensure_future(flow.admit(Identity("heavy", 0), "m", 10, 10))
    await asyncio.sleep(0)
    light = asyncio.ensure_future(flow.admit(Identity("light", 0), "m", 10, 10))
    await asyncio.sleep(0)
    flow.release(grant, 300, 10)  # heavy's first answer ends while both wait
    worker.inflight = 0
    flow.pump()  # one slot: the tenant served less goes first, though heavy came first
    await asyncio.sleep(0)
    assert light.done() and not heavy.done()
    assert flow.queue.counter("heavy") == 300 + 2 * 10
    flow.shutdown()
    await asyncio.gather(heavy, return_exceptions=True)


async def test_a_scrape_counts_the_tokens_not_yet_charged() -> None:
    flow, _ = flow_control()
    grant = flow.grant_now("t", "m", 10)
    assert grant is not None
    flow.release(grant, 40, 5)
    flow.release(grant, 60, 5)
    flow.metrics.flush_served()  # what a scrape does first
    served = {
        sample.labels["kind"]: sample.value
        for family in flow.metrics.served_tokens.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["tenant"] == "t"
    }
    assert served == {"prompt": 100, "output": 10}
    assert flow.queue.counter("t") == 100 + 2 * 10
