"""The DP balance bench says plainly whether step_balanced comes within 3% of the
clairvoyant reference in a scenario."""

from __future__ import annotations

import pytest

from bench.dp_balance import Result, run, verdict, workload


def result(policy: str, ratio: float, step_ms: float = 7.0) -> Result:
    return Result(policy, ratio, ratio, step_ms, 9000.0, 100, 0.1, [ratio] * 10)


def against_clairvoyant(sb: float, cv: float) -> dict[str, Result]:
    return {
        "round_robin": result("round_robin", 1.6),
        "step_balanced": result("step_balanced", sb, 7.2),
        "clairvoyant": result("clairvoyant", cv, 7.0),
    }


def test_target_holds_within_three_percent_of_clairvoyant() -> None:
    line = verdict(against_clairvoyant(1.25, 1.22))
    assert line.startswith("HOLDS")
    assert "+2.5%" in line


def test_target_is_not_met_above_three_percent_of_clairvoyant() -> None:
    line = verdict(against_clairvoyant(1.30, 1.22))
    assert line.startswith("NOT MET")
    assert "+6.6%" in line


def test_verdict_reports_the_ep_step_times() -> None:
    assert "EP step 7.20 vs 7.00 ms" in verdict(against_clairvoyant(1.25, 1.22))


def test_without_the_clairvoyant_row_the_target_is_not_judged() -> None:
    results = against_clairvoyant(1.25, 1.22)
    del results["clairvoyant"]
    assert verdict(results).startswith("not judged")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["step_balanced", "clairvoyant"])
def test_a_small_lockstep_run_reports_a_load_ratio_and_throughput(policy: str) -> None:
    r = run(policy, workload(60, 1), 4, 16, 1, True, 16, {}, 1000.0)
    assert r.ratio_mean >= 1.0 and r.throughput > 0 and len(r.timeline) == 10
