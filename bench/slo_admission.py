"""SLO admission under a flood: a share is refused fast, the admitted meet the objective.

A slowed mock fleet (``switchyard mock --speed``) gets an open-loop flood (Poisson
arrivals above its capacity) of completions, non-streamed and then streamed, through a
fresh router per case, with and without ``--admission-slo-ttft-ms``. For a non-streamed answer the
client's first byte is the whole answer, so its objective is set accordingly
(``--whole-slo-ms``); a stream's is the time to its first chunk (``--stream-slo-ms``).

Reported per case:
  sent, ok, rejected   requests, 200s, 429 slo_unattainable (share of sent)
  reject ms p50/p99    how fast a 429 came back
  first byte p50/p90   of the admitted (200) requests, ms
  met                  share of the admitted within the objective
  pred ratio p50       median actual/predicted first byte (router histogram)

Run:  python -m bench.slo_admission [--engines 2] [--speed 0.2] [--rate 40] [--duration 10]
                                    [--stream-slo-ms 300] [--whole-slo-ms 1200]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx
import orjson

from switchyard.loadtest.procs import Server, free_port
from switchyard.loadtest.prom import values
from switchyard.net.errors import TransportError
from switchyard.net.httpclient import ConnectionPool
from switchyard.router.metrics import FLUSH_INTERVAL_S

_HEADERS = {"content-type": "application/json"}


@dataclass
class Case:
    stream: bool
    slo_ms: float | None
    sent: int = 0
    ok_s: list[float] = field(default_factory=list)
    rejected_s: list[float] = field(default_factory=list)
    other: int = 0
    ratio_p50: float | None = None


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(pool: ConnectionPool, url: str, body: dict[str, object], case: Case) -> None:
    """One completion within 120 s; its first byte (a stream's first chunk) counted."""
    began = time.perf_counter()
    try:
        async with asyncio.timeout(120):
            resp = await pool.post(url + "/v1/completions", orjson.dumps(body), _HEADERS)
            try:
                if case.stream and resp.status == 200:
                    await resp.readany()  # the first chunk
                    first = time.perf_counter() - began
                    await resp.read()
                else:
                    await resp.read()
                    first = time.perf_counter() - began
            finally:
                resp.close()
        if resp.status == 200:
            case.ok_s.append(first)
        elif resp.status == 429:
            case.rejected_s.append(first)
        else:
            case.other += 1
    except TransportError:
        case.other += 1


async def flood(url: str, case: Case, args: argparse.Namespace, seed: int) -> None:
    rng = random.Random(seed)
    pool = ConnectionPool(connect_timeout_s=120.0)  # the router's own client, unbounded
    try:
        tasks = []
        end = time.perf_counter() + args.duration
        while time.perf_counter() < end:
            words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(args.prompt_words))
            body = {
                "model": "mock-model",
                "prompt": words,
                "max_tokens": args.max_tokens,
                "stream": case.stream,
            }
            tasks.append(asyncio.create_task(one(pool, url, body, case)))
            case.sent += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    finally:
        await pool.close()


def median_ratio(metrics: str, kind: str) -> float | None:
    """The bucket bound where the actual/predicted histogram crosses half its count."""
    name = "switchyard_router_ttft_prediction_ratio_bucket"
    count = sum(values(metrics, "switchyard_router_ttft_prediction_ratio_count", kind=kind))
    if not count:
        return None
    bounds = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
    for bound in bounds:
        if sum(values(metrics, name, kind=kind, le=str(bound))) >= count / 2:
            return bound
    return float("inf")


def run_case(engines: list[str], case: Case, args: argparse.Namespace, seed: int) -> None:
    port = free_port()
    argv = ["router", "--port", str(port), "--policy", "least_load"]
    argv += [f"--worker={url}" for url in engines]
    if case.slo_ms is not None:
        argv += ["--admission-slo-ttft-ms", str(case.slo_ms)]
    router = Server(argv, port, start_timeout_s=90).start()
    try:
        time.sleep(1.0)  # the first probe and scrape
        asyncio.run(flood(router.url, case, args, seed))
        time.sleep(2 * FLUSH_INTERVAL_S)  # every process has written its samples
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        case.ratio_p50 = median_ratio(metrics, "stream" if case.stream else "whole")
    finally:
        router.stop()


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def report(cases: list[Case]) -> None:
    head = (
        "| mode | slo ms | sent | ok | rejected | reject ms p50/p99 | first byte ms p50/p90 "
        "| met | pred ratio p50 |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for c in cases:
        met = (
            f"{sum(1 for x in c.ok_s if x * 1e3 <= c.slo_ms) / len(c.ok_s):.0%}"
            if c.slo_ms is not None and c.ok_s
            else "-"
        )
        rejected = f"{len(c.rejected_s)} ({len(c.rejected_s) / max(c.sent, 1):.0%})"
        print(
            f"| {'stream' if c.stream else 'whole'} | {c.slo_ms or 'off'} | {c.sent} "
            f"| {len(c.ok_s)} | {rejected} "
            f"| {ms(quantile(c.rejected_s, 0.5))}/{ms(quantile(c.rejected_s, 0.99))} "
            f"| {ms(quantile(c.ok_s, 0.5))}/{ms(quantile(c.ok_s, 0.9))} | {met} "
            f"| {c.ratio_p50 if c.ratio_p50 is not None else '-'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--speed", type=float, default=0.2, help="mock time compression")
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream-slo-ms", type=float, default=300.0)
    parser.add_argument("--whole-slo-ms", type=float, default=1200.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    mocks = []
    for _ in range(args.engines):
        port = free_port()
        mocks.append(
            Server(
                ["mock", "--port", str(port), "--speed", str(args.speed)], port, start_timeout_s=90
            )
        )
    try:
        for mock in mocks:
            mock.start()
        engines = [m.url for m in mocks]
        cases = [
            Case(stream=False, slo_ms=None),
            Case(stream=False, slo_ms=args.whole_slo_ms),
            Case(stream=True, slo_ms=None),
            Case(stream=True, slo_ms=args.stream_slo_ms),
        ]
        for case in cases:
            run_case(engines, case, args, args.seed)
            time.sleep(2.0)  # let the engines drain between cases
        report(cases)
    finally:
        for mock in mocks:
            mock.stop()


if __name__ == "__main__":
    main()
