"""Processes of one router share the caps while more than one has requests waiting.

Each process keeps its own queue; the one whose request just ended looks at the freed
capacity first, so with a shared cap it would refill it every time and a sibling's
waiting requests would starve. A process says on the bus while requests wait in it, and
every waiting process then keeps to its part.
"""

from __future__ import annotations

import asyncio

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.worker import WorkerSpec
from switchyard.router.flow.control import (
    ANNOUNCE_S,
    CONTENDER_TTL_S,
    STALL_S,
    TOPIC,
    TURN_S,
    FlowControl,
)
from switchyard.router.flow.identity import Identity
from switchyard.router.metrics import FlowMetrics, RouterMetrics
from switchyard.router.settings import Flow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Bus:
    """The sibling bus as flow control uses it: handlers by topic, messages sent."""

    instance = "b-this"

    def __init__(self) -> None:
        self.handlers: dict[bytes, object] = {}
        self.sent: list[bytes] = []

    def on(self, topic: bytes, handler: object) -> None:
        self.handlers[topic] = handler

    def publish(
        self, topic: bytes, payload: bytes, key: str | None = None, *, lazy: bool = False
    ) -> None:
        assert topic == TOPIC
        self.sent.append(payload)

    def hear(self, origin: str, payload: bytes) -> None:
        handler = self.handlers[TOPIC]
        assert callable(handler)
        handler(origin, payload)


def flow_control(prefill_cap: int = 4000) -> tuple[FlowControl, Fleet, Bus, Clock]:
    clock = Clock()
    bus = Bus()
    fleet = Fleet()
    fleet.add(WorkerSpec("http://127.0.0.1:1", models=["m"]))
    settings = Flow(max_queued_prefill_tokens=prefill_cap)
    flow = FlowControl(
        fleet,
        settings,
        FlowMetrics(RouterMetrics()),
        clock,
        siblings=bus,  # type: ignore[arg-type]
    )
    return flow, fleet, bus, clock


def test_a_waiting_sibling_halves_this_process_part_of_the_prefill_cap() -> None:
    flow, fleet, bus, clock = flow_control(prefill_cap=4000)
    (worker,) = fleet.workers()
    worker.inflight = worker.local_inflight = 1
    worker.totals.prefill_tokens = 2500  # this process's own, under the whole cap
    assert flow.can_serve("m", 1000)
    bus.hear("sibling", b"1")
    assert flow.contenders(clock.now) == 2
    assert not flow.can_serve("m", 1000)  # 2500 of its 2000-token part
    bus.hear("sibling", b"0")
    assert flow.can_serve("m", 1000)


def test_a_short_prompt_needs_only_one_step_ahead_of_it_whatever_the_parts() -> None:
    """A short prompt fits beside the queued prefill within one step of the cap, which it
    barely lengthens: held to this process's part it would wait for its own long prompt
    to drain, a step or more, while the engine could start it in the next."""
    flow, fleet, bus, clock = flow_control(prefill_cap=4000)
    (worker,) = fleet.workers()
    worker.inflight = worker.local_inflight = 1
    worker.totals.prefill_tokens = 2500
    bus.hear("sibling", b"1")
    assert flow.can_serve("m", 400)
    worker.totals.remote_prefill_tokens = 1500  # a sibling's: one full step ahead now
    assert not flow.can_serve("m", 400)


def test_a_drained_worker_takes_a_long_prompt_from_each_contender_in_turn() -> None:
    """A prompt past this process's part goes only to a drained worker, and only in this
    process's turn there: the sibling whose prompt just drained hears of it first, and
    would otherwise take the worker again each time."""
    flow, fleet, bus, clock = flow_control(prefill_cap=2048)
    (worker,) = fleet.workers()
    worker.inflight = 1  # a sibling's request, decoding: the worker has drained
    assert flow.can_serve("m", 2000)  # alone: no turns
    bus.hear("a-sibling", b"1")  # sorts first: contender 0, this process contender 1
    clock.now = 10 * TURN_S  # epoch 10: worker 0 is contender (0 + 10) % 2 == 0's
    assert flow.turns("m", fleet.workers(), clock.now) == frozenset()
    assert not flow.can_serve("m", 2000)
    assert flow.can_serve("m", 100)  # a prompt within its part needs no turn
    clock.now += TURN_S
    assert flow.turns("m", fleet.workers(), clock.now) == {worker.id}
    assert flow.can_serve("m", 2000)


def test_turns_split_a_models_workers_between_the_contenders() -> None:
    flow, fleet, bus, clock = flow_control()
    for port in (2, 3, 4):
        fleet.add(WorkerSpec(f"http://127.0.0.1:{port}", models=["m"]))
    bus.hear("a-sibling", b"1")
    bus.hear("c-sibling", b"1")
    workers = fleet.workers()
    mine = flow.turns("m", workers, clock.now)
    later = flow.turns("m", workers, clock.now + TURN_S)
    assert mine is not None and later is not None
    assert 1 <= len(mine) <= 2 and mine != later  # 4 workers over 3 contenders, rotating


