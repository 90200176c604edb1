"""``switchyard bench compare --worker`` (a running fleet) and ``switchyard bench run``
(any OpenAI endpoint), against running mock engines."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchyard.router.settings import usable_cores
from tests.support import REPO, Server, free_port

WORKLOAD = [
    "--workload", "shared_prefix", "--param", "rate=15", "--param", "duration_s=2",
    "--param", "max_tokens=4", "--param", "prefix_tokens=300", "--param", "groups=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Server]]:
    """Two mock engines publishing KV events, found only through /kv_event_sources."""
    started: list[Server] = []
    try:
        for _ in range(2):
            port = free_port()
            argv = ["mock", "--port", str(port), "--model", "real-fleet-model", "--speed", "20"]
            argv += ["--num-gpu-blocks", "400", "--kv-events-port", str(free_port())]
            started.append(Server(argv, port).start())
        yield started
    finally:
        for server in started:
            server.stop()


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "switchyard", "bench", *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=170)


@pytest.mark.timeout(180)
def test_compare_on_running_workers_routes_every_request_and_counts_engine_hits(
    engines: list[Server], tmp_path: Path
) -> None:
    workers = [a for e in engines for a in ("--worker", e.url)]
    proc = bench(
        "compare", *workers, *WORKLOAD, "--policies", "round_robin,kv_aware",
        "--repeats", "1", "--out", str(tmp_path), "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "compare.json").read_text())
    requests = report["workload"]["requests"]
    assert [r["policy"] for r in report["runs"]] == ["round_robin", "kv_aware"]
    for run in report["runs"]:
        assert run["ok"] == requests and run["errors"] == 0
        # kv_aware's router also sends its hash-parity canaries (a few per engine).
        assert requests <= sum(run["per_engine"]) <= requests + 2 * len(engines)
    # Each router process (one per core by default) takes its own turns: round robin is
    # even to within one request per process.
    per_engine = report["runs"][0]["per_engine"]
    assert sum(per_engine) == requests and max(per_engine) - min(per_engine) <= usable_cores()
    assert report["runs"][1]["hit_rate"] > report["runs"][0]["hit_rate"]


@pytest.mark.timeout(180)
def test_run_against_an_endpoint_prints_the_compare_table(
    engines: list[Server], tmp_path: Path
) -> None:
    proc = bench("run", "--target", engines[0].url, *WORKLOAD, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "target" in proc.stdout and "TTFT p90 ms" in proc.stdout
    report = json.loads((tmp_path / "compare.json").read_text())
    (run,) = report["runs"]
    assert run["ok"] == report["workload"]["requests"] and run["hit_rate"] > 0


def test_run_against_a_dead_endpoint_is_a_one_line_error(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc = bench("run", "--target", dead, *WORKLOAD, "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
