"""``switchyard mock-fleet`` runs many engines and prints where each one serves what."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest

from switchyard.loadtest.procs import free_port_block
from tests.support import REPO, wait_http

pytestmark = pytest.mark.timeout(60)


def run_fleet(*args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard", "mock-fleet", *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "fleet exited before printing its description"
    return proc, json.loads(line)


def stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=10)


def test_one_process_fleet_describes_and_serves_every_engine() -> None:
    start = free_port_block(6)
    proc, desc = run_fleet(
        "--count",
        "3",
        "--base-port",
        str(start),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--speed",
        "50",
        "--kv-events-base-port",
        str(start + 3),
    )
    try:
        engines = desc["engines"]
        urls = [e["urls"][0]["url"] for e in engines]
        answers = [
            httpx.post(u + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code
            for u in urls
        ]
    finally:
        code = stop(proc)
    assert [e["role"] for e in engines] == ["prefill", "decode", "unified"]
    assert urls == [f"http://127.0.0.1:{start + i}" for i in range(3)]
    assert [e["kv_events"][0]["endpoint"] for e in engines] == [
        f"tcp://127.0.0.1:{start + 3 + i}" for i in range(3)
    ]
    assert answers == [200, 200, 200]
    assert code == 0


def test_multi_process_fleet_spreads_engines_over_processes() -> None:
    start = free_port_block(4)
    proc, desc = run_fleet(
        "--count",
        "4",
        "--base-port",
        str(start),
        "--processes",
        "2",
        "--dp-size",
        "2",
        "--speed",
        "50",
    )
    try:
        urls = [e["urls"][0]["url"] for e in desc["engines"]]
        for u in urls:
            wait_http(u + "/health", timeout=10)
        ranks = [e["urls"][0]["dp_ranks"] for e in desc["engines"]]
    finally:
        stop(proc)
    assert len(urls) == 4
    assert ranks == [[0, 1]] * 4
