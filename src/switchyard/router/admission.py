"""SLO-aware admission: predict time to first token per candidate, reject early when hopeless.

Predicted TTFT = the worker's fixed overhead + seconds per prefill token x (its queued
prefill tokens + this request's uncached tokens). The rate starts from a configured
prior, can be calibrated at start-up (a short and a long canary per worker give the
overhead and the slope) and is then learned from every answer:

- a streamed answer's first chunk is its first token;
- a non-streamed answer's first byte is the whole answer (generation included), so it
  teaches a rate of its own, used to predict other non-streamed requests;
- the engine's own TTFT histogram (``vllm:time_to_first_token_seconds``, SGLang's of
  the same name), scraped with its load, gives the mean engine-side TTFT of the
  requests answered between two scrapes, streamed or not.

Admission scales predictions by the observed 90th percentile of actual over predicted
(per kind), so the admitted meet the objective at p90 even where the linear model is
biased. When the best candidate's prediction exceeds the objective by more than a margin the
request is rejected at once with 429 and Retry-After (Mooncake's early rejection: a
fast "no" beats a slow miss that also delays everyone behind it); when it is over but
within the margin, the request waits briefly for the fleet to drain. Priority "high"
is never rejected; "low" must fit in half the objective.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from switchyard.net.errors import TransportError
from switchyard.router.errors import RouterError
from switchyard.router.request import parse
from switchyard.router.scheduler.framework import Context

if TYPE_CHECKING:
    from prometheus_client import Histogram

    from switchyard.balancer.view import FleetView
    from switchyard.balancer.worker import Worker
    from switchyard.net.httpclient import ConnectionPool
    from switchyard.router.metrics import RouterMetrics

log = logging.getLogger("switchyard.router.admission")

_EWMA = 0.2
# The 90th percentile of actual/predicted first byte, tracked per kind by stochastic
# quantile steps in log space: admission scales predictions by it, so that the admitted
# meet the objective at p90 even where the linear model is biased (queues that batch).
_Q = 0.9
_Q_STEP = 0.05
_Q_BOUNDS = (0.25, 4.0)
_LOG_Q_BOUNDS = (math.log(_Q_BOUNDS[0]), math.log(_Q_BOUNDS[1]))
_POLL_S = 0.01
PRIORITIES = ("high", "normal", "low")


def priority_name(priority: int) -> str:
    """SLO admission's name for a flow-control band: above 0 high, 0 normal, below low."""
    return "high" if priority > 0 else "normal" if priority == 0 else "low"


STREAM, WHOLE = "stream", "whole"
# Calibration canaries: prompt sizes (words of random hex, about one token each).
SHORT_CANARY_WORDS = 16
LONG_CANARY_WORDS = 1024


@dataclass(slots=True)
class Expected:
    """The model's prediction for one dispatch; its actual first byte is compared and learned."""

    model: TTFTModel
    worker_id: str
    work_tokens: float
    predicted_s: float
    kind: str

    def observe(self, actual_s: float) -> None:
        self.model.observe(self, actual_s)

    @property
    def learned(self) -> bool:
        """Whether the prediction rests on answers of its own kind, not on a fallback."""
        return self.model.learned(self.worker_id, self.kind)

    @property
    def spread(self) -> float:
        """The observed 90th percentile of actual over predicted for this kind."""
        return self.model.q90(self.kind == STREAM)


