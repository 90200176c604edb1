"""TTFT prediction and SLO admission decisions."""

from __future__ import annotations

import pytest

from router.admission import Admission, TTFTModel
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.scheduler.framework import Context
from tests.router.test_kv_scheduling import FakeLoad, FakeWorker


def trained(rate_s_per_token: float = 1e-3) -> TTFTModel:
    model = TTFTModel()
    model.observe("a", rate_s_per_token * 1000, 1000)
    return model


def test_prediction_grows_with_queued_prefill() -> None:
    model = trained()
    idle = FakeWorker("a")
    queued = FakeWorker("a", state=FakeLoad(prefill_tokens=4000))
    ctx = Context(model="m", prompt_tokens=1000)
    assert model.predict(ctx, queued) > 4 * model.predict(ctx, idle)  # type: ignore[operator]


def test_unobserved_worker_borrows_the_fleet_rate() -> None:
    model = trained()
    ctx = Context(model="m", prompt_tokens=1000)
    assert model.predict(ctx, FakeWorker("b")) == pytest.approx(1.0, rel=0.01)


def test_no_observation_means_no_prediction() -> None:
    assert TTFTModel().predict(Context(model="m", prompt_tokens=10), FakeWorker("a")) is None


async def test_admits_when_one_candidate_meets_the_objective() -> None:
    admission = Admission(trained(), RouterMetrics(), default_slo_ms=None, max_wait_ms=10)
    ctx = Context(model="m", prompt_tokens=100)
    busy = FakeWorker("a", state=FakeLoad(prefill_tokens=100_000))
    await admission.admit(ctx, [busy, FakeWorker("b")], objective_s=0.5)
    assert admission.decisions.labels("admitted", "normal")._value.get() == 1


async def test_rejects_with_429_when_none_can() -> None:
    admission = Admission(trained(), RouterMetrics(), default_slo_ms=None, max_wait_ms=10)
    ctx = Context(model="m", prompt_tokens=10_000)
    with pytest.raises(RouterError) as err:
        await admission.admit(ctx, [FakeWorker("a")], objective_s=0.5)
    assert err.value.status == 429 and "retry-after" in err.value.headers


def test_objective_by_priority() -> None:
    admission = Admission(TTFTModel(), RouterMetrics(), default_slo_ms=1000, max_wait_ms=10)
    assert admission.objective_s(Context(model="m"), None) == 1.0
    assert admission.objective_s(Context(model="m", priority="low"), None) == 0.5
    assert admission.objective_s(Context(model="m", priority="high"), "5") is None
    assert admission.objective_s(Context(model="m"), "250") == 0.25
