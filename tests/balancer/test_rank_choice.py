"""DP-rank choice policies and per-rank in-flight accounting."""

from __future__ import annotations

import pytest

from switchyard.balancer.dp import rank_cost, step_balanced
from switchyard.balancer.fleet import Fleet
from switchyard.balancer.service import Tickets
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, RankCounters, WorkerSpec


def fleet_with(policy: str, spec: str = "http://127.0.0.1:9;dp=4;models=m") -> Fleet:
    fleet = Fleet(BalancerSettings(dp_policy=policy))
    fleet.add(WorkerSpec.parse(spec))
    return fleet


def test_single_rank_worker_gets_no_rank() -> None:
    fleet = fleet_with("step_balanced", "http://127.0.0.1:9")
    assert fleet.choose_rank(fleet.workers()[0], prompt_tokens=10) is None


def test_round_robin_cycles_through_ranks() -> None:
    fleet = fleet_with("round_robin")
    worker = fleet.workers()[0]
    assert [fleet.choose_rank(worker) for _ in range(8)] == [1, 2, 3, 0, 1, 2, 3, 0]


def test_least_requests_picks_the_rank_with_fewest_inflight() -> None:
    fleet = fleet_with("least_requests")
    worker = fleet.workers()[0]
    for rank in (0, 0, 1, 2, 3):
        fleet.begin(worker, dp_rank=rank)
    assert fleet.choose_rank(worker) == 1


def test_minimum_tokens_picks_the_rank_holding_fewest_tokens() -> None:
    fleet = fleet_with("minimum_tokens")
    worker = fleet.workers()[0]
    for rank, tokens in ((0, 100), (1, 5000), (2, 50), (2, 60), (3, 400)):
        fleet.begin(worker, prompt_tokens=tokens, dp_rank=rank)
    assert fleet.choose_rank(worker) == 0


def test_step_balanced_minimises_the_largest_rank_cost_after_placement() -> None:
    s = BalancerSettings(
        step_seq_cost_us=1.0, step_context_token_cost_us=0.01, step_prefill_token_cost_us=0
    )
    ranks = [RankCounters(inflight=10, decode_seqs=10, decode_tokens=100) for _ in range(3)]
    ranks.append(RankCounters(inflight=2, decode_seqs=2, decode_tokens=3000))
    costs = [rank_cost(s, r) for r in ranks]
    assert costs == pytest.approx([11.0, 11.0, 11.0, 32.0])
    assert step_balanced(s, ranks, prompt_tokens=500) == 0
    assert min(range(4), key=lambda i: ranks[i].inflight) == 3, "least_requests would pick 3"


def test_step_balanced_counts_peers_shared_load() -> None:
    s = BalancerSettings()
    ranks = [RankCounters(), RankCounters(remote_inflight=5, remote_decode_tokens=9000)]
    assert step_balanced(s, ranks, prompt_tokens=100) == 0
    ranks[0].remote_decode_tokens = 20000
    assert step_balanced(s, ranks, prompt_tokens=100) == 1


def test_rank_counters_follow_prefill_decode_and_end() -> None:
    fleet = fleet_with("step_balanced")
    worker = fleet.workers()[0]
    ticket = fleet.begin(worker, prompt_tokens=300, dp_rank=2)
    load = worker.rank_loads()[2]
    assert (load.inflight, load.prefill_tokens, load.decode_seqs) == (1, 300, 0)
    fleet.first_token(ticket)
    fleet.progress(ticket, 40)
    load = worker.rank_loads()[2]
    assert (load.prefill_tokens, load.decode_seqs, load.decode_tokens) == (0, 1, 340)
    fleet.end(ticket, Outcome.SUCCESS)
    fleet.end(ticket, Outcome.SUCCESS)
    assert worker.rank_loads()[2] == type(load)(
        rank=2, inflight=0, prefill_tokens=0, decode_seqs=0, decode_tokens=0
    )
    assert worker.inflight == 0


def test_step_balanced_spreads_equal_requests_over_all_ranks() -> None:
    fleet = fleet_with("step_balanced", "http://127.0.0.1:9;dp=8")
    worker = fleet.workers()[0]
    ranks = []
    for _ in range(8):
        rank = fleet.choose_rank(worker, prompt_tokens=1000)
        fleet.begin(worker, prompt_tokens=1000, dp_rank=rank)
        ranks.append(rank)
    assert sorted(ranks) == list(range(8))


def test_address_of_a_url_per_rank_worker_is_the_ranks_url_without_a_rank_header() -> None:
    fleet = fleet_with("least_requests", "http://h:1;ranks=http://h:3|http://h:4")
    worker = fleet.workers()[0]
    assert worker.dp_size == 2 and worker.spec.dp_mode == "urls"
    assert fleet.address(worker, 1) == ("http://h:4", {})
    assert fleet.address(worker, 0) == ("http://h:3", {})


def test_address_of_a_header_rank_worker_is_its_url_with_the_rank_header() -> None:
    fleet = fleet_with("least_requests")
    worker = fleet.workers()[0]
    url, headers = fleet.address(worker, 3)
    assert (url, dict(headers)) == ("http://127.0.0.1:9", {"X-data-parallel-rank": "3"})


def test_address_without_a_rank_is_the_worker_url_alone() -> None:
    fleet = fleet_with("least_requests", "http://127.0.0.1:9")
    worker = fleet.workers()[0]
    assert fleet.address(worker, None) == ("http://127.0.0.1:9", {})


def test_service_tickets_nobody_ends_expire_as_aborts() -> None:
    fleet = Fleet(BalancerSettings(ticket_ttl_s=0.0, cb_failure_threshold=1))
    worker = fleet.add(WorkerSpec("http://127.0.0.1:9"))
    tickets = Tickets(fleet)
    tickets.add(fleet.begin(worker, prompt_tokens=5))
    assert tickets.expire() == 1
    assert worker.inflight == 0 and worker.circuit == "closed"


def test_worker_load_totals_equal_the_sum_over_ranks() -> None:
    fleet = fleet_with("step_balanced", "http://127.0.0.1:9;dp=4")
    worker = fleet.workers()[0]
    tickets = [fleet.begin(worker, prompt_tokens=10 * (i + 1), dp_rank=i % 4) for i in range(9)]
    for t in tickets[::2]:
        fleet.first_token(t)
        fleet.progress(t, 7)
    for t in tickets[::3]:
        fleet.end(t, Outcome.SUCCESS)
    load, ranks = worker.load(), worker.rank_loads()
    assert load.inflight == sum(r.inflight for r in ranks) == 6
    assert load.prefill_tokens == sum(r.prefill_tokens for r in ranks)
    assert load.decode_seqs == sum(r.decode_seqs for r in ranks)
    assert load.decode_tokens == sum(r.decode_tokens for r in ranks)
