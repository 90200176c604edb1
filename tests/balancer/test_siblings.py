"""The processes of one router share counts and admin changes over the sibling bus."""

from __future__ import annotations

import asyncio
import inspect
import struct
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.siblings import (
    BATCH_S,
    LAZY_S,
    Handler,
    SiblingBus,
    SiblingShare,
    _Inbound,
)
from switchyard.balancer.worker import Outcome, WorkerSpec
from tests.balancer.fleet_stubs import StubFactory, eventually

pytestmark = pytest.mark.timeout(30)


@asynccontextmanager
async def sibling(
    directory: Path,
    *specs: str,
    name: str | None = None,
    scrape_interval_s: float = 1.0,
    probe_interval_s: float = 2.0,
    lease_s: float = 0.5,
    lazy_s: float = LAZY_S,
) -> AsyncIterator[Fleet]:
    """A started fleet on the bus in ``directory``, as one process of a router runs it
    (``name``: its bus instance, else a random one)."""
    settings = BalancerSettings(
        sibling_sync_interval_s=0.02,
        lease_s=lease_s,
        scrape_interval_s=scrape_interval_s,
        probe_interval_s=probe_interval_s,
    )
    fleet = Fleet(settings, [WorkerSpec.parse(s) for s in specs])
    bus = SiblingBus(directory, rescan_s=0.05, lazy_s=lazy_s)
    if name is not None:
        bus.instance = name
    fleet.share_with_siblings(SiblingShare(fleet, bus))
    await bus.start()
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()
        await bus.stop()


@asynccontextmanager
async def linked(
    directory: Path,
    *specs: str,
    low: dict[str, float] | None = None,
    high: dict[str, float] | None = None,
) -> AsyncIterator[tuple[Fleet, Fleet]]:
    """Two processes' fleets on one bus, once each hears the other: ``p1``, the
    lower-named (it probes and scrapes for both), then ``p2``; ``low`` and ``high`` set
    their intervals."""
    async with (
        sibling(directory, *specs, name="p1", **(low or {})) as a,
        sibling(directory, *specs, name="p2", **(high or {})) as b,
    ):
        await eventually(lambda: all(f.shared is not None and f.shared.peers == 1 for f in (a, b)))
        yield a, b


