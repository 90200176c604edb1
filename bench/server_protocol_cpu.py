"""CPU a request of the router's HTTP/1.1 server protocol alone, against a git revision.

Keep-alive POSTs are fed to a ``ClientConnection`` on a transport that drops what it is
given, with a trivial app, in this process: what is left is the protocol's own Python
(parsing callbacks, scope, ASGI calls, framing) and the event loop's task a request.
``src/switchyard/router/connections.py`` of the working tree and of ``--against REV``
(``git show``) are loaded side by side and run in alternating rounds, so both see the
same machine; the minimum and median of the rounds are printed. A change to the protocol
shows here without the noise of sockets, nginx and wrk (``bench.overhead`` has those).

    python -m bench.server_protocol_cpu --against REV [--rounds 40] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

MODULE = "src/switchyard/router/connections.py"
BODY = b'{"model":"m","prompt":"hello"}'
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
    b"user-agent: bench\r\naccept: */*\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
ANSWER = b'{"id":"cmpl-bench"}'
ANSWER_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", b"%d" % len(ANSWER)),
]


class DropTransport:
    """Counts writes and keeps nothing."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1)


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": ANSWER_HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def connect(module: ModuleType) -> tuple[Any, DropTransport]:
    limits = module.ConnectionLimits(10.0, 60.0, 2048, 32 * 1024, 30.0)
    config = SimpleNamespace(loaded=True, loaded_app=app)
    state = SimpleNamespace(connections=set(), tasks=set())
    conn = module.ClientConnection(config, state, {}, asyncio.get_running_loop(), limits=limits)
    transport = DropTransport()
    conn.connection_made(transport)
    return conn, transport


async def requests(conn: Any, count: int) -> float:
    """CPU microseconds a request over ``count`` requests, one at a time."""
    started = time.process_time()
    for _ in range(count):
        conn.data_received(REQUEST)
        await asyncio.sleep(0)  # the request's task runs
        await asyncio.sleep(0)  # and ends
    return (time.process_time() - started) / count * 1e6


async def compare(modules: dict[str, ModuleType], rounds: int, count: int) -> None:
    conns = {label: connect(module) for label, module in modules.items()}
    for conn, _ in conns.values():
        await requests(conn, count)  # warm up
    costs: dict[str, list[float]] = {label: [] for label in conns}
    for _ in range(rounds):
        for label, (conn, _) in conns.items():
            costs[label].append(await requests(conn, count))
    for label, (_, transport) in conns.items():
        assert transport.writes >= (rounds + 1) * count, f"{label} left requests unanswered"
    print(f"{'protocol':<24} {'min us/req':>10} {'median us/req':>14}")
    for label, values in costs.items():
        print(f"{label:<24} {min(values):>10.2f} {statistics.median(values):>14.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--requests", type=int, default=2000, help="a round's requests")
    args = parser.parse_args(argv)
    old = subprocess.run(
        ["git", "show", f"{args.against}:{MODULE}"], check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "connections_against.py"
        path.write_bytes(old)
        modules = {
            f"{args.against}": load("bench_connections_against", path),
            "working tree": load("bench_connections_tree", Path(MODULE)),
        }
        asyncio.run(compare(modules, args.rounds, args.requests))


if __name__ == "__main__":
    main()