class TTFTModel:
    """Seconds per prefill token per worker and kind (stream: first token; whole: whole
    answer), learned from observed first bytes. A worker not yet observed borrows the
    fleet-wide rate of its kind (same hardware, same model); "whole" falls back to
    "stream" (an answer takes at least as long as its first token), and that to the prior.
    """

    def __init__(self, prior_tokens_per_s: float, ratio: Histogram | None = None) -> None:
        self.prior_s_per_token = 1.0 / prior_tokens_per_s
        self.rate: dict[tuple[str, str], float] = {}
        self.fleet_rate: dict[str, float] = {}
        self.overhead_s: dict[str, float] = {}
        self._ratio = {k: ratio.labels(k) for k in (STREAM, WHOLE)} if ratio is not None else {}
        self._log_q90: dict[str, float] = {}
        # Engine TTFT histogram (sum, count) last seen, and the work of the requests
        # answered since, per worker.
        self._engine_seen: dict[str, tuple[float, float]] = {}
        self._answered: dict[str, tuple[float, int]] = {}

    def learn(self, worker_id: str, kind: str, s_per_token: float) -> None:
        if s_per_token <= 0 or not math.isfinite(s_per_token):
            return
        old = self.rate.get((worker_id, kind))
        self.rate[worker_id, kind] = (
            s_per_token if old is None else old + _EWMA * (s_per_token - old)
        )
        fleet = self.fleet_rate.get(kind)
        self.fleet_rate[kind] = (
            s_per_token if fleet is None else fleet + _EWMA * (s_per_token - fleet)
        )

    def s_per_token(self, worker_id: str, kind: str) -> float:
        found = self.rate.get((worker_id, kind)) or self.fleet_rate.get(kind)
        if found is not None:
            return found
        if kind == WHOLE:
            return self.s_per_token(worker_id, STREAM)
        return self.prior_s_per_token

    def prefill_s_per_token(self, worker_id: str) -> float | None:
        """The worker's own learned first-token rate (``scheduler.scorers.PrefillSpeeds``)."""
        return self.rate.get((worker_id, STREAM))

    def learned(self, worker_id: str, kind: str) -> bool:
        """Whether answers of ``kind`` were observed (from this worker or the fleet)."""
        return (worker_id, kind) in self.rate or kind in self.fleet_rate

    def work_tokens(self, ctx: Context, worker: Worker) -> float:
        # Conditionals, not two-argument min or max, on the request path: those builtins
        # parse their arguments as keywords, several times the cost of a comparison.
        uncached = ctx.prompt_tokens - ctx.matched.get(worker.id, 0.0)
        return (uncached if uncached > 1.0 else 1.0) + worker.load().prefill_tokens

    def predict(self, ctx: Context, worker: Worker, stream: bool = True) -> float:
        return self.expect(ctx, worker, stream).predicted_s

    def expect(self, ctx: Context, worker: Worker, stream: bool) -> Expected:
        """The prediction for sending ``ctx`` to ``worker`` now, to be observed later."""
        self.absorb_engine(worker)
        kind = STREAM if stream else WHOLE
        work = self.work_tokens(ctx, worker)
        predicted = self.overhead_s.get(worker.id, 0.0) + self.s_per_token(worker.id, kind) * work
        return Expected(self, worker.id, work, predicted, kind)

    def observe(self, expected: Expected, actual_s: float) -> None:
        if actual_s <= 0 or expected.work_tokens <= 0:
            return
        if expected.predicted_s > 0:
            ratio = actual_s / expected.predicted_s
            if self._ratio:
                self._ratio[expected.kind].observe(ratio)
            self._track_q90(expected.kind, ratio)
        beyond = actual_s - self.overhead_s.get(expected.worker_id, 0.0)
        self.learn(
            expected.worker_id,
            expected.kind,
            (beyond if beyond > 0.0 else 0.0) / expected.work_tokens,
        )
        work, n = self._answered.get(expected.worker_id, (0.0, 0))
        self._answered[expected.worker_id] = (work + expected.work_tokens, n + 1)

    def _track_q90(self, kind: str, ratio: float) -> None:
        q = self._log_q90.get(kind, 0.0)
        q += _Q_STEP * (_Q if math.log(ratio) > q else _Q - 1.0)
        low, high = _LOG_Q_BOUNDS
        self._log_q90[kind] = low if q < low else high if q > high else q

    def q90(self, stream: bool) -> float:
        """The observed 90th percentile of actual over predicted first byte (1 until seen)."""
        return math.exp(self._log_q90.get(STREAM if stream else WHOLE, 0.0))

    def absorb_engine(self, worker: Worker) -> None:
        """Learn the first-token rate from the engine's TTFT histogram since the last scrape."""
        sample = worker.engine
        if sample is None or sample.ttft_count is None or sample.ttft_sum is None:
            return
        now = (sample.ttft_sum, sample.ttft_count)
        before = self._engine_seen.get(worker.id)
        if before == now:
            return
        self._engine_seen[worker.id] = now
        work, n = self._answered.pop(worker.id, (0.0, 0))
        if before is None or now[1] <= before[1] or n == 0 or work <= 0:
            return  # first sight, an engine restart, or nothing of ours to pair it with
        mean_ttft = (now[0] - before[0]) / (now[1] - before[1])
        self.learn(worker.id, STREAM, mean_ttft / (work / n))

    def calibrated(
        self, worker_id: str, short: tuple[float, float], long: tuple[float, float]
    ) -> None:
        """Take two canaries' (tokens, seconds): the line through them is overhead + slope."""
        (n_short, t_short), (n_long, t_long) = short, long
        slope = (t_long - t_short) / (n_long - n_short) if n_long > n_short else 0.0
        if slope <= 0:
            slope, overhead = t_long / max(n_long, 1.0), 0.0
        else:
            overhead = max(t_short - slope * n_short, 0.0)
        self.overhead_s[worker_id] = overhead
        self.learn(worker_id, STREAM, slope)


