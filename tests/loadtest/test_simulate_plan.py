"""``switchyard plan``: the fewest simulated engines meeting a latency objective."""

from __future__ import annotations

from loadtest.simplan import Objective, assumptions, plan
from loadtest.simulate import SimConfig

BASE = SimConfig(workload="multiturn", workload_params={"rate": 120.0, "duration_s": 2.0})
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
    assert "BLIS" in text and "5753 us" in text and "unified workers only" in text
