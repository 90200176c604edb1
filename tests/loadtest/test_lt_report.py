"""Aggregation over repetitions (median and worst run) and what the reports say."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from switchyard.loadtest.ceiling import Ceiling
from switchyard.loadtest.compare import CompareConfig, Outcome, Run
from switchyard.loadtest.demo import headline
from switchyard.loadtest.metrics import Summary
from switchyard.loadtest.report import aggregate, render_table, to_json
from switchyard.loadtest.routers import RouterSpec
from switchyard.loadtest.workloads import build_workload


def _summary(hit: float, ttft_p90: float, rps: float) -> Summary:
    return Summary(
        requests=10, ok=10, errors=0, makespan_s=1.0, throughput_rps=rps, output_tps=rps * 8,
        goodput_rps=rps, goodput_frac=1.0, hit_rate=hit, prompt_tokens=1000,
        cached_tokens=int(hit * 1000),
        ttft_ms={"p50": ttft_p90 / 2, "p90": ttft_p90, "p99": ttft_p90 * 2},
        tpot_ms={"p50": 5.0, "p90": 6.0, "p99": 7.0}, e2e_ms={"p50": 1.0, "p90": 2.0, "p99": 3.0},
        itl_ms={"p50": 5.0, "p90": 6.0, "p99": 7.0}, per_engine=[6, 4], spread=1.2,
    )  # fmt: skip


def _outcome() -> Outcome:
    cfg = CompareConfig(engines=2, policies=["round_robin", "kv_aware"], out=Path("x"))
    w = build_workload("random", 0, rate=10.0, duration_s=1.0)
    out = Outcome(cfg, w, Ceiling(1000, 0.9, 0.85, 4000))
    for repeat, (rr, kv) in enumerate([(0.30, 0.80), (0.35, 0.70), (0.32, 0.82)]):
        out.runs.append(Run("round_robin", repeat, _summary(rr, 100.0 + repeat, 5.0), [1.0]))
        out.runs.append(Run("kv_aware", repeat, _summary(kv, 50.0 + 10 * repeat, 6.0), [1.0]))
    out.unavailable["smg:cache_aware"] = "smg is not installed"
    return out


def test_aggregate_takes_the_median_and_the_worst_run_per_column() -> None:
    agg = aggregate(_outcome())
    assert agg["kv_aware"]["hit rate"] == {"median": 0.80, "worst": 0.70}
    assert agg["kv_aware"]["TTFT p90 ms"] == {"median": 60.0, "worst": 70.0}
    assert agg["round_robin"]["req/s"] == {"median": 5.0, "worst": 5.0}


def test_table_shows_median_worst_ceiling_and_unavailable_configs() -> None:
    console = Console(width=250, record=True)
    console.print(render_table(_outcome()))
    text = console.export_text()
    assert "0.800 (0.700)" in text
    assert "ceiling" in text and "0.850" in text
    assert "smg:cache_aware" in text and "not available" in text


def test_json_keeps_every_run_and_the_reasons() -> None:
    data = to_json(_outcome())
    assert len(data["runs"]) == 6
    assert data["ceiling"]["bounded_hit_rate"] == 0.85
    assert data["unavailable"] == {"smg:cache_aware": "smg is not installed"}


def test_demo_headline_compares_our_policy_with_round_robin() -> None:
    line = headline(_outcome())
    assert "kv_aware" in line and "80%" in line and "round_robin 32%" in line


def test_json_names_a_router_run_from_another_checkout_by_its_label() -> None:
    outcome = _outcome()
    outcome.config.specs = [RouterSpec.parse("kv_aware").run_from(Path("/src/old"), "abc123")]
    data = json.loads(json.dumps(to_json(outcome)))
    assert data["config"]["specs"] == ["kv_aware abc123"]
