"""``switchyard simulate``: the router's policies over simulated engines, without HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard.loadtest.simulate import SimConfig, run_sync, simulate
from switchyard.loadtest.simworkload import sim_workload
from tests.support import REPO

SMALL = {"rate": 6.0, "duration_s": 4.0}


def small(**overrides: object) -> SimConfig:
    cfg = SimConfig(engines=4, workload="multiturn", workload_params=dict(SMALL))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def test_the_same_seed_gives_the_same_figures() -> None:
    first = simulate(small(policies=["kv_aware"]))
    again = simulate(small(policies=["kv_aware"]))
    assert first.runs[0].summary == again.runs[0].summary


def test_kv_aware_follows_the_engines_events_to_the_ceiling_and_round_robin_does_not() -> None:
    outcome = simulate(small(policies=["kv_aware", "round_robin"]))
    kv, rr = (r.summary for r in outcome.runs)
    ceiling = outcome.ceiling.bounded_hit_rate
    assert kv.hit_rate > rr.hit_rate + 0.1
    assert kv.hit_rate >= ceiling - 0.05
    # The engines' own counters agree with what the requests reported.
    assert kv.engine_hit_rate == pytest.approx(kv.hit_rate, abs=0.01)


def test_every_request_is_decided_and_served_once() -> None:
    outcome = simulate(small(policies=["least_load"]))
    run = outcome.runs[0]
    assert run.decisions == len(outcome.workload) == run.summary.ok
    assert sum(run.summary.per_engine) == len(outcome.workload)
    assert run.summary.errors == 0


def test_dp_ranks_are_engines_the_router_addresses_by_rank() -> None:
    outcome = simulate(small(engines=2, dp_size=2, policies=["kv_aware"]))
    run = outcome.runs[0]
    assert len(run.summary.per_engine) == 2
    assert run.summary.ok == len(outcome.workload)
    assert run.summary.hit_rate > 0.5


def test_speed_scales_model_time_to_the_mock_fleets_wall_time() -> None:
    slow = simulate(small(policies=["round_robin"], speed=0.5)).runs[0].summary
    # Arrivals twice as dense in model time, latencies reported at half speed: slower.
    fast = simulate(small(policies=["round_robin"], speed=1.0)).runs[0].summary
    assert slow.tpot_ms["p50"] == pytest.approx(2 * (fast.tpot_ms["p50"] or 0), rel=0.2)


def test_mooncake_prompts_share_tokens_where_the_trace_shares_block_ids(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
        {"timestamp": 500, "input_length": 700, "output_length": 4, "hash_ids": [7, 9]},
        {"timestamp": 1000, "input_length": 600, "output_length": 4, "hash_ids": [7, 8]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    wl = sim_workload("mooncake", 0, {"trace": str(trace), "block_tokens": 32, "speedup": 2.0})
    a, b, c = (wl.prompt(i) for i in range(3))
    assert [len(a), len(b), len(c)] == [64, 44, 38]
    assert a[:32] == b[:32] and a[32:] != b[32:44]
    assert c == a[:38]
    assert wl.arrivals_s == [0.0, 0.25, 0.5]


def test_a_router_call_that_would_wait_for_io_is_refused() -> None:
    import asyncio

    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="waited"):
        run_sync(waits())


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "switchyard", "simulate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(240)
def test_cli_prints_the_table_and_ends_with_one_json_line(tmp_path: Path) -> None:
    proc = run_cli(
        "--engines", "3", "--rate", "5", "--duration", "3", "--policy", "kv_aware,round_robin",
        "--json", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ceiling" in proc.stdout and "TTFT p90 ms" in proc.stdout
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["engines"] == 3 and line["requests"] == 15
    assert line["sim_seconds"] > 0 and line["wall_seconds"] > 0
    assert set(line["policies"]) == {"kv_aware", "round_robin"}
    assert set(line["policies"]["kv_aware"]["ttft_ms"]) == {"p50", "p90", "p99"}
    for name in ("simulate.json", "ttft_cdf.png", "hit_rate.png", "load_spread.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--policy", "no_such"), "unknown policy"),
        (("--workload", "nope"), "unknown workload"),
        (("--engines", "0"), "engines must be at least 1"),
        (("--trace", "trace.jsonl"), "--trace is for --workload mooncake"),
        (("--workload", "mooncake", "--trace", "/nonexistent.jsonl"), "trace not found"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
