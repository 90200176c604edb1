"""``switchyard mock-fleet``: many mock engines, cheaply, with a JSON map of what runs where.

In one process every engine gets its own uvicorn server on the same event loop (an
idle engine costs almost nothing); ``--processes K`` spreads them over K children so
a load test can use more cores, and by default a process holds at most
``ENGINES_PER_PROCESS`` engines. The printed JSON lists each engine's URLs, DP ranks,
role, KV-event endpoints and (SGLang prefill) bootstrap port.

Open files and ZMQ sockets are what a large fleet runs out of (``--count 500`` in one
process died with ``ZMQError: Too many open files``: one ZMQ context allows 1,023
sockets by default). So each serving process raises its soft RLIMIT_NOFILE to the hard
limit and sizes its ZMQ context for its engines, and the fleet refuses to start, with
one line and exit status 2, when a process's share cannot fit the hard limit.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import zmq

from switchyard.mock.serve import build, describe, run_blocking
from switchyard.mock.settings import MockSettings
from switchyard.mock.tokenizer import ModelTokenizer


def plan_fleet(
    config: Path | None,
    flags: dict[str, Any],
    count: int,
    base_port: int,
    prefill: int,
    decode: int,
    kv_events_base_port: int | None,
) -> list[MockSettings]:
    """One settings object per engine: ports, roles, event ports and seeds laid out."""
    base = MockSettings.load(config, **flags)
    stride = base.dp_size if base.dp_external else 1
    specs: list[MockSettings] = []
    for i in range(count):
        role = "prefill" if i < prefill else "decode" if i < prefill + decode else base.role
        changes: dict[str, Any] = {
            "port": base_port + i * stride,
            "role": role,
            "seed": base.seed + i,
            "engine_id": f"{base.engine_id or 'mock'}-{i}",
        }
        if kv_events_base_port is not None:
            changes["kv_events_port"] = kv_events_base_port + i * base.dp_size
        if base.flavor == "sglang" and role == "prefill":
            changes["bootstrap_port"] = base_port + count * stride + i
        specs.append(base.model_copy(update=changes))
    return specs


# Engines per serving process when --processes is not given: 2,000 engines with events
# and a router in front need about 10 files each (about 5 per idle engine, plus the
# router's keep-alive, probe and event connections), so 500 stay well
# inside a 20,000 hard limit and 1,023 is never near the ZMQ socket limit of 65,535.
ENGINES_PER_PROCESS = 500
# ZMQ sockets per DP rank with events (switchyard.mock.kvevents: PUB, an inproc PUSH/PULL
# pair to its thread) and one more with a replay socket.
_ZMQ_SOCKETS_PER_RANK = 3
# Open files: per ZMQ socket its mailbox; per rank the PUB listener and a subscriber;
# per HTTP port its listener and the router's data, probe and scrape connections; and
# the process's own (interpreter, tokenizer, loop): measured 40-60, rounded up.
_FDS_PER_ZMQ_SOCKET = 1
_FDS_PER_RANK_EVENTS = 2
_FDS_PER_HTTP_PORT = 6
_FDS_PER_PROCESS = 128


def default_processes(count: int) -> int:
    return max(1, math.ceil(count / ENGINES_PER_PROCESS))


def zmq_sockets(specs: list[MockSettings]) -> int:
    """ZMQ sockets the engines of ``specs`` open (none without KV events)."""
    per_rank = [
        (_ZMQ_SOCKETS_PER_RANK + (s.kv_events_replay_port is not None)) * s.dp_size
        for s in specs
        if s.kv_events_port is not None
    ]
    return sum(per_rank)


def open_files(specs: list[MockSettings]) -> int:
    """Open files one process serving ``specs`` needs, with a router connected to each."""
    total = _FDS_PER_PROCESS + _FDS_PER_ZMQ_SOCKET * zmq_sockets(specs)
    for s in specs:
        where = describe(s)
        total += _FDS_PER_HTTP_PORT * (len(where["urls"]) + (where["bootstrap"] is not None))
        if s.kv_events_port is not None:
            replay = s.kv_events_replay_port is not None
            total += (_FDS_PER_RANK_EVENTS + replay) * s.dp_size
    return total


def split(specs: list[MockSettings], processes: int) -> list[list[MockSettings]]:
    """The engines each process serves (engine i goes to process i mod K)."""
    return [specs[i::processes] for i in range(processes) if specs[i::processes]]


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one; returns the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _zmq_socket_limit() -> int:
    ctx = zmq.Context()
    try:
        return int(ctx.get(zmq.SOCKET_LIMIT))
    finally:
        ctx.term()


def limits_error(specs: list[MockSettings], processes: int, fd_hard_limit: int) -> str | None:
    """One line saying why ``specs`` over ``processes`` cannot run here, or None if they can."""
    groups = split(specs, processes)
    need = max(open_files(g) for g in groups)
    if fd_hard_limit != resource.RLIM_INFINITY and need > fd_hard_limit:
        spread = open_files(specs) - _FDS_PER_PROCESS
        enough = math.ceil(spread / max(fd_hard_limit - _FDS_PER_PROCESS, 1))
        return (
            f"{len(specs)} engines over {len(groups)} process(es) need about {need} open files "
            f"per process, but the hard limit (ulimit -Hn) is {fd_hard_limit}: use "
            f"--processes {max(enough, len(groups) + 1)} or more, or raise the hard limit"
        )
    sockets = max(zmq_sockets(g) for g in groups)
    socket_limit = _zmq_socket_limit()
    if sockets > socket_limit:
        return (
            f"{len(specs)} engines over {len(groups)} process(es) need {sockets} ZMQ sockets "
            f"per process, but this libzmq allows {socket_limit}: use more --processes"
        )
    return None


def size_zmq_context(specs: list[MockSettings]) -> None:
    """Let the shared ZMQ context hold every socket of ``specs`` (default 1,023).

    Only takes effect before the context's first socket, so call it before ``build``.
    """
    zmq.Context.instance().set(zmq.MAX_SOCKETS, max(1023, zmq_sockets(specs) + 64))


def _serve_in_process(specs: list[MockSettings], on_ready_line: str | None) -> None:
    raise_fd_limit()
    size_zmq_context(specs)
    tokenizers: dict[str, ModelTokenizer] = {}
    deployments = []
    for s in specs:
        tok = tokenizers.get(s.tokenizer) or tokenizers.setdefault(
            s.tokenizer, ModelTokenizer(s.tokenizer)
        )
        deployments.append(build(s, tok))

    def ready() -> None:
        line = on_ready_line or json.dumps({"engines": [d.describe() for d in deployments]})
        print(line, flush=True)

    run_blocking(deployments, ready)


def run_specs(spec_json: str) -> None:
    """Child process of a multi-process fleet: serve the given engines, say when ready."""
    specs = [MockSettings.model_validate(d) for d in json.loads(spec_json)]
    _serve_in_process(specs, json.dumps({"ready": True}))


def describe_fleet(specs: list[MockSettings]) -> dict[str, Any]:
    return {"engines": [describe(s) for s in specs]}


def run_fleet(specs: list[MockSettings], processes: int | None) -> None:
    """Serve ``specs`` (over ``processes``, or as many as ``default_processes`` says).

    Exits with status 2 and one line on stderr when the limits cannot hold them.
    """
    processes = default_processes(len(specs)) if processes is None else max(processes, 1)
    error = limits_error(specs, processes, raise_fd_limit())
    if error is not None:
        print(f"mock-fleet: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if processes == 1:
        _serve_in_process(specs, None)
        return
    # Specs go over stdin: 500 of them (~1 KB each) exceed one argument's 128 KiB.
    children = []
    for group in split(specs, processes):
        child = subprocess.Popen(
            [sys.executable, "-m", "switchyard", "mock-fleet", "--spec-stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None
        child.stdin.write(json.dumps([s.model_dump() for s in group]))
        child.stdin.close()
        children.append(child)

    def stop(*_: object) -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for child in children:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            stop()
            raise SystemExit(f"fleet child {child.pid} exited before it was ready")
    print(json.dumps(describe_fleet(specs)), flush=True)
    for child in children:
        child.wait()
