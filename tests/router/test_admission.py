"""TTFT prediction (prior, learned rates, engine histograms, calibration) and SLO admission."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from switchyard.balancer.worker import EngineSample
from switchyard.net.httpclient import ConnectionPool
from switchyard.router.admission import STREAM, WHOLE, Admission, TTFTModel, calibrate
from switchyard.router.errors import RouterError
from switchyard.router.metrics import RouterMetrics
from switchyard.router.scheduler.framework import Context
from tests.router.stub_backend import StubBackend, StubReply, StubRequest
from tests.router.test_kv_scheduling import FakeLoad, FakeWorker


@dataclass
class Worker(FakeWorker):
    engine: EngineSample | None = None
    url: str = ""
    healthy: bool = True
    models: set[str] = field(default_factory=lambda: {"m"})


def trained(rate_s_per_token: float = 1e-3, prior_tokens_per_s: float = 1e6) -> TTFTModel:
    model = TTFTModel(prior_tokens_per_s)
    model.learn("a", STREAM, rate_s_per_token)
    return model


def test_prior_predicts_before_any_answer() -> None:
    model = TTFTModel(prior_tokens_per_s=1000)
    ctx = Context(model="m", prompt_tokens=500)
    assert model.predict(ctx, Worker("a")) == pytest.approx(0.5)


def test_prediction_grows_with_queued_prefill() -> None:
    model = trained()
    idle = Worker("a")
    queued = Worker("a", state=FakeLoad(prefill_tokens=4000))
    ctx = Context(model="m", prompt_tokens=1000)
    assert model.predict(ctx, queued) > 4 * model.predict(ctx, idle)


def test_unobserved_worker_borrows_the_fleet_rate() -> None:
    model = trained()
    ctx = Context(model="m", prompt_tokens=1000)
    assert model.predict(ctx, Worker("b")) == pytest.approx(1.0, rel=0.01)


def test_non_streamed_answers_teach_their_own_rate() -> None:
    model = trained(1e-3)
    ctx = Context(model="m", prompt_tokens=1000)
    model.expect(ctx, Worker("a"), stream=False).observe(5.0)
    assert model.predict(ctx, Worker("a"), stream=False) > 2.0
    assert model.predict(ctx, Worker("a"), stream=True) == pytest.approx(1.0, rel=0.01)


def test_non_streamed_prediction_falls_back_to_the_first_token_rate() -> None:
    model = trained(1e-3)
    ctx = Context(model="m", prompt_tokens=1000)
    assert model.predict(ctx, Worker("a"), stream=False) == pytest.approx(1.0, rel=0.01)


def test_observation_is_reported_as_actual_over_predicted() -> None:
    metrics = RouterMetrics()
    model = TTFTModel(1000, metrics.ttft_prediction)
    model.expect(Context(model="m", prompt_tokens=1000), Worker("a"), stream=True).observe(2.0)
    child = metrics.ttft_prediction.labels(STREAM)
    assert child._sum.get() == pytest.approx(2.0)


def test_engine_ttft_histogram_teaches_the_first_token_rate() -> None:
    model = TTFTModel(prior_tokens_per_s=1e6)
    worker = Worker("a", engine=EngineSample(0, 0, None, ttft_sum=10.0, ttft_count=5))
    ctx = Context(model="m", prompt_tokens=100)
    model.expect(ctx, worker, stream=False)  # first sight of the histogram: a baseline
    for _ in range(4):
        model.expect(ctx, worker, stream=False).observe(30.0)
    # Four more first tokens, 2 s each on the engine, for requests of 100 tokens of work.
    worker.engine = EngineSample(0, 0, None, ttft_sum=18.0, ttft_count=9)
    assert model.predict(ctx, worker, stream=True) == pytest.approx(2.0, rel=0.01)


def test_engine_restart_rebaselines_without_learning() -> None:
    model = TTFTModel(prior_tokens_per_s=1000)
    worker = Worker("a", engine=EngineSample(0, 0, None, ttft_sum=10.0, ttft_count=5))
    ctx = Context(model="m", prompt_tokens=100)
    model.expect(ctx, worker, stream=False)
    model.expect(ctx, worker, stream=False).observe(0.5)
    worker.engine = EngineSample(0, 0, None, ttft_sum=3.0, ttft_count=1)
    assert model.predict(ctx, worker, stream=True) == pytest.approx(0.1)


def test_observed_under_prediction_raises_the_p90_scale() -> None:
    model = trained(1e-3)
    ctx = Context(model="m", prompt_tokens=100)
    for _ in range(100):
        expected = model.expect(ctx, Worker("a"), stream=True)
        expected.observe(expected.predicted_s * 2)
        model.learn("a", STREAM, 1e-3)  # keep the rate where it was: only the error moves
    assert 1.5 < model.q90(stream=True) <= 2.5
    assert model.q90(stream=False) == 1.0


async def test_admission_judges_predictions_at_their_p90_error() -> None:
    model = trained(1e-3)
    model._log_q90[STREAM] = math.log(2.0)
    adm = admission(model, max_wait_ms=0)
    ctx = Context(model="m", prompt_tokens=400)  # 0.4 s raw, 0.8 s at the p90 error
    with pytest.raises(RouterError):
        await adm.admit(ctx, [Worker("a")], objective_s=0.5)


def test_calibration_fits_overhead_and_slope() -> None:
    model = TTFTModel(prior_tokens_per_s=1e6)
    model.calibrated("a", (20, 0.05 + 20e-3), (1020, 0.05 + 1020e-3))
    assert model.overhead_s["a"] == pytest.approx(0.05)
    ctx = Context(model="m", prompt_tokens=500)
    assert model.predict(ctx, Worker("a")) == pytest.approx(0.05 + 0.5, rel=0.01)


@pytest.fixture
async def slow_engine() -> AsyncIterator[str]:
    """Answers a completion after 10 ms plus 1 ms per 100 prompt characters."""

    async def completion(request: StubRequest) -> StubReply | None:
        if request.method != "POST" or request.path != "/v1/completions":
            return None
        body = request.json()
        await asyncio.sleep(0.01 + len(body["prompt"]) / 100 * 1e-3)
        return StubReply.json({"choices": [{"text": "x"}]})

    async with StubBackend(completion) as engine:
        yield engine.url


class OneWorkerFleet:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def workers(self) -> list[Worker]:
        return [self.worker]


async def test_startup_calibration_learns_a_worker_s_rate(slow_engine: str) -> None:
    model = TTFTModel(prior_tokens_per_s=1e9)
    fleet = OneWorkerFleet(Worker("a", url=slow_engine))
    pool = ConnectionPool(connect_timeout_s=1.0)
    await calibrate(model, fleet, pool, wait_s=5)  # type: ignore[arg-type]
    await pool.close()
    # 5 characters a word, 4 characters a token: 1 ms per 100 characters is 40 us a token.
    assert model.s_per_token("a", STREAM) == pytest.approx(40e-6, rel=0.5)
    assert model.s_per_token("a", WHOLE) == model.s_per_token("a", STREAM)


class VirtualClock:
    """The loop's clock for admission's waits, moved only by its sleeps: how long admission
    waited is exact, and no test waits for it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        await _real_sleep(0)


