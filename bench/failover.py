"""Failover before the first byte: a hung engine beside a healthy one, the router's defaults.

Two mock engines behind ``switchyard router --policy round_robin`` (nothing else set), one
of which accepts every request and never answers (``--fault-hang-rate 1``). ``--requests``
completions go ``--concurrency`` at a time with a ``--client-timeout-s`` client timeout;
the table says how many were answered 200, how many within ``--within-s``, and the
slowest. A router that waits out its first-byte cap (``timeouts.first_byte_s``) for the
hung engine leaves clients hanging; one that fails over within the learned deadline
answers them all.

    python -m bench.failover [--requests 24] [--concurrency 4] [--client-timeout-s 25]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from switchyard.loadtest.procs import Server, free_port

START_S = 90.0


def one(url: str, model: str, i: int, timeout_s: float) -> tuple[int | str, float]:
    began = time.monotonic()
    body = {"model": model, "prompt": f"failover request {i}", "max_tokens": 8}
    try:
        status: int | str = httpx.post(url, json=body, timeout=timeout_s).status_code
    except httpx.TimeoutException:
        status = "client timeout"
    return status, time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--client-timeout-s", type=float, default=25.0)
    parser.add_argument("--within-s", type=float, default=20.0)
    args = parser.parse_args(argv)
    hung_port, ok_port, port = free_port(), free_port(), free_port()
    hung = Server(["mock", "--port", str(hung_port), "--fault-hang-rate", "1"], hung_port)
    healthy = Server(["mock", "--port", str(ok_port)], ok_port)
    argv_router = ["router", "--port", str(port), "--policy", "round_robin"]
    router = Server([*argv_router, "--worker", hung.url, "--worker", healthy.url], port)
    servers = [hung, healthy, router]
    try:
        for server in servers:
            server.start_timeout_s = START_S
            server.start()
        model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        url = router.url + "/v1/completions"
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(
                pool.map(lambda i: one(url, model, i, args.client_timeout_s), range(args.requests))
            )
    finally:
        for server in reversed(servers):
            server.stop()
    answered = [t for status, t in results if status == 200]
    within = sum(1 for t in answered if t <= args.within_s)
    seconds = [t for _, t in results]
    print(f"| requests | answered 200 | within {args.within_s:g} s | slowest | median |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {len(results)} | {len(answered)} | {within} | {max(seconds):.1f} s "
        f"| {statistics.median(seconds):.2f} s |"
    )
    return 0 if within == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
