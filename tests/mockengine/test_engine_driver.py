"""The real-clock driver (asyncio, time-compressed) and its agreement with the virtual clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from switchyard.mock.engine.api import EngineRequest, TokenOutput
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.driver import RealClockEngine, make_ranks
from switchyard.mock.engine.events import KVEventBatch
from switchyard.mock.engine.virtual import simulate
from tests.support import eventually_async

pytestmark = pytest.mark.timeout(30)


def cfg(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"num_gpu_blocks": 512, "max_num_seqs": 64, "speed": 100.0}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
async def engine() -> AsyncIterator[RealClockEngine]:
    e = RealClockEngine(cfg())
    await e.start()
    yield e
    await e.stop()


async def collect(e: RealClockEngine, req: EngineRequest) -> list[TokenOutput]:
    return [out async for out in e.generate(req)]


async def test_generate_yields_one_output_per_token_and_finishes(engine: RealClockEngine) -> None:
    outs = await collect(engine, EngineRequest("a", prompt(100), 7))
    assert [o.num_generated for o in outs] == [1, 2, 3, 4, 5, 6, 7]
    assert [o.finished for o in outs] == [False] * 6 + [True]
    assert outs[-1].finish_reason == "length"
    assert engine.stats().generation_tokens_total == 7


async def test_repeated_prompt_reports_cached_tokens(engine: RealClockEngine) -> None:
    await collect(engine, EngineRequest("a", prompt(100), 2))
    outs = await collect(engine, EngineRequest("b", prompt(100), 2))
    assert outs[0].num_cached_tokens == 96


async def test_closing_the_stream_aborts_and_frees_slot_and_blocks(
    engine: RealClockEngine,
) -> None:
    stream = engine.generate(EngineRequest("long", prompt(300), 5000))
    async for out in stream:
        if out.num_generated == 3:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert engine.core.pool.num_free == 511
    assert "long" not in engine.core.seqs


async def test_closing_a_stream_never_iterated_aborts_the_request(
    engine: RealClockEngine,
) -> None:
    stream = engine.generate(EngineRequest("unread", prompt(300), 500))
    await stream.aclose()  # type: ignore[attr-defined]
    assert "unread" not in engine.core.seqs
    assert engine.stats().num_waiting == 0


async def test_cancelling_the_consumer_aborts_the_request(engine: RealClockEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(EngineRequest("c", prompt(40), 5000)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "c" not in engine.core.seqs and engine.stats().num_running == 0


async def test_abort_by_id_ends_the_stream(engine: RealClockEngine) -> None:
    outs: list[TokenOutput] = []

    async def consume() -> None:
        async for out in engine.generate(EngineRequest("x", prompt(50), 5000)):
            outs.append(out)

    task = asyncio.create_task(consume())
    await eventually_async(lambda: outs or task.done(), 5, 0.001)
    engine.abort("x")
    await asyncio.wait_for(task, 5)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert engine.stats().num_running == 0


async def test_held_prefill_reports_block_ids_until_released(engine: RealClockEngine) -> None:
    outs = await collect(engine, EngineRequest("p", prompt(64), 1, hold_kv_after_prefill=True))
    assert len(outs) == 1 and outs[0].finished
    assert len(outs[0].held_block_ids) == 4
    assert engine.core.pool.num_free == 511 - 4
    assert engine.release_held("p") is True
    assert engine.core.pool.num_free == 511


async def test_idle_engine_wakes_when_a_remote_transfer_completes() -> None:
    e = RealClockEngine(cfg(kv_transfer_us_per_block=20_000.0))  # 20 ms model per block
    await e.start()
    try:
        req = EngineRequest("d", prompt(161), 3, remote_prefilled_tokens=160)
        outs = await asyncio.wait_for(collect(e, req), 5)
        assert [o.num_generated for o in outs] == [1, 2, 3]
        assert outs[0].num_cached_tokens == 160
        # 10 blocks * 20 ms model = 200 ms model = 2 ms wall at speed 100, before the 1st step
        assert e.model_now() >= 0.2
    finally:
        await e.stop()


async def test_thousands_of_concurrent_streams_complete() -> None:
    e = RealClockEngine(cfg(max_num_seqs=256, num_gpu_blocks=4096, speed=1000.0))
    await e.start()
    try:
        reqs = [EngineRequest(f"r{i}", prompt(24, 100 * i), 4) for i in range(2000)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(e, r) for r in reqs)), 20)
        assert all(len(outs) == 4 and outs[-1].finished for outs in results)
        assert e.stats().requests_finished == 2000
    finally:
        await e.stop()


async def test_ranks_are_independent_and_tag_their_events() -> None:
    seen: dict[int, list[KVEventBatch]] = {0: [], 1: []}
    ranks = make_ranks(cfg(), 2, lambda rank: seen[rank].append)
    for r in ranks:
        await r.start()
    try:
        await collect(ranks[1], EngineRequest("a", prompt(64), 1))
        assert seen[0] == [] and seen[1][0].data_parallel_rank == 1
        assert ranks[0].stats().requests_finished == 0
    finally:
        for r in ranks:
            await r.stop()


async def test_real_and_virtual_clock_agree_on_the_same_workload() -> None:
    # Slow enough (speed 2) that a busy shared CPU's timer lag stays inside the tolerances.
    c = cfg(speed=2.0, max_num_batched_tokens=2048)
    shared = prompt(400)
    workload = [
        (0.05 * i, EngineRequest(f"r{i}", shared[: 200 + 50 * i] + prompt(30, 10_000 * i), 15))
        for i in range(6)
    ]
    virtual = simulate(
        c,
        [
            (t, EngineRequest(r.request_id, list(r.prompt_token_ids), r.max_tokens))
            for t, r in workload
        ],
    )
    engine = RealClockEngine(c)
    await engine.start()

    async def run(t: float, req: EngineRequest) -> tuple[list[TokenOutput], list[float]]:
        await asyncio.sleep(max(0.0, t - engine.model_now()) / c.speed)
        outs, times = [], []
        async for out in engine.generate(req):
            outs.append(out)
            times.append(engine.model_now())
        return outs, times

    try:
        real = await asyncio.gather(*(run(t, r) for t, r in workload))
    finally:
        await engine.stop()
    for (t, _), v, (outs, times) in zip(workload, virtual, real, strict=True):
        assert outs[-1].num_generated == v.output_tokens == 15
        assert outs[0].num_cached_tokens == v.num_cached_tokens
        assert v.ttft is not None and v.finish_time is not None
        assert times[0] - t == pytest.approx(v.ttft, abs=0.04)
        assert times[-1] == pytest.approx(v.finish_time, rel=0.25, abs=0.04)
    assert sum(v.num_cached_tokens for v in virtual) > 0


async def test_release_of_held_blocks_wakes_a_request_waiting_for_them() -> None:
    e = RealClockEngine(cfg(num_gpu_blocks=12, held_kv_timeout_s=1000.0))  # 11 usable
    await e.start()
    try:
        await collect(e, EngineRequest("p", prompt(160), 1, hold_kv_after_prefill=True))
        blocked = asyncio.create_task(collect(e, EngineRequest("q", prompt(64, 5000), 2)))
        await asyncio.sleep(0.05)
        assert not blocked.done() and e.stats().num_waiting == 1
        e.release_held("p")
        outs = await asyncio.wait_for(blocked, 5)
        assert outs[-1].num_generated == 2
    finally:
        await e.stop()


async def test_stream_lasts_its_model_time_divided_by_speed() -> None:
    e = RealClockEngine(cfg(speed=20.0, context_token_us=0.0))
    await e.start()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await collect(e, EngineRequest("t", prompt(16), 101))
        wall = loop.time() - start
        model = (5753 + 16 * 17.25 + 100 * (5753 + 6.0)) * 1e-6
        assert model / 20.0 <= wall < 2 * model / 20.0
    finally:
        await e.stop()
