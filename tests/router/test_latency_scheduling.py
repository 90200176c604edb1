"""The latency policy: kv_aware's cost with each worker's work priced at its own speed."""

from __future__ import annotations

import pytest

from switchyard.router.admission import STREAM, TTFTModel
from switchyard.router.scheduler.policies import build_scheduler
from switchyard.router.scheduler.scorers import KVAwareScorer, LatencyScorer
from tests.router.test_kv_scheduling import FakeLoad, FakeWorker, ctx_with


def latency_policy(rates: dict[str, float], **options: object):  # type: ignore[no-untyped-def]
    scheduler = build_scheduler("latency", dict(options))
    model = TTFTModel(prior_tokens_per_s=1000.0)
    for worker_id, s_per_token in rates.items():
        model.learn(worker_id, STREAM, s_per_token)
    for scorer, _ in scheduler.scorers:
        if isinstance(scorer, LatencyScorer):
            scorer.speeds = model
    return scheduler


def test_a_slow_worker_with_the_same_queue_loses_to_a_fast_one() -> None:
    slow = FakeWorker("slow", state=FakeLoad(prefill_tokens=2000))
    fast = FakeWorker("fast", state=FakeLoad(prefill_tokens=2000))
    policy = latency_policy({"slow": 0.002, "fast": 0.001})
    assert policy.schedule(ctx_with(1024, {}), [slow, fast])[0].id == "fast"


def test_a_fast_worker_takes_more_queue_before_a_slow_idle_one_is_better() -> None:
    """Four times as fast: 2,500 queued tokens there beat an idle worker for a 1,024-token
    prompt (3,524 x 1 against 1,024 x 4); 6,000 do not."""
    fast = FakeWorker("fast", state=FakeLoad(prefill_tokens=2500))
    slow = FakeWorker("slow")
    rates = {"fast": 0.001, "slow": 0.004}
    assert latency_policy(rates).schedule(ctx_with(1024, {}), [slow, fast])[0].id == "fast"
    fast.state.prefill_tokens = 6000
    assert latency_policy(rates).schedule(ctx_with(1024, {}), [slow, fast])[0].id == "slow"


def test_the_prefix_holder_keeps_a_request_until_its_queue_outweighs_the_copy() -> None:
    """Moving 3,584 cached tokens costs their copy (kv_aware's replication weight); at half
    the other worker's speed the holder keeps the request until its queue outweighs it."""
    holder, other = FakeWorker("holder"), FakeWorker("other")
    ctx = ctx_with(4096, {"holder": 3584})
    assert (
        latency_policy({"holder": 0.002, "other": 0.001}).schedule(ctx, [holder, other])[0].id
        == "holder"
    )
    holder.state.prefill_tokens = 40_000
    assert (
        latency_policy({"holder": 0.002, "other": 0.001}).schedule(ctx, [holder, other])[0].id
        == "other"
    )


@pytest.mark.parametrize("rates", [{}, {"a": 0.001, "b": 0.00115, "c": 0.00092}])
def test_equal_engines_cost_what_kv_aware_says(rates: dict[str, float]) -> None:
    """Unlearned speeds, or speeds within the dead band of their median, are one speed."""
    workers = [
        FakeWorker("a", state=FakeLoad(prefill_tokens=500, decode_tokens=4000)),
        FakeWorker("b", state=FakeLoad(prefill_tokens=1500)),
        FakeWorker("c"),
    ]
    ctx = ctx_with(2048, {"a": 1024, "b": 512})
    scorer = next(s for s, _ in latency_policy(rates).scorers if isinstance(s, LatencyScorer))
    assert scorer.costs(ctx, workers) == KVAwareScorer(block_size=16).costs(ctx, workers)  # type: ignore[arg-type]


def test_a_worker_not_yet_learned_is_priced_at_the_median() -> None:
    scorer = next(
        s
        for s, _ in latency_policy({"a": 0.001, "b": 0.003}).scorers
        if isinstance(s, LatencyScorer)
    )
    factors = scorer.factors([FakeWorker("a"), FakeWorker("b"), FakeWorker("new")])  # type: ignore[list-item]
    assert factors == [0.5, 1.5, 1.0]


def test_the_dead_band_is_an_option_of_the_policy() -> None:
    policy = latency_policy({}, dead_band=0.05)
    scorer = next(s for s, _ in policy.scorers if isinstance(s, LatencyScorer))
    assert scorer.dead_band == 0.05
