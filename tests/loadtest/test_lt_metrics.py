"""The metrics math on inputs whose answers are known by hand."""

from __future__ import annotations

import pytest

from switchyard.loadtest.client import Result
from switchyard.loadtest.metrics import SLO, hit_rate, percentile, spread, summarize


def _ok(i: int, sent: float, ttft: float, e2e: float, out: int, prompt: int, cached: int) -> Result:
    return Result(
        index=i,
        sent_s=sent,
        ok=True,
        status=200,
        ttft_s=ttft,
        e2e_s=e2e,
        done_s=sent + e2e,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=out,
    )


def test_percentile_interpolates_linearly_between_order_statistics() -> None:
    xs = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(list(map(float, range(1, 101))), 99) == pytest.approx(99.01)


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None


def test_hit_rate_is_cached_over_prompt_tokens() -> None:
    assert hit_rate(300, 1200) == 0.25
    assert hit_rate(0, 0) == 0.0


def test_spread_is_max_over_mean_requests_per_engine() -> None:
    assert spread([10, 10, 10, 10]) == 1.0
    assert spread([40, 0, 0, 0]) == 4.0
    assert spread([3, 1]) == 1.5
    assert spread([0, 0]) is None


def test_tpot_excludes_the_first_token() -> None:
    r = _ok(0, 0.0, ttft=0.1, e2e=1.1, out=11, prompt=10, cached=0)
    assert r.tpot_s == pytest.approx(0.1)
    assert _ok(0, 0.0, 0.1, 0.1, 1, 10, 0).tpot_s is None


def test_goodput_counts_only_requests_meeting_both_objectives() -> None:
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    fast = _ok(0, 0.0, ttft=0.1, e2e=0.5, out=11, prompt=10, cached=0)  # tpot 0.04
    slow_first = _ok(1, 0.0, ttft=0.6, e2e=0.9, out=11, prompt=10, cached=0)
    slow_stream = _ok(2, 0.0, ttft=0.1, e2e=1.1, out=11, prompt=10, cached=0)  # tpot 0.1
    assert [slo.met(r) for r in (fast, slow_first, slow_stream)] == [True, False, False]


def test_summary_on_known_results() -> None:
    results = [
        _ok(0, 0.0, ttft=0.1, e2e=0.5, out=11, prompt=100, cached=50),
        _ok(1, 1.0, ttft=0.3, e2e=1.0, out=11, prompt=300, cached=150),
        _ok(2, 2.0, ttft=0.2, e2e=2.0, out=21, prompt=600, cached=0),
        Result(index=3, sent_s=2.5, status=503, error="HTTP 503"),
    ]
    s = summarize(results, SLO(ttft_s=0.25, tpot_s=1.0), per_engine=[2, 1, 0])
    assert (s.requests, s.ok, s.errors) == (4, 3, 1)
    assert s.makespan_s == pytest.approx(4.0)
    assert s.throughput_rps == pytest.approx(0.75)
    assert s.output_tps == pytest.approx(43 / 4.0)
    assert s.goodput_rps == pytest.approx(2 / 4.0)
    assert s.goodput_frac == pytest.approx(0.5)
    assert s.hit_rate == pytest.approx(200 / 1000)
    assert s.ttft_ms["p50"] == pytest.approx(200.0)
    assert s.spread == pytest.approx(2.0)
    assert s.error_samples == ["HTTP 503"]