async def test_a_siblings_rank_counts_add_to_the_local_view(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    spec = f"{stub.url};dp=2;models=m"
    async with linked(tmp_path, spec) as (a, b):
        wa, wb = a.workers()[0], b.workers()[0]
        ticket = a.begin(wa, prompt_tokens=700, dp_rank=1)
        await eventually(lambda: wb.inflight == 1)
        assert wb.local_inflight == 0
        assert wb.rank_loads()[1].prefill_tokens == 700
        assert b.choose_rank(wb, prompt_tokens=10) == 0, "b avoids the rank a loaded"
        a.end(ticket, Outcome.SUCCESS)
        await eventually(lambda: wb.inflight == 0)


async def test_a_request_a_sibling_begins_dates_the_worker_for_every_process(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    async with linked(tmp_path, f"{stub.url};models=m") as (a, b):
        wa, wb = a.workers()[0], b.workers()[0]
        a.begin(wa)
        await eventually(lambda: wb.inflight == 1)
        assert wb.begun_at == wa.begun_at > 0.0


async def test_a_request_begun_is_told_at_once_and_one_ended_with_the_lazy_news(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    spec = f"{stub.url};models=m"
    slow = {"lease_s": 5.0, "lazy_s": 0.5}
    async with linked(tmp_path, spec, low=slow, high=slow) as (a, b):
        wa, wb = a.workers()[0], b.workers()[0]
        ticket = a.begin(wa)
        took = await eventually(lambda: wb.inflight == 1)
        assert took < 0.25
        a.end(ticket, Outcome.SUCCESS)
        await asyncio.sleep(0.25)
        assert wb.inflight == 1, "an end waits for lazy_s"
        await eventually(lambda: wb.inflight == 0)


async def test_a_stopped_siblings_counts_vanish_after_its_lease(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    spec = f"{stub.url};models=m"
    async with sibling(tmp_path, spec) as b:
        wb = b.workers()[0]
        async with sibling(tmp_path, spec) as a:
            a.begin(a.workers()[0])
            await eventually(lambda: wb.inflight == 1)
        await eventually(lambda: wb.inflight == 0, timeout=5)
        assert b.shared is not None and b.shared.peers == 0


async def test_an_admin_change_reaches_the_other_process(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    async with linked(tmp_path) as (a, b):
        a.add(WorkerSpec.parse(f"{stub.url};models=m"), source="admin")
        await eventually(lambda: b.get(stub.url) is not None)
        b.drain(stub.url)
        await eventually(lambda: a.candidates("m") == [])
        b.undrain(stub.url)
        await eventually(lambda: [w.id for w in a.candidates("m")] == [stub.url])
        worker = b.get(stub.url)
        assert worker is not None and not worker.draining


async def test_a_process_started_later_loads_the_admin_workers(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    async with sibling(tmp_path) as a:
        a.add(WorkerSpec.parse(f"{stub.url};models=m"), source="admin")
        async with sibling(tmp_path) as late:
            assert [w.id for w in late.workers()] == [stub.url]


async def test_a_removed_worker_is_gone_for_a_process_started_later(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    async with sibling(tmp_path) as a:
        a.add(WorkerSpec.parse(f"{stub.url};models=m"), source="admin")
        a.remove(stub.url)
        async with sibling(tmp_path) as late:
            assert late.workers() == []


METRICS = "vllm:num_requests_running 3\nvllm:num_requests_waiting 2\n"


def count_own(fleet: Fleet, kind: str) -> list[int]:
    """A list whose one item counts the ``kind`` (probe or scrape) this process makes from
    now on."""
    made = [0]
    prober = fleet.prober
    assert prober is not None
    hook = f"on_{kind}"
    share = getattr(prober, hook)
    assert share is not None

    def counted(*outcome: Any) -> None:
        made[0] += 1
        share(*outcome)

    setattr(prober, hook, counted)
    return made


@pytest.mark.parametrize("kind", ["probe", "scrape"])
async def test_one_process_probes_and_scrapes_for_all(
    kind: str, stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine(metrics=METRICS)
    spec = f"{stub.url};models=m"
    fast = {f"{kind}_interval_s": 0.05}
    async with linked(tmp_path, spec, low=fast, high=fast) as (low, high):
        made = {"low": count_own(low, kind), "high": count_own(high, kind)}
        await asyncio.sleep(1.0)
        assert made["low"][0] >= 10
        assert made["high"][0] <= 1, f"the higher-named process {kind}s only without the lower"


@pytest.mark.parametrize("kind", ["probe", "scrape"])
async def test_a_process_probes_and_scrapes_for_itself_once_the_sibling_that_did_is_gone(
    kind: str, stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine(metrics=METRICS)
    spec = f"{stub.url};models=m"
    fast = {f"{kind}_interval_s": 0.05}
    async with sibling(tmp_path, spec, name="p2", **fast) as high:
        async with sibling(tmp_path, spec, name="p1", **fast):
            await eventually(lambda: high.shared is not None and high.shared.peers == 1)
            made = count_own(high, kind)
            await asyncio.sleep(0.5)
            assert made[0] <= 1
        await eventually(lambda: made[0] >= 5)
        assert made[0] >= 5


async def test_the_others_apply_the_scraping_siblings_samples(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine(metrics=METRICS)
    spec = f"{stub.url};models=m"
    async with linked(
        tmp_path, spec, low={"scrape_interval_s": 0.05}, high={"scrape_interval_s": 5.0}
    ) as (low, high):
        stub.metrics = "vllm:num_requests_running 7\nvllm:num_requests_waiting 4\n"
        # The higher-named process's own next scrape is seconds away: only the shared one
        # can bring the new load within the wait.
        await eventually(
            lambda: (
                (s := high.workers()[0].engine) is not None and (s.running, s.waiting) == (7, 4)
            ),
            timeout=2.0,
        )
        sample = high.workers()[0].engine
        assert sample is not None and (sample.running, sample.waiting) == (7, 4)


async def test_a_failed_probe_of_the_probing_sibling_takes_the_worker_out_of_the_others(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    spec = f"{stub.url};models=m"
    async with linked(
        tmp_path, spec, low={"probe_interval_s": 0.05}, high={"probe_interval_s": 5.0}
    ) as (low, high):
        stub.health_status = 503
        # The higher-named process's own next probe is seconds away: only the shared one
        # can take the worker out within the wait.
        await eventually(lambda: not high.workers()[0].healthy, timeout=2.0)
        assert high.workers()[0].last_error == "probe status 503"


async def test_a_process_woken_by_its_own_connect_error_probes_for_itself(
    stub_engine: StubFactory, tmp_path: Path
) -> None:
    stub = await stub_engine()
    spec = f"{stub.url};models=m"
    async with linked(
        tmp_path, spec, low={"probe_interval_s": 0.05}, high={"probe_interval_s": 0.05}
    ) as (low, high):
        made = count_own(high, "probe")
        await asyncio.sleep(0.3)
        before = made[0]
        assert high.prober is not None
        high.prober.wake(high.workers()[0])
        await eventually(lambda: made[0] > before)
        assert made[0] > before


async def test_a_bus_message_reaches_each_sibling_once(tmp_path: Path) -> None:
    heard: dict[str, list[bytes]] = {"b": [], "c": []}
    buses = [SiblingBus(tmp_path, rescan_s=0.05) for _ in range(3)]
    buses[1].on(b"t", lambda origin, payload: heard["b"].append(payload))
    buses[2].on(b"t", lambda origin, payload: heard["c"].append(payload))
    for bus in buses:
        await bus.start()
    try:
        await eventually(lambda: all(bus.peers == 2 for bus in buses))
        await asyncio.sleep(0.2)  # a SUB that has just connected may still be subscribing
        buses[0].publish(b"t", b"hello")
        await eventually(lambda: heard == {"b": [b"hello"], "c": [b"hello"]})
        await asyncio.sleep(0.1)  # a second copy would have come by now
        assert heard == {"b": [b"hello"], "c": [b"hello"]}
    finally:
        for bus in buses:
            await bus.stop()


class RawSibling(asyncio.Protocol):
    """A bare socket in the bus's directory, as a sibling's would be: sees the frames."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connected = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connected = True

    def data_received(self, data: bytes) -> None:
        self.received += data


@asynccontextmanager
async def listening(
    tmp_path: Path, batch_s: float = BATCH_S
) -> AsyncIterator[tuple[SiblingBus, RawSibling]]:
    """A bus connected to a bare socket in its directory, to see the frames themselves."""
    raw = RawSibling()
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: raw, str(tmp_path / "raw.sock"))
    bus = SiblingBus(tmp_path, rescan_s=0.05, batch_s=batch_s)
    await bus.start()
    try:
        await eventually(lambda: raw.connected)
        yield bus, raw
    finally:
        await bus.stop()
        server.close()


async def test_messages_published_together_travel_in_one_frame(tmp_path: Path) -> None:
    async with listening(tmp_path) as (bus, raw):
        bus.publish(b"a", b"1")
        bus.publish(b"b", b"2")
        bus.publish(b"a", b"3")
        await eventually(lambda: len(raw.received) >= 4)
        (size,) = struct.unpack(">I", raw.received[:4])
        await eventually(lambda: len(raw.received) >= 4 + size)
        assert len(raw.received) == 4 + size
        frame = bytes(raw.received[4:])
        assert msgpack.unpackb(frame) == [bus.instance, b"a", b"1", b"b", b"2", b"a", b"3"]


def frames(raw: RawSibling) -> list[list[bytes | str]]:
    """The whole frames a bare sibling has received so far, unpacked."""
    out, data = [], bytes(raw.received)
    while len(data) >= 4:
        (size,) = struct.unpack(">I", data[:4])
        if len(data) < 4 + size:
            break
        out.append(msgpack.unpackb(data[4 : 4 + size]))
        data = data[4 + size :]
    return out


async def test_a_message_after_a_quiet_spell_leaves_without_waiting_out_the_batch(
    tmp_path: Path,
) -> None:
    async with listening(tmp_path, batch_s=30.0) as (bus, raw):
        bus.publish(b"a", b"1")
        bus.publish(b"b", b"2")
        await eventually(lambda: len(frames(raw)) == 1)
        assert frames(raw) == [[bus.instance, b"a", b"1", b"b", b"2"]]


async def test_messages_within_a_batch_of_the_last_frame_wait_to_share_the_next(
    tmp_path: Path,
) -> None:
    async with listening(tmp_path, batch_s=0.5) as (bus, raw):
        bus.publish(b"a", b"1")
        await eventually(lambda: len(frames(raw)) == 1)
        bus.publish(b"b", b"2")
        await asyncio.sleep(0.05)
        bus.publish(b"c", b"3")
        await asyncio.sleep(0.2)
        assert len(frames(raw)) == 1
        await eventually(lambda: len(frames(raw)) == 2)
        assert frames(raw)[1] == [bus.instance, b"b", b"2", b"c", b"3"]


async def test_a_lazy_message_waits_for_the_next_urgent_one_and_travels_first(
    tmp_path: Path,
) -> None:
    async with listening(tmp_path, batch_s=0.0) as (bus, raw):
        bus.lazy_s = 30.0
        bus.publish(b"lazy", b"1", lazy=True)
        await asyncio.sleep(0.2)
        assert frames(raw) == []
        bus.publish(b"urgent", b"2")
        await eventually(lambda: len(frames(raw)) == 1)
        assert frames(raw) == [[bus.instance, b"lazy", b"1", b"urgent", b"2"]]


async def test_a_lazy_message_alone_leaves_after_lazy_s(tmp_path: Path) -> None:
    async with listening(tmp_path) as (bus, raw):
        bus.lazy_s = 0.4
        bus.publish(b"lazy", b"1", lazy=True)
        await asyncio.sleep(0.2)
        assert frames(raw) == []
        await eventually(lambda: len(frames(raw)) == 1)


async def test_a_keyed_message_replaces_the_waiting_one_and_goes_last(tmp_path: Path) -> None:
    heard: list[tuple[bytes, bytes]] = []
    receiver = SiblingBus(tmp_path, rescan_s=0.05)
    receiver.on(b"w", lambda origin, payload: heard.append((b"w", payload)))
    receiver.on(b"c", lambda origin, payload: heard.append((b"c", payload)))
    await receiver.start()
    try:
        async with listening(tmp_path) as (bus, _):
            await eventually(lambda: receiver.peers == 2 and bus.peers == 2)
            bus.publish(b"w", b"worker-1 old", key="worker-1")
            bus.publish(b"c", b"counts")
            bus.publish(b"w", b"worker-1 new", key="worker-1")
            await eventually(lambda: len(heard) == 2)
            assert heard == [(b"c", b"counts"), (b"w", b"worker-1 new")]
    finally:
        await receiver.stop()


def test_a_frame_cut_across_reads_is_delivered_whole_once() -> None:
    heard: list[bytes] = []
    bus = SiblingBus("/nonexistent")
    bus.on(b"t", lambda origin, payload: heard.append(payload))
    body = msgpack.packb(["origin", b"t", b"x" * 1000, b"t", b"y"])
    frame = struct.pack(">I", len(body)) + body
    inbound = _Inbound(bus)
    for at in range(0, len(frame) * 2, 7):  # two frames back to back, 7 bytes a read
        inbound.data_received((frame + frame)[at : at + 7])
    assert heard == [b"x" * 1000, b"y", b"x" * 1000, b"y"]


async def test_a_sibling_that_stops_is_no_longer_a_peer(tmp_path: Path) -> None:
    a, b = SiblingBus(tmp_path, rescan_s=0.05), SiblingBus(tmp_path, rescan_s=0.05)
    await a.start()
    await b.start()
    try:
        await eventually(lambda: a.peers == 1 and b.peers == 1)
        await b.stop()
        await eventually(lambda: a.peers == 0)
        assert a.peers == 0 and b.peers == 0
    finally:
        await a.stop()
        await b.stop()


@asynccontextmanager
async def sending_to(tmp_path: Path, handler: Handler) -> AsyncIterator[SiblingBus]:
    """A started bus linked to a second one that hands topic ``t`` to ``handler``; both are
    stopped at the end."""
    sender, receiver = SiblingBus(tmp_path, rescan_s=0.05), SiblingBus(tmp_path, rescan_s=0.05)
    receiver.on(b"t", handler)
    await sender.start()
    await receiver.start()
    try:
        await eventually(lambda: sender.peers == 1)
        yield sender
    finally:
        await sender.stop()
        await receiver.stop()


async def test_awaitable_handlers_run_in_the_order_their_messages_came(tmp_path: Path) -> None:
    done: list[bytes] = []

    async def slow_first(origin: str, payload: bytes) -> None:
        await asyncio.sleep(0.05 if payload == b"1" else 0)
        done.append(payload)

    async with sending_to(tmp_path, slow_first) as sender:
        for payload in (b"1", b"2", b"3"):
            sender.publish(b"t", payload)
        await eventually(lambda: len(done) == 3)
        assert done == [b"1", b"2", b"3"]


async def test_a_sibling_that_starts_later_is_found_when_it_connects(tmp_path: Path) -> None:
    early, late = SiblingBus(tmp_path, rescan_s=60), SiblingBus(tmp_path, rescan_s=60)
    await early.start()
    try:
        await late.start()  # finds the early one and connects: no rescan is due for a minute
        waited_s = await eventually(lambda: early.peers == 1 and late.peers == 1)
        assert waited_s < early.rescan_s  # found on connect, not by a rescan
        assert (early.peers, late.peers) == (1, 1)
    finally:
        await early.stop()
        await late.stop()


async def test_handler_work_still_waiting_at_stop_is_closed_not_left_unawaited(
    tmp_path: Path,
) -> None:
    made: list[Coroutine[Any, Any, None]] = []

    def slow(origin: str, payload: bytes) -> Coroutine[Any, Any, None]:
        made.append(asyncio.sleep(10))
        return made[-1]

    async with sending_to(tmp_path, slow) as sender:
        for payload in (b"1", b"2", b"3"):
            sender.publish(b"t", payload)
        await eventually(lambda: len(made) == 3)
    assert all(inspect.getcoroutinestate(c) == "CORO_CLOSED" for c in made)