def test_a_sibling_not_heard_from_for_a_while_no_longer_counts() -> None:
    flow, _, bus, clock = flow_control()
    bus.hear("sibling", b"1")
    clock.now += CONTENDER_TTL_S - 0.01
    assert flow.contenders(clock.now) == 2
    clock.now += 0.02
    assert flow.contenders(clock.now) == 1


async def test_a_process_says_when_requests_start_and_stop_waiting_in_it() -> None:
    flow, fleet, bus, clock = flow_control(prefill_cap=4000)
    (worker,) = fleet.workers()
    worker.inflight = worker.local_inflight = 1
    worker.totals.prefill_tokens = 9000  # beyond two steps of the cap: a new request waits
    waiting = asyncio.ensure_future(flow.admit(Identity("t", 0), "m", 100, 100))
    await asyncio.sleep(0)
    assert bus.sent == [b"1"]
    flow.pump()  # within ANNOUNCE_S: not said again
    assert bus.sent == [b"1"]
    clock.now += ANNOUNCE_S
    flow.pump()
    assert bus.sent == [b"1", b"1"]
    worker.totals.prefill_tokens = 0
    flow.prefilled()
    grant = await asyncio.wait_for(waiting, 1.0)
    assert grant.tenant == "t"
    assert bus.sent[-1] == b"0"
    flow.release(grant, 100, 1)
    assert bus.sent.count(b"0") == 1


def test_while_a_sibling_has_stalled_this_process_leaves_workers_to_drain() -> None:
    """A sibling whose long prompts wait for a drained worker can wait for ever while this
    process keeps a long prompt of its own queued on every worker: once the sibling says
    its queue has stalled, this process too puts long prompts only on drained workers, in
    its turn there. A short prompt still goes where one step at most is ahead of it, and
    does not keep a worker from counting as drained."""
    flow, fleet, bus, clock = flow_control(prefill_cap=4000)
    (worker,) = fleet.workers()
    worker.inflight = worker.local_inflight = 1
    worker.totals.prefill_tokens = 1000  # this process's own, within its part
    bus.hear("a-sibling", b"1")  # sorts first: contender 0, this process contender 1
    assert flow.can_serve("m", 900)
    bus.hear("a-sibling", b"2")
    assert not flow.can_serve("m", 900)  # the worker has a long prompt queued
    assert flow.can_serve("m", 100)
    worker.totals.prefill_tokens = 100  # drained of long prompts
    clock.now = 10 * TURN_S  # the sibling's turn on the worker
    assert not flow.can_serve("m", 900)
    clock.now += TURN_S  # this process's turn
    assert flow.can_serve("m", 900)
    worker.totals.prefill_tokens = 1000
    bus.hear("a-sibling", b"1")  # it moved again
    assert flow.can_serve("m", 900)


async def test_a_process_says_when_its_queue_has_stalled_and_when_it_moves() -> None:
    flow, fleet, bus, clock = flow_control(prefill_cap=4000)
    (worker,) = fleet.workers()
    worker.inflight = worker.local_inflight = 1
    worker.totals.prefill_tokens = 9000  # beyond two steps of the cap: a request waits
    waiting = asyncio.ensure_future(flow.admit(Identity("t", 0), "m", 100, 100))
    await asyncio.sleep(0)
    assert bus.sent == [b"1"]
    clock.now += STALL_S / 2
    flow.pump()
    assert bus.sent == [b"1", b"1"] and not flow.stalled()
    clock.now += STALL_S / 2 + 0.01  # nothing has left the queue for STALL_S
    flow.pump()
    assert bus.sent[-1] == b"2" and flow.stalled()
    worker.totals.prefill_tokens = 0
    flow.prefilled()
    grant = await asyncio.wait_for(waiting, 1.0)
    assert bus.sent[-1] == b"0"
    flow.release(grant, 100, 1)


async def test_a_long_prompt_granted_at_once_holds_its_drained_worker_until_it_has_begun() -> None:
    """Granted at once, a long prompt counts among the starting until its worker is
    chosen, as one dispatched from the queue does: the worker's counts grow only then, so
    a second long prompt meanwhile would see the same drained worker and queue on it."""
    flow, fleet, _, _ = flow_control(prefill_cap=2048)
    (worker,) = fleet.workers()
    worker.inflight = worker.local_inflight = 1  # decoding: drained of prefill
    first = flow.grant_now("flood", "m", 2000)
    assert first is not None and first.starting
    assert flow.grant_now("flood", "m", 2000) is None
    worker.totals.prefill_tokens = 2000  # routed there: the counts say so now
    flow.begun(first)
    assert flow.grant_now("flood", "m", 2000) is None  # the worker's room is taken
    short = flow.grant_now("quiet", "m", 40)  # fits the step beside it
    assert short is not None and not short.starting  # a short one holds no room
    flow.release(first, 2000, 1)
    worker.totals.prefill_tokens = 0
    assert flow.grant_now("flood", "m", 2000) is not None
