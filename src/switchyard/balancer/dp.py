"""DP-rank choice for a worker with several data-parallel ranks.

In wide expert-parallel serving every rank's step waits for the slowest rank, so
``step_balanced`` places a request where the *largest* per-step cost after
placement is smallest, using a linear step-time model: a cost per running
sequence, per context token attended, and per prefill token in the step budget.
A decode instance of a P/D pair computes no prefill: its prompts arrive as pulled KV,
context from the start, so their prefill term is left out there.
"""

from __future__ import annotations

from collections.abc import Sequence

from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import RankCounters


def rank_requests(r: RankCounters) -> int:
    return r.inflight + r.remote_inflight


def rank_tokens(r: RankCounters) -> int:
    return r.prefill_tokens + r.remote_prefill_tokens + r.decode_tokens + r.remote_decode_tokens


def step_cost(
    s: BalancerSettings, requests: int, context_tokens: int, prefill_tokens: int
) -> float:
    """Modelled time of one engine step on a rank (arbitrary units)."""
    return (
        s.step_seq_cost_us * requests
        + s.step_context_token_cost_us * context_tokens
        + s.step_prefill_token_cost_us * min(prefill_tokens, s.step_token_budget)
    )


def rank_cost(s: BalancerSettings, r: RankCounters) -> float:
    """Step cost of a rank now; context includes the engine-reported hidden tokens."""
    prefill = r.prefill_tokens + r.remote_prefill_tokens
    return step_cost(s, rank_requests(r), rank_tokens(r) + r.hidden_tokens, prefill)


def least_requests(ranks: Sequence[RankCounters]) -> int:
    return min(range(len(ranks)), key=lambda i: (rank_requests(ranks[i]), rank_tokens(ranks[i])))


def minimum_tokens(ranks: Sequence[RankCounters]) -> int:
    """SGLang's DP controller policy: the rank holding the fewest in-flight tokens."""
    return min(range(len(ranks)), key=lambda i: (rank_tokens(ranks[i]), rank_requests(ranks[i])))


def step_balanced(
    s: BalancerSettings, ranks: Sequence[RankCounters], prompt_tokens: int, *, prefill: bool = True
) -> int:
    """Minimise max-over-ranks step cost after placing the request; ties go to the cheaper rank.

    ``prefill=False`` for a decode instance: prompt tokens count as context only.
    """
    budget = s.step_token_budget if prefill else 0  # a decode instance queues no prefill
    added = s.step_seq_cost_us + s.step_context_token_cost_us * prompt_tokens
    costs: list[float] = []
    afters: list[float] = []
    for r in ranks:
        queued = min(r.prefill_tokens + r.remote_prefill_tokens, budget)
        cost = step_cost(s, rank_requests(r), rank_tokens(r) + r.hidden_tokens, queued)
        grown = min(queued + prompt_tokens, budget) - queued
        costs.append(cost)
        afters.append(cost + added + s.step_prefill_token_cost_us * grown)
    top = second = float("-inf")
    top_i = -1
    for i, c in enumerate(costs):
        if c > top:
            top, second, top_i = c, top, i
        elif c > second:
            second = c
    best_i = 0
    best_key = (float("inf"), float("inf"))
    for i, after in enumerate(afters):
        key = (max(after, second if i == top_i else top), after)
        if key < best_key:
            best_key, best_i = key, i
    return best_i
