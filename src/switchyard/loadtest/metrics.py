"""The numbers a comparison is judged by, computed from replay results and engine counters.

- latency percentiles (TTFT, TPOT, ITL, end to end) over successful requests, linear
  interpolation between order statistics (numpy's default);
- throughput: successful requests and output tokens per second of makespan (first
  send to last completion);
- goodput: requests per second that met BOTH service objectives (TTFT ≤ slo_ttft and
  TPOT ≤ slo_tpot), DistServe's definition;
- fleet hit rate: Σ cached prompt tokens / Σ prompt tokens, as the engines reported them;
- load spread: max / mean requests per engine (1.0 is perfectly even).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from switchyard.loadtest.client import Result


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0–100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def hit_rate(cached: int, prompt: int) -> float:
    return cached / prompt if prompt else 0.0


def spread(per_engine: list[int]) -> float | None:
    """max / mean requests per engine; None when nothing was served."""
    if not per_engine or sum(per_engine) == 0:
        return None
    return max(per_engine) / (sum(per_engine) / len(per_engine))


@dataclass
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, r: Result) -> bool:
        tpot = r.tpot_s
        return (
            r.ok
            and r.ttft_s is not None
            and r.ttft_s <= self.ttft_s
            and (tpot is None or tpot <= self.tpot_s)
        )


@dataclass
class Summary:
    requests: int
    ok: int
    errors: int
    makespan_s: float
    throughput_rps: float
    output_tps: float
    goodput_rps: float
    goodput_frac: float
    hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    per_engine: list[int] = field(default_factory=list)
    spread: float | None = None
    error_samples: list[str] = field(default_factory=list)
    # The engines' own view (prefix-cache hits / queried tokens): a cross-check of
    # ``hit_rate`` that does not depend on the router passing usage through.
    engine_hit_rate: float | None = None


def _ms(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in qs:
        v = percentile(values, q)
        out[f"p{q}"] = None if v is None else v * 1000.0
    return out


def summarize(results: list[Result], slo: SLO, per_engine: list[int] | None = None) -> Summary:
    ok = [r for r in results if r.ok]
    done = [r.done_s for r in ok if r.done_s is not None]
    start = min((r.sent_s for r in results), default=0.0)
    makespan = (max(done) - start) if done else 0.0
    rate = (lambda n: n / makespan) if makespan > 0 else (lambda n: 0.0)
    good = sum(1 for r in ok if slo.met(r))
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    engines = list(per_engine or [])
    return Summary(
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        makespan_s=makespan,
        throughput_rps=rate(len(ok)),
        output_tps=rate(sum(r.output_tokens for r in ok)),
        goodput_rps=rate(good),
        goodput_frac=good / len(results) if results else 0.0,
        hit_rate=hit_rate(cached, prompt),
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_ms=_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=_ms([t for r in ok if (t := r.tpot_s) is not None]),
        e2e_ms=_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        itl_ms=_ms([gap for r in ok for gap in r.itl_s]),
        per_engine=engines,
        spread=spread(engines),
        error_samples=sorted({r.error for r in results if not r.ok})[:5],
    )