_real_sleep = asyncio.sleep


@pytest.fixture
async def clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    virtual = VirtualClock()
    monkeypatch.setattr(asyncio.get_running_loop(), "time", virtual.time)
    monkeypatch.setattr(asyncio, "sleep", virtual.sleep)
    return virtual


def admission(model: TTFTModel, max_wait_ms: float = 10, margin: float = 0.25) -> Admission:
    return Admission(
        model, RouterMetrics(), default_slo_ms=None, max_wait_ms=max_wait_ms, margin_ratio=margin
    )


async def test_admits_when_one_candidate_meets_the_objective() -> None:
    adm = admission(trained())
    ctx = Context(model="m", prompt_tokens=100)
    busy = Worker("a", state=FakeLoad(prefill_tokens=100_000))
    await adm.admit(ctx, [busy, Worker("b")], objective_s=0.5)
    assert adm.decisions.labels("admitted", "normal")._value.get() == 1


async def test_rejects_at_once_far_beyond_the_objective(clock: VirtualClock) -> None:
    adm = admission(trained(), max_wait_ms=2000)
    ctx = Context(model="m", prompt_tokens=10_000)
    with pytest.raises(RouterError) as err:
        await adm.admit(ctx, [Worker("a")], objective_s=0.5)
    assert clock.sleeps == 0
    assert err.value.status == 429 and err.value.code == "slo_unattainable"
    assert err.value.headers["retry-after"] == "10"


async def test_waits_near_the_line_and_admits_once_the_queue_drains(clock: VirtualClock) -> None:
    adm = admission(trained(), max_wait_ms=2000)
    load = FakeLoad(prefill_tokens=150)
    ctx = Context(model="m", prompt_tokens=400)  # 0.55 s predicted against 0.5 s, then 0.4 s

    async def drain() -> None:
        await asyncio.sleep(0.02)
        load.prefill_tokens = 0

    drainer = asyncio.create_task(drain())
    await adm.admit(ctx, [Worker("a", state=load)], objective_s=0.5)
    await drainer
    assert adm.decisions.labels("admitted_after_wait", "normal")._value.get() == 1


async def test_the_wait_counts_against_the_objective(clock: VirtualClock) -> None:
    adm = admission(trained(), max_wait_ms=2000)
    ctx = Context(model="m", prompt_tokens=550)  # 0.55 s, never drains: over the line at 75 ms
    with pytest.raises(RouterError):
        await adm.admit(ctx, [Worker("a")], objective_s=0.5)
    assert clock.now == pytest.approx(0.075, abs=0.011)  # within a poll of the line


async def test_near_the_line_without_draining_rejects_after_the_wait(clock: VirtualClock) -> None:
    adm = admission(trained(), max_wait_ms=50)
    ctx = Context(model="m", prompt_tokens=550)
    with pytest.raises(RouterError):
        await adm.admit(ctx, [Worker("a")], objective_s=0.5)
    assert clock.now == pytest.approx(0.05, abs=0.011)  # the whole wait, not the line


def test_objective_by_priority() -> None:
    adm = Admission(TTFTModel(1000), RouterMetrics(), default_slo_ms=1000, max_wait_ms=10)
    assert adm.objective_s(Context(model="m"), None) == 1.0
    assert adm.objective_s(Context(model="m", priority="low"), None) == 0.5
    assert adm.objective_s(Context(model="m", priority="high"), "5") is None
    assert adm.objective_s(Context(model="m"), "250") == 0.25
