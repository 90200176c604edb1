"""step_balanced on a P/D decode instance: pulled prompts are context, not prefill work."""

from __future__ import annotations

from switchyard.balancer.dp import step_balanced
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import RankCounters


def ranks_with_a_pull_in_flight() -> list[RankCounters]:
    """Rank 0 awaits one 4000-token prompt's KV; rank 1 decodes five long contexts."""
    pulling = RankCounters(inflight=1, prefill_tokens=4000)
    decoding = RankCounters(inflight=5, decode_seqs=5, decode_tokens=20000)
    return [pulling, decoding]


def test_unified_ranks_count_a_queued_prompt_as_prefill_work() -> None:
    assert step_balanced(BalancerSettings(), ranks_with_a_pull_in_flight(), 500) == 1


def test_decode_instance_counts_a_pulled_prompt_as_context_only() -> None:
    ranks = ranks_with_a_pull_in_flight()
    assert step_balanced(BalancerSettings(), ranks, 500, prefill=False) == 0


def test_decode_instance_places_a_long_prompt_by_context_alone() -> None:
    s = BalancerSettings()
    ranks = [RankCounters(inflight=2, decode_seqs=2, decode_tokens=9000), RankCounters()]
    ranks[1].inflight, ranks[1].prefill_tokens = 6, 6 * 1000
    assert step_balanced(s, ranks, 8000, prefill=False) == 1
    assert step_balanced(s, ranks, 8000) == 0
