"""The one process launcher: healthy means the health URL answers 2xx, a dead child fails fast."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from switchyard.loadtest.procs import ProcessExited, Server, free_port, free_port_block, wait_http

HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def python_server(port: int) -> Server:
    """Any process, not only ``switchyard``: a tiny HTTP server with ``/health``."""
    return Server([], port, argv=[sys.executable, "-c", HEALTH_SERVER, str(port)])


def test_a_server_is_up_once_its_health_path_answers() -> None:
    port = free_port()
    with python_server(port) as srv:
        assert srv.proc is not None and srv.proc.poll() is None
    assert srv.proc.poll() is not None


def test_a_missing_ready_path_falls_back_to_the_fallback_url() -> None:
    port = free_port()
    with python_server(port):
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(TimeoutError):
            wait_http(url + "/ready", 0.5)
        wait_http(url + "/ready", 5.0, fallback_url=url + "/health")  # raises if it fails


def test_a_child_that_dies_before_it_is_healthy_fails_at_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    with pytest.raises(ProcessExited, match="exited with 3"):
        wait_http(f"http://127.0.0.1:{free_port()}/health", 20.0, proc)
    assert time.monotonic() - started < 10


def test_a_failed_start_reports_the_childs_stderr() -> None:
    port = free_port()
    argv = [sys.executable, "-c", "import sys; sys.exit('no such model')"]
    with pytest.raises(RuntimeError, match="no such model"):
        Server([], port, argv=argv).start(5.0)


def test_a_port_block_is_free_end_to_end() -> None:
    base = free_port_block(4)
    bound = []
    for port in range(base, base + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            bound.append(s.getsockname()[1])
    assert bound == [base, base + 1, base + 2, base + 3]


def test_port_blocks_handed_out_never_overlap() -> None:
    blocks = [set(range(b, b + 3)) for b in (free_port_block(3) for _ in range(200))]
    assert sum(len(b) for b in blocks) == len(set().union(*blocks))


def test_a_free_port_lies_below_the_kernels_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(free_port() < low for _ in range(50))


def port_frees_within(port: int, seconds: float) -> bool:
    """Whether nothing listens on ``port`` any more (closed connections may linger)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                time.sleep(0.05)
    return False


def test_a_server_in_its_own_group_stops_with_its_children() -> None:
    """The health server is a grandchild: only signalling the group stops it."""
    port = free_port()
    spawn = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', *sys.argv[1:]])"
    argv = [sys.executable, "-c", f"{spawn}; import time; time.sleep(60)", HEALTH_SERVER, str(port)]
    with Server([], port, argv=argv, own_group=True):
        assert not port_frees_within(port, 0.1)
    assert port_frees_within(port, 5.0)


def test_a_killed_server_takes_its_children_with_it() -> None:
    """Outside its own group too: a router supervisor's processes must not outlive it."""
    port = free_port()
    spawn = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', *sys.argv[1:]])"
    argv = [sys.executable, "-c", f"{spawn}; import time; time.sleep(60)", HEALTH_SERVER, str(port)]
    server = Server([], port, argv=argv).start()
    server.kill()
    assert port_frees_within(port, 5.0)
