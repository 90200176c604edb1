"""Router overhead on one machine, in one run: direct vs Switchyard vs smg, alternating.

Backend: nginx (from Debian) answering a fixed completion. Load: wrk (from Debian).
Targets, each measured ``--rounds`` times in rotating order: the backend directly,
``switchyard router`` in front of it, and ``smg launch`` (pip install smg) when
installed. Also the SSE relay rate: events/s streamed through Switchyard vs direct.

    python -m bench.overhead [--duration 10] [--rounds 3] [--connections 32] [--processes N]
        [--policy P] [--against REV] [--variant NAME='ROUTER ARGS' ...]

Switchyard runs its default command (no flags beyond the worker) unless told otherwise.
Each ``--variant`` is one more Switchyard target with those router flags added, alternating
with the others; ``{backend}`` in them is nginx's URL, which answers any POST with 200 (an
OTLP endpoint that drops what it gets):

    python -m bench.overhead --no-smg \
        --variant "trace0.1=--otlp-traces-endpoint {backend}/v1/traces --tracing-sample-ratio 0.1" \
        --variant "trace1=--otlp-traces-endpoint {backend}/v1/traces --tracing-sample-ratio 1"
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from switchyard.loadtest.procs import Server, cpu_seconds, free_port, python_from
from switchyard.net.httpclient import ConnectionPool
from tools.worktree import worktree

ANSWER = (
    '{"id":"cmpl-bench","object":"text_completion","created":0,"model":"bench",'
    '"choices":[{"index":0,"text":"hello","finish_reason":"length"}],'
    '"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}'
)
MODELS = '{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
BODY = '{"model":"bench","prompt":"Say hello","max_tokens":1}'

NGINX_CONF = """
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir};
  keepalive_requests 1000000;
  server {{
    listen 127.0.0.1:{port};
    location = /v1/models {{ default_type application/json; return 200 '{models}'; }}
    location = /health {{ default_type application/json; return 200 '{{}}'; }}
    location / {{ default_type application/json; return 200 '{answer}'; }}
  }}
}}
"""

WRK_LUA = f"""
wrk.method = "POST"
wrk.body = '{BODY}'
wrk.headers["Content-Type"] = "application/json"
"""


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int = 0
    errors: int = 0  # non-2xx answers and socket errors


def _ms(text: str) -> float:
    value = float(re.match(r"[\d.]+", text).group(0))  # type: ignore[union-attr]
    if text.endswith("us"):
        return value / 1000
    if text.endswith("ms"):
        return value
    return value * 1000


def run_wrk(
    url: str, connections: int, duration: int, lua: Path, path: str = "/v1/completions"
) -> WrkResult:
    threads = max(1, min(2, connections))
    out = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{connections}",
            f"-d{duration}s",
            "--latency",
            "-s",
            str(lua),
            url + path,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps_m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50_m = re.search(r"^\s+50%\s+([\d.]+\w+)", out, re.M)
    p99_m = re.search(r"^\s+99%\s+([\d.]+\w+)", out, re.M)
    total_m = re.search(r"(\d+) requests in", out)
    if not (rps_m and p50_m and p99_m and total_m):
        raise RuntimeError(f"unexpected wrk output for {url}:\n{out}")
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if socket is not None:
        errors += sum(int(n) for n in socket.groups())
    if errors:
        print(f"  warning: {errors} failed requests to {url}")
    return WrkResult(
        float(rps_m.group(1)),
        _ms(p50_m.group(1)),
        _ms(p99_m.group(1)),
        int(total_m.group(1)),
        errors,
    )


def process(
    argv: list[str],
    port: int,
    health_path: str,
    env: dict[str, str] | None = None,
    *,
    start_timeout_s: float = 30,
    stop_timeout_s: float = 10,
) -> Server:
    """A server process in its own group, quiet, up once ``health_path`` answers."""
    return Server(
        [],
        port,
        health_path,
        argv=argv,
        env=env,
        own_group=True,
        capture_stderr=False,
        start_timeout_s=start_timeout_s,
        stop_timeout_s=stop_timeout_s,
    )


def fixed_backend(stack: ExitStack, tmpdir: Path) -> tuple[str, Path]:
    """nginx answering ``ANSWER``, up until ``stack`` closes; its URL and the wrk script."""
    lua = tmpdir / "post.lua"
    lua.write_text(WRK_LUA)
    port = free_port()
    conf = tmpdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=tmpdir, port=port, answer=ANSWER, models=MODELS))
    stack.enter_context(process(["nginx", "-c", str(conf), "-p", str(tmpdir)], port, "/health"))
    return f"http://127.0.0.1:{port}", lua


def smg_router(smg: str, backend: str) -> Server:
    """``smg launch`` round-robin in front of ``backend`` (its policy for one worker)."""
    port = free_port()
    argv = [smg, "launch", "--worker-urls", backend, "--policy", "round_robin"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error"]
    argv += ["--prometheus-port", str(free_port())]
    return process(argv, port, "/health")


async def sse_rate(url: str, streams: int, duration: float) -> float:
    """SSE events per second received over ``streams`` concurrent streaming requests."""
    count = 0
    deadline = time.monotonic() + duration
    body = b'{"model":"bench","prompt":"Say hello","stream":true}'
    headers = {"content-type": "application/json"}

    async def one(pool: ConnectionPool) -> None:
        nonlocal count
        while time.monotonic() < deadline:
            resp = await pool.post(url + "/v1/completions", body, headers)
            try:
                while chunk := await resp.readany():
                    count += chunk.count(b"data:")
                    if time.monotonic() >= deadline:
                        return
            finally:
                resp.close()

    # The router's own client: the receiving end must not be what limits the rate.
    pool = ConnectionPool(connect_timeout_s=10.0)
    try:
        start = time.monotonic()
        await asyncio.gather(*(one(pool) for _ in range(streams)))
        return count / (time.monotonic() - start)
    finally:
        await pool.close()


def router_argv(worker: str, port: int, *extra: str, python: list[str] | None = None) -> list[str]:
    """``switchyard router`` in front of one worker on ``port``, run by ``python``."""
    cmd = [*(python or [sys.executable]), "-m", "switchyard", "router", "--worker", worker]
    return [*cmd, "--port", str(port), *extra]


def ours(stack: ExitStack, worker: str, extra: list[str], code: Path | None) -> Server:
    """Our router in front of ``worker``, imported from ``code`` (this checkout when None)."""
    python, env = python_from(code)
    port = free_port()
    argv = router_argv(worker, port, *extra, python=python)
    return stack.enter_context(process(argv, port, "/ready", env=env))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--policy", default=None, help="switchyard router --policy (its default)")
    ap.add_argument("--processes", default=None, help="switchyard router --processes (its default)")
    ap.add_argument("--sse-streams", type=int, default=16)
    ap.add_argument("--no-smg", action="store_true")
    ap.add_argument("--against", help="also run our router from this git revision, alternating")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="also run our router with these flags added ({backend}: nginx's URL), alternating",
    )
    args = ap.parse_args()
    variants = [v.partition("=")[::2] for v in args.variant]
    if any(not name or name in ("direct", "switchyard", "smg") for name, _ in variants):
        sys.exit("--variant wants NAME=ARGS, NAME not direct, switchyard or smg")
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is required: apt-get install -y wrk nginx-light")
    smg = None if args.no_smg else shutil.which("smg")

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        backend, lua = fixed_backend(stack, Path(tmp))
        targets = {"direct": backend}
        extra = [
            *(["--policy", args.policy] if args.policy else []),
            *(["--processes", args.processes] if args.processes else []),
        ]
        routers = {"switchyard": ours(stack, backend, extra, None)}
        if args.against:
            against = worktree(stack, args.against)
            routers[f"sy@{args.against}"] = ours(stack, backend, extra, against)
        for name, flags in variants:
            added = shlex.split(flags.replace("{backend}", backend))
            routers[name] = ours(stack, backend, [*extra, *added], None)
        targets.update({name: server.url for name, server in routers.items()})
        if smg:
            targets["smg"] = stack.enter_context(smg_router(smg, backend)).url
        for url in targets.values():
            httpx.post(
                url + "/v1/completions", content=BODY, headers={"Content-Type": "application/json"}
            ).raise_for_status()

        names = list(targets)
        loaded: dict[str, list[WrkResult]] = {n: [] for n in names}
        single: dict[str, list[WrkResult]] = {n: [] for n in names}
        cpu_ms: dict[str, list[float]] = {n: [] for n in routers}  # our routers' CPU a request
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            print(f"round {r + 1}/{args.rounds}: {' -> '.join(order)}", flush=True)
            for name in order:
                proc = routers[name].proc if name in routers else None
                pid = proc.pid if proc is not None else None
                before = cpu_seconds(pid) if pid is not None else 0.0
                result = run_wrk(targets[name], args.connections, args.duration, lua)
                loaded[name].append(result)
                if pid is not None:
                    used = cpu_seconds(pid) - before
                    cpu_ms[name].append(used / max(result.requests, 1) * 1e3)
                single[name].append(run_wrk(targets[name], 1, max(3, args.duration // 2), lua))

        print(
            f"\nnon-stream, {args.connections} connections, {args.duration}s x {args.rounds} "
            "rounds (medians):"
        )
        print(
            f"{'target':<12}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'1-conn p50 ms':>15}"
            f"{'CPU ms/req':>12}"
        )
        med = {}
        for name in names:
            rps = statistics.median(x.rps for x in loaded[name])
            p50 = statistics.median(x.p50_ms for x in loaded[name])
            p99 = statistics.median(x.p99_ms for x in loaded[name])
            one = statistics.median(x.p50_ms for x in single[name])
            med[name] = (rps, one)
            cpu = f"{statistics.median(cpu_ms[name]):>12.3f}" if name in cpu_ms else ""
            print(f"{name:<12}{rps:>10.0f}{p50:>10.2f}{p99:>10.2f}{one:>15.3f}{cpu}")
        added = med["switchyard"][1] - med["direct"][1]
        print(f"\nadded p50 latency at 1 connection, switchyard vs direct: {added:.3f} ms")
        if "smg" in med:
            print(f"switchyard/smg req/s: {med['switchyard'][0] / med['smg'][0]:.2f}")
            print(f"smg added p50 at 1 connection: {med['smg'][1] - med['direct'][1]:.3f} ms")
        for name in (n for n in names if n.startswith("sy@") or n in dict(variants)):
            print(f"switchyard/{name} req/s: {med['switchyard'][0] / med[name][0]:.2f}")
            print(f"{name} added p50 at 1 connection: {med[name][1] - med['direct'][1]:.3f} ms")

    with ExitStack() as stack:
        sse_port = free_port()
        sse = f"http://127.0.0.1:{sse_port}"
        stack.enter_context(
            process(
                [sys.executable, "-m", "bench.sse_backend", str(sse_port), "2000"],
                sse_port,
                "/v1/models",
            )
        )
        urls = {"direct": sse, "switchyard": ours(stack, sse, [], None).url}
        if args.against:
            against = worktree(stack, args.against)
            urls[f"sy@{args.against}"] = ours(stack, sse, [], against).url
        rates: dict[str, list[float]] = {name: [] for name in urls}
        names = list(urls)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rates[name].append(
                    asyncio.run(sse_rate(urls[name], args.sse_streams, args.duration / 2))
                )
        d = statistics.median(rates["direct"])
        print(f"\nSSE relay, {args.sse_streams} streams: direct {d:,.0f} events/s")
        for name in names[1:]:
            s = statistics.median(rates[name])
            print(f"{name} {s:,.0f} events/s ({s / d:.2f}x direct)")


if __name__ == "__main__":
    main()
