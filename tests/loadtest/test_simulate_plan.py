"""``switchyard plan``: the fewest simulated engines meeting a latency objective."""

from __future__ import annotations

import dataclasses

import pytest

from switchyard.loadtest.simplan import Objective, assumptions, plan, plan_split, splits
from switchyard.loadtest.simulate import SimConfig, simulate

# Small engines (2000 KV blocks), so two seconds of arrivals need more than one of them.
BASE = SimConfig(
    workload="multiturn", workload_params={"rate": 120.0, "duration_s": 2.0}, num_gpu_blocks=2000
)
OBJECTIVE = Objective(ttft_p90_ms=200.0, tpot_p90_ms=30.0)


def test_the_size_found_meets_the_objective_and_one_fewer_does_not() -> None:
    result = plan(BASE, OBJECTIVE, "kv_aware", ["kv_aware", "round_robin"], max_engines=16)
    assert result.engines is not None and result.engines > 1
    assert OBJECTIVE.met(result.probes[result.engines])
    assert not OBJECTIVE.met(result.probes[result.engines - 1])
    assert [r.policy for r in result.compared] == ["kv_aware", "round_robin"]


def test_no_size_is_claimed_when_the_largest_fleet_falls_short() -> None:
    result = plan(BASE, Objective(1.0, 1.0), "kv_aware", [], max_engines=2)
    assert result.engines is None
    assert sorted(result.probes) == [1, 2]


def test_the_assumptions_name_the_timing_model_and_its_coefficients() -> None:
    text = assumptions(BASE)
    assert "BLIS" in text and "5753 us" in text and "Unified workers only" in text


def test_p_d_pools_serve_every_request_once_through_both_legs() -> None:
    cfg = dataclasses.replace(BASE, engines=4, prefill_engines=1, policies=["kv_aware"])
    outcome = simulate(cfg)
    run = outcome.runs[0]
    assert run.decisions == len(outcome.workload) == run.summary.ok
    assert run.summary.errors == 0


def test_a_p_d_request_waits_for_its_prefill_and_kv_pull_before_its_first_token() -> None:
    unified = simulate(dataclasses.replace(BASE, engines=4, policies=["kv_aware"])).runs[0]
    split = simulate(
        dataclasses.replace(BASE, engines=4, prefill_engines=2, policies=["kv_aware"])
    ).runs[0]
    assert split.summary.ttft_ms["p50"] > unified.summary.ttft_ms["p50"]


def test_a_split_must_leave_a_decode_engine() -> None:
    with pytest.raises(ValueError, match="decode engine"):
        simulate(dataclasses.replace(BASE, engines=2, prefill_engines=2))


def test_every_split_up_to_16_engines_is_tried_and_15_beyond() -> None:
    assert splits(4) == [1, 2, 3]
    assert len(splits(64)) == 15 and splits(64)[0] == 4 and splits(64)[-1] == 60


def test_the_best_split_meets_the_objective_with_the_most_headroom() -> None:
    result = plan_split(BASE, OBJECTIVE, "kv_aware", 4)
    assert sorted(result.runs) == [1, 2, 3]
    assert result.best is not None and OBJECTIVE.met(result.runs[result.best])
    assert all(result.headroom(result.best) <= result.headroom(p) for p in result.runs)


def test_the_assumptions_of_a_split_name_the_kv_pull() -> None:
    text = assumptions(dataclasses.replace(BASE, engines=4, prefill_engines=1))
    assert "P/D pools" in text and "KV pull 42 us per block" in text
