"""The DP balance bench says plainly whether the DP-balance target holds in a scenario."""

from __future__ import annotations

import pytest

from bench.dp_balance import Result, run, verdict, workload


def result(policy: str, ratio: float, throughput: float) -> Result:
    return Result(policy, ratio, ratio, 7.0, throughput, 100, 0.1, [ratio] * 10)


def rr_and_sb(rr: float, sb: float, sb_throughput: float) -> dict[str, Result]:
    """round_robin at 9000 tok/s against step_balanced."""
    return {
        "round_robin": result("round_robin", rr, 9000),
        "step_balanced": result("step_balanced", sb, sb_throughput),
    }


def test_target_holds_when_round_robin_is_bad_and_step_balanced_is_flat_and_faster() -> None:
    results = rr_and_sb(1.6, 1.1, 9500)
    assert verdict(results).startswith("HOLDS")


def test_target_is_not_met_where_round_robin_is_already_balanced() -> None:
    results = rr_and_sb(1.3, 1.08, 9500)
    assert verdict(results) == "NOT MET: round_robin 1.300 does not exceed 1.5"


def test_target_names_every_part_that_fails() -> None:
    results = rr_and_sb(1.6, 1.24, 8000)
    line = verdict(results)
    assert "step_balanced 1.240 > 1.15" in line and "no more tok/s" in line


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["step_balanced", "clairvoyant"])
def test_a_small_lockstep_run_reports_a_load_ratio_and_throughput(policy: str) -> None:
    r = run(policy, workload(60, 1), 4, 16, 1, True, 16, {}, 1000.0)
    assert r.ratio_mean >= 1.0 and r.throughput > 0 and len(r.timeline) == 10
