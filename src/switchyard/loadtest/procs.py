"""Launching a process and waiting until it is healthy: the one way for tests, benches, harness.

Everything binds loopback. A process counts as up once an HTTP health URL answers 2xx
(``Server``, ``wait_http``) or, for redis-server, once its port accepts a connection.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

# How long a killed process may take to be reaped: a router beside a NixlConnector pair
# that keeps the cores busy can take several seconds.
KILL_WAIT_S = 60.0


class ProcessExited(RuntimeError):
    """The process died before it became healthy."""


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3 onwards)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> set[int]:
    """``pid`` and every live process below it, from one scan of /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and every process below it, and reap it. Its children are found
    first: once it is dead they belong to init (a router supervisor's processes would
    live on, serving and probing)."""
    if proc.poll() is not None:
        return
    for pid in descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=KILL_WAIT_S)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process and its live descendants, seconds.

    A router under ``--processes`` (the default: one per core) serves from its children,
    so the supervisor's own time would leave out nearly all of it."""
    return sum(cpu_times(pid))


def cpu_times(pid: int) -> tuple[float, float]:
    """``cpu_seconds`` apart: (user, system) seconds. System time is mostly the socket
    calls, which a router in any language makes; user time is its own code."""
    user = system = 0
    for member in descendants(pid):
        try:
            fields = _stat(member)
        except OSError:
            continue  # exited since the scan
        user += int(fields[11])
        system += int(fields[12])
    return user * _TICK_S, system * _TICK_S


def python_from(code: Path | None) -> tuple[list[str], dict[str, str]]:
    """The interpreter command and environment that import Switchyard from the checkout
    ``code`` (the installed one when None). ``-P`` keeps the working directory, this
    checkout, from shadowing it on ``sys.path``."""
    env = dict(os.environ)
    if code is None:
        return [sys.executable], env
    src = code / "src"
    env["PYTHONPATH"] = str(src if (src / "switchyard").is_dir() else code)
    return [sys.executable, "-P"], env


def free_port() -> int:
    """One free loopback port, chosen as ``free_port_block`` chooses: a port the kernel
    hands out for port 0 can be taken again before the server binds it."""
    return free_port_block(1)


def _ephemeral_low() -> int:
    """The first port the kernel hands out to sockets bound to port 0 (Linux's default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()
"""Ports this process handed out already: two calls never return overlapping ports, even
before the first caller's server has bound its own."""


def free_port_block(n: int, rng: random.Random | None = None) -> int:
    """First port of ``n`` consecutive free loopback ports, below the kernel's ephemeral
    range: a port chosen inside it could be taken by another process's outgoing or
    port-0 socket before its server binds it (a vLLM engine of a P/D pair exits with
    "Address already in use" when the other engine's sockets took its port)."""
    rng = rng or random.Random()
    high = max(_ephemeral_low(), 20000 + n + 1)
    for _ in range(200):
        base = rng.randrange(10000, high - n)
        if not _HANDED_OUT.isdisjoint(range(base, base + n)):
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            _HANDED_OUT.update(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def wait_http(
    url: str,
    timeout: float = 60.0,
    proc: subprocess.Popen[bytes] | subprocess.Popen[str] | None = None,
    fallback_url: str | None = None,
) -> None:
    """Poll ``url`` until it answers 2xx; fail early if ``proc`` died.

    A server without ``url`` (404) is polled at ``fallback_url`` instead, when given.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ProcessExited(f"server exited with {proc.returncode} before {url} answered")
        try:
            answer = httpx.get(url, timeout=1.0)
            if answer.is_success:
                return
            if answer.status_code == 404 and fallback_url is not None:
                url, fallback_url = fallback_url, None
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s: {last}")


class Server:
    """A process on loopback, up once ``health_path`` on ``port`` answers 2xx.

    By default the process is ``python -m switchyard <args>``; ``argv`` runs anything
    else. ``own_group`` starts it in its own process group and signals the whole group,
    for servers that fork workers (nginx, ``--processes``).
    """

    def __init__(
        self,
        args: list[str],
        port: int,
        health_path: str = "/health",
        *,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        own_group: bool = False,
        capture_stderr: bool = True,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.args = args
        self.argv = argv if argv is not None else [sys.executable, "-m", "switchyard", *args]
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health_path = health_path
        self.env = env
        self.own_group = own_group
        self.capture_stderr = capture_stderr
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float | None = None) -> Server:
        env = dict(self.env if self.env is not None else os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.argv,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if self.capture_stderr else subprocess.DEVNULL,
            start_new_session=self.own_group,
        )
        try:
            wait_http(self.url + self.health_path, timeout or self.start_timeout_s, self.proc)
        except Exception as exc:
            self.stop()
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            command = " ".join(self.args or self.argv)
            raise RuntimeError(f"{command} failed: {exc}\n{err[-4000:]}") from None
        return self

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        if self.own_group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Hard crash: no graceful shutdown; its children die with it (``kill_tree``)."""
        if self.proc is not None:
            kill_tree(self.proc)

    def __enter__(self) -> Server:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def redis_server(port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A throwaway redis-server on a free loopback port: yields (url, process)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed")
    port = port or free_port()
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.02)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=5)