class Admission:
    def __init__(
        self,
        model: TTFTModel,
        metrics: RouterMetrics,
        *,
        default_slo_ms: float | None,
        max_wait_ms: float,
        margin_ratio: float = 0.25,
        calibrate: bool = False,
    ) -> None:
        self.model = model
        self.default_slo_ms = default_slo_ms
        self.max_wait_s = max_wait_ms / 1000.0
        self.margin_ratio = margin_ratio
        self.decisions = metrics.admission
        self.calibrate = calibrate
        self._calibration: asyncio.Task[None] | None = None

    def start(self, fleet: FleetView, pool: ConnectionPool) -> None:
        """Calibrate the workers in the background when configured (start-up is not held)."""
        if self.calibrate:
            self._calibration = asyncio.get_running_loop().create_task(
                calibrate(self.model, fleet, pool), name="admission:calibrate"
            )

    async def stop(self) -> None:
        if self._calibration is not None:
            self._calibration.cancel()
            await asyncio.gather(self._calibration, return_exceptions=True)
            self._calibration = None

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

    def best(self, ctx: Context, workers: list[Worker], stream: bool) -> float:
        """The best candidate's first byte at the model's observed 90th-percentile error."""
        return min(self.model.predict(ctx, w, stream) for w in workers) * self.model.q90(stream)

    async def admit(
        self, ctx: Context, workers: list[Worker], objective_s: float, stream: bool = True
    ) -> None:
        """Return when some candidate can meet the objective; raise 429 otherwise.

        Over the objective by more than the margin: reject at once. Within it: wait up to
        the longest admission wait for the fleet to drain, the wait counting against the
        objective, rejecting as soon as the wait plus the prediction leaves the margin.
        """
        best = self.best(ctx, workers, stream)
        if best <= objective_s:
            self.decisions.labels("admitted", ctx.priority).inc()
            return
        line = objective_s * (1.0 + self.margin_ratio)
        if best <= line and self.max_wait_s > 0:
            # Time spent waiting counts against the objective: the client's clock runs.
            loop = asyncio.get_running_loop()
            began = loop.time()
            waited = 0.0
            while waited + best <= line and waited < self.max_wait_s:
                await asyncio.sleep(_POLL_S)
                waited = loop.time() - began
                best = self.best(ctx, workers, stream)
                if waited + best <= objective_s:
                    self.decisions.labels("admitted_after_wait", ctx.priority).inc()
                    return
        self.decisions.labels("rejected", ctx.priority).inc()
        retry = max(1, math.ceil(best - objective_s))
        raise RouterError(
            429,
            f"No worker can meet the TTFT objective of {objective_s * 1e3:.0f} ms "
            f"(best predicted {best * 1e3:.0f} ms); retry later",
            code="slo_unattainable",
            headers={"retry-after": str(retry)},
        )


async def calibrate(
    model: TTFTModel,
    fleet: FleetView,
    pool: ConnectionPool,
    *,
    wait_s: float = 30.0,
    timeout_s: float = 60.0,
) -> None:
    """One short and one long non-streamed canary (one output token) per worker, once each
    is healthy and serves a model; workers not ready within ``wait_s`` keep the prior."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    pending = {w.id for w in fleet.workers()}
    while pending and loop.time() < deadline:
        for worker in fleet.workers():
            if worker.id in pending and worker.healthy and worker.models:
                pending.discard(worker.id)
                try:
                    short = await _canary(pool, worker, SHORT_CANARY_WORDS, timeout_s)
                    long = await _canary(pool, worker, LONG_CANARY_WORDS, timeout_s)
                except (TransportError, TimeoutError, OSError, ValueError) as exc:
                    log.warning("TTFT calibration of %s failed: %s", worker.id, exc)
                    continue
                model.calibrated(worker.id, short, long)
                log.info(
                    "TTFT calibration of %s: %.1f ms overhead, %.0f prefill tokens/s",
                    worker.id,
                    model.overhead_s[worker.id] * 1e3,
                    1.0 / model.s_per_token(worker.id, STREAM),
                )
        await asyncio.sleep(0.1)
    for worker_id in pending:
        log.warning("TTFT calibration: %s was not ready in %.0f s; prior kept", worker_id, wait_s)


async def _canary(
    pool: ConnectionPool, worker: Worker, words: int, timeout_s: float
) -> tuple[float, float]:
    """(estimated prompt tokens, seconds to the answer) of one uncached one-token completion."""
    prompt = " ".join(os.urandom(2).hex() for _ in range(words))
    body = orjson.dumps(
        {"model": sorted(worker.models)[0], "prompt": prompt, "max_tokens": 1, "stream": False}
    )
    tokens = float(parse("/v1/completions", body, None).prompt_tokens_estimate)
    began = time.perf_counter()
    async with asyncio.timeout(timeout_s):
        resp = await pool.post(
            worker.url + "/v1/completions", body, {"content-type": "application/json"}
        )
        try:
            await resp.read()
        finally:
            resp.close()
    if resp.status != 200:
        raise ValueError(f"canary answered {resp.status}")
    return tokens, time.perf_counter() - began
