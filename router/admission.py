"""SLO-aware admission: predict time to first token per candidate, reject early when hopeless.

Predicted TTFT = seconds per prefill token (learned online per worker from streamed
first tokens) x (the worker's queued prefill tokens + this request's uncached tokens).
When no candidate can meet the request's objective, the request waits briefly for
the fleet to drain, then is rejected with 429 and Retry-After — Mooncake's early
rejection: better a fast "no" than a slow miss that also delays everyone behind it.
Priority "high" is never rejected; "low" must fit in half the objective.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

from router.errors import RouterError
from router.scheduler.framework import Context

if TYPE_CHECKING:
    from balancer.worker import Worker
    from router.metrics import RouterMetrics

_EWMA = 0.2
_POLL_S = 0.01
PRIORITIES = ("high", "normal", "low")


class TTFTModel:
    """Seconds per prefill token, per worker, learned from observed first tokens.

    A worker not yet observed borrows the fleet-wide rate (same hardware, same model).
    """

    def __init__(self) -> None:
        self.rate: dict[str, float] = {}
        self.fleet_rate: float | None = None

    def observe(self, worker_id: str, ttft_s: float, work_tokens: float) -> None:
        if work_tokens <= 0 or ttft_s <= 0:
            return
        sample = ttft_s / work_tokens
        old = self.rate.get(worker_id)
        self.rate[worker_id] = sample if old is None else old + _EWMA * (sample - old)
        fleet = self.fleet_rate
        self.fleet_rate = sample if fleet is None else fleet + _EWMA * (sample - fleet)

    def work_tokens(self, ctx: Context, worker: Worker) -> float:
        uncached = max(ctx.prompt_tokens - ctx.matched.get(worker.id, 0.0), 1.0)
        return uncached + worker.load().prefill_tokens

    def predict(self, ctx: Context, worker: Worker) -> float | None:
        rate = self.rate.get(worker.id, self.fleet_rate)
        if rate is None:
            return None
        return rate * self.work_tokens(ctx, worker)


class Admission:
    def __init__(
        self,
        model: TTFTModel,
        metrics: RouterMetrics,
        *,
        default_slo_ms: float | None,
        max_wait_ms: float,
    ) -> None:
        self.model = model
        self.default_slo_ms = default_slo_ms
        self.max_wait_s = max_wait_ms / 1000.0
        self.decisions = metrics.admission

    def objective_s(self, ctx: Context, header_ms: str | None) -> float | None:
        slo_ms = self.default_slo_ms
        if header_ms is not None:
            try:
                slo_ms = float(header_ms)
            except ValueError:
                raise RouterError(400, "x-slo-ttft-ms must be a number of milliseconds") from None
            if not math.isfinite(slo_ms) or slo_ms <= 0:
                raise RouterError(400, "x-slo-ttft-ms must be a positive number of milliseconds")
        if slo_ms is None or ctx.priority == "high":
            return None
        return slo_ms / 1000.0 * (0.5 if ctx.priority == "low" else 1.0)

    def feasible(self, ctx: Context, workers: list[Worker], objective_s: float) -> bool:
        for w in workers:
            predicted = self.model.predict(ctx, w)
            if predicted is None or predicted <= objective_s:
                return True
        return False

    async def admit(self, ctx: Context, workers: list[Worker], objective_s: float) -> None:
        """Return when some candidate can meet the objective; raise 429 otherwise."""
        if self.feasible(ctx, workers, objective_s):
            self.decisions.labels("admitted", ctx.priority).inc()
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
            if self.feasible(ctx, workers, objective_s):
                self.decisions.labels("admitted_after_wait", ctx.priority).inc()
                return
        self.decisions.labels("rejected", ctx.priority).inc()
        best = min(
            (p for p in (self.model.predict(ctx, w) for w in workers) if p is not None),
            default=0.0,
        )
        retry = max(1, math.ceil(best - objective_s))
        raise RouterError(
            429,
            f"No worker can meet the TTFT objective of {objective_s * 1e3:.0f} ms "
            f"(best predicted {best * 1e3:.0f} ms); retry later",
            code="slo_unattainable",
            headers={"retry-after": str(retry)},
        )
