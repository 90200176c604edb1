"""``switchyard bench compare`` end to end, and the fleet reset it relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from switchyard.loadtest.fleet import MockFleet
from switchyard.loadtest.text import default_bank
from switchyard.router.settings import usable_cores
from tests.support import REPO


@pytest.mark.timeout(60)
def test_fleet_reset_empties_every_prefix_cache() -> None:
    body = {
        "model": "mock-model",
        "messages": [{"role": "user", "content": default_bank().text("reset", 200)}],
        "max_tokens": 2,
    }

    def cached(url: str) -> int:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    with MockFleet(2, num_gpu_blocks=200, speed=50.0) as fleet:
        urls = [e.url for e in fleet.engines]
        assert [cached(u) for u in urls] == [0, 0]
        assert all(cached(u) > 0 for u in urls)
        fleet.reset()
        assert [cached(u) for u in urls] == [0, 0]
        assert sum(fleet.served()) == 6


@pytest.mark.timeout(120)
def test_bench_compare_writes_table_json_and_plots_and_reports_unavailable_configs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results"
    args = [
        sys.executable, "-m", "switchyard", "bench", "compare",
        "--engines", "2", "--workload", "shared_prefix",
        "--policies", "round_robin,no_such_policy|least_load,another_unknown",
        "--rate", "15", "--duration", "2", "--max-tokens", "4",
        "--param", "prefix_tokens=300", "--param", "groups=2",
        "--num-gpu-blocks", "400", "--speed", "20", "--repeats", "2",
        "--out", str(out), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout
    for name in ("round_robin", "least_load", "ceiling", "hit rate", "TTFT p90 ms"):
        assert name in table
    assert "another_unknown" in table and "not available" in table

    report = json.loads((out / "compare.json").read_text())
    requests = report["workload"]["requests"]
    assert requests == 30
    runs = report["runs"]
    assert [(r["policy"], r["repeat"]) for r in runs] == [
        ("round_robin", 0),
        ("least_load", 0),
        ("least_load", 1),
        ("round_robin", 1),
    ]
    for run in runs:
        assert run["ok"] == requests and run["errors"] == 0
        assert sum(run["per_engine"]) == requests
        assert 0.0 < run["hit_rate"] <= report["ceiling"]["infinite_hit_rate"] + 1e-9
        assert run["ttft_ms"]["p50"] > 0
        assert run["engine_hit_rate"] == pytest.approx(run["hit_rate"], abs=0.01)
    # Each router process takes its own turns: even to within one request per process.
    per_engine = report["runs"][0]["per_engine"]
    assert max(per_engine) - min(per_engine) <= usable_cores()
    assert set(report["aggregate"]) == {"round_robin", "least_load"}
    assert set(report["unavailable"]) == {"no_such_policy", "another_unknown"}
    for png in ("ttft_cdf.png", "hit_rate.png", "load_spread.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
