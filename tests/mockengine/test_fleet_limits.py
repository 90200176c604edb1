"""A large ``mock-fleet`` fits its open-file and ZMQ socket limits, or says why before starting."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from switchyard.mock.fleet import (
    ENGINES_PER_PROCESS,
    default_processes,
    limits_error,
    open_files,
    plan_fleet,
    raise_fd_limit,
    split,
    zmq_sockets,
)
from switchyard.mock.settings import MockSettings
from tests.support import REPO

pytestmark = pytest.mark.timeout(60)


def fleet(count: int, events: bool = True) -> list[MockSettings]:
    return plan_fleet(None, {}, count, 20000, 0, 0, 30000 if events else None)


def test_default_spreads_at_most_500_engines_per_process() -> None:
    assert ENGINES_PER_PROCESS == 500
    assert [default_processes(n) for n in (1, 500, 501, 2000)] == [1, 1, 2, 4]


def test_two_thousand_engines_with_events_fit_a_20000_file_limit_by_default() -> None:
    specs = fleet(2000)
    assert limits_error(specs, default_processes(2000), 20000) is None


def test_too_low_file_limit_is_one_line_naming_the_need_and_a_process_count() -> None:
    error = limits_error(fleet(500), 1, 1024)
    assert error is not None
    assert "\n" not in error
    assert "ulimit -Hn) is 1024" in error
    suggested = int(error.split("--processes ")[1].split()[0])
    assert max(open_files(g) for g in split(fleet(500), suggested)) <= 1024


def test_engines_without_events_open_no_zmq_sockets() -> None:
    assert zmq_sockets(fleet(10, events=False)) == 0
    assert zmq_sockets(fleet(10)) == 30


def test_a_replay_socket_and_dp_ranks_count_towards_zmq_sockets() -> None:
    specs = plan_fleet(None, {"dp_size": 2}, 3, 20000, 0, 0, 30000)
    specs = [s.model_copy(update={"kv_events_replay_port": 31000}) for s in specs]
    assert zmq_sockets(specs) == 3 * 2 * 4


def test_soft_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        assert raise_fd_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serving_process_sizes_its_zmq_context_for_its_engines() -> None:
    code = (
        "import zmq\n"
        "from switchyard.mock.fleet import plan_fleet, size_zmq_context\n"
        "size_zmq_context(plan_fleet(None, {}, 600, 20000, 0, 0, 30000))\n"
        "print(zmq.Context.instance().get(zmq.MAX_SOCKETS))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert int(out.stdout) >= 600 * 3


def test_cli_refuses_a_fleet_over_the_limit_with_exit_2_and_one_line() -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    proc = subprocess.run(
        [sys.executable, "-m", "switchyard", "mock-fleet", "--count", "500", "--processes", "1"]
        + ["--base-port", "20000", "--kv-events-base-port", "30000"],
        cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        preexec_fn=low_limit,
        timeout=50,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("mock-fleet: 500 engines over 1 process(es) need about")
    assert "Traceback" not in proc.stderr
