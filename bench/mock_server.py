"""How fast one mock engine process is, and how fast the virtual clock simulates.

    python -m bench.mock_server [--duration 5] [--connections 32]

1. short non-stream requests/s (max_tokens=1) against one ``switchyard mock`` process;
2. streamed tokens/s (max_tokens=200, stream=true) against the same process;
3. virtual-clock simulation speed: simulated requests per wall second of
   ``switchyard.mock.engine.virtual.VirtualFleet`` (16 engines, Poisson arrivals).

The load generator runs in another process: ``wrk`` when installed (it costs far less
CPU than the server), else the router's own HTTP client in Python. The mock runs with
``--speed 1000`` so the modelled GPU time is negligible and the figure is the HTTP
front's own cost. Where the generator and the server share cores they compete for CPU:
the numbers are a floor. Prints one JSON object per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

from switchyard.loadtest.procs import Server, cpu_seconds, free_port
from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.virtual import VirtualFleet

SHORT = {"model": "mock-model", "prompt": "hello world, a short prompt", "max_tokens": 1}
STREAM = {**SHORT, "max_tokens": 200, "stream": True}


def wrk(url: str, body: dict, duration: float, connections: int) -> float:
    """Completed requests per second reported by wrk."""
    script = (
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "-s", f.name, url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if match is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    return float(match.group(1))


def python_load(url: str, body: dict, duration: float, connections: int) -> float:
    """The same measurement with the router's own client (``switchyard.net.httpclient``),
    run in a child process."""
    code = f"""
import asyncio, json, time
from switchyard.net.httpclient import ConnectionPool
async def main():
    done = 0
    stop = time.monotonic() + {duration}
    pool = ConnectionPool(connect_timeout_s=10.0)
    body = json.dumps({body!r}).encode()
    headers = {{"content-type": "application/json"}}
    async def worker():
        nonlocal done
        while time.monotonic() < stop:
            r = await pool.post({url!r}, body, headers)
            await r.read()
            r.close()
            done += 1
    await asyncio.gather(*[worker() for _ in range({connections})])
    await pool.close()
    print(done / {duration})
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def http_figures(duration: float, connections: int) -> None:
    """Wall rate, and the rate per CPU-second of the server (its cost, free of contention)."""
    load = wrk if shutil.which("wrk") else python_load
    port = free_port()
    args = ["mock", "--port", str(port), "--speed", "1000", "--max-num-seqs", "1024"]
    with Server(args, port) as srv:
        assert srv.proc is not None
        pid = srv.proc.pid
        url = srv.url + "/v1/completions"
        load(url, SHORT, 1.0, connections)  # warm up
        for name, body, per_request in (
            ("short_requests_per_s", SHORT, 1),
            ("streamed_tokens_per_s", STREAM, STREAM["max_tokens"]),
        ):
            cpu = cpu_seconds(pid)
            rate = load(url, body, duration, connections) * per_request
            per_cpu = rate * duration / max(cpu_seconds(pid) - cpu, 1e-9)
            figure = {
                "figure": name,
                "value": round(rate),
                "per_server_cpu_s": round(per_cpu),
                "connections": connections,
                "generator": load.__name__,
            }
            print(json.dumps(figure), flush=True)


def virtual_figures(num_engines: int = 16, num_requests: int = 20_000, seed: int = 0) -> None:
    """Simulated requests per wall second on one core (routing round robin)."""
    rng = random.Random(seed)
    fleet = VirtualFleet(
        [EngineConfig(seed=seed) for _ in range(num_engines)], record_token_times=False
    )
    rate = 30.0 * num_engines  # requests per model second: a loaded but stable fleet
    t = 0.0
    for i in range(num_requests):
        t += rng.expovariate(rate)
        prefix = [1 + (i % 50)] * 256  # 50 shared system prompts
        prompt = prefix + [rng.randrange(100, 8000) for _ in range(rng.randrange(32, 512))]
        req = EngineRequest(f"r{i}", prompt, max_tokens=rng.randrange(16, 256))
        fleet.submit(t, i % num_engines, req)
    started = time.perf_counter()
    finished = fleet.run()
    wall = time.perf_counter() - started
    print(
        json.dumps(
            {
                "figure": "virtual_requests_per_wall_s",
                "value": round(len(finished) / wall),
                "engines": num_engines,
                "requests": len(finished),
                "simulated_s": round(fleet.now, 1),
                "wall_s": round(wall, 2),
                "sim_speedup": round(fleet.now / wall, 1),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--skip-virtual", action="store_true")
    args = parser.parse_args()
    if not args.skip_http:
        http_figures(args.duration, args.connections)
    if not args.skip_virtual:
        virtual_figures()


if __name__ == "__main__":
    main()
