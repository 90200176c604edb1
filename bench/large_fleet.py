"""A router in front of a large mock fleet: does it hold 2,000 engines?

Starts ``switchyard mock-fleet --count N`` with KV events on (one process per 500
engines), one ``switchyard router --policy kv_aware`` with every engine as a worker and
its event endpoint, waits until the router knows every worker's models and has
subscribed to every event feed, measures the router's idle cost (probes, scrapes,
event subscriptions) and then replays a multi-turn chat load through it. It prints:

- requests and errors (the target is 0 errors), the prefix-cache hit rate;
- schedule time p50/p99 from the router's ``switchyard_router_schedule_seconds``
  histogram (interpolated within its buckets, as Prometheus' histogram_quantile does);
- KV-event ingestion: how many feeds are live, the lag of each engine's last event
  batch when the router applied it (``switchyard_kvstore_event_lag_seconds``: median and
  worst over engines), and the ratio of the cached tokens the router predicted to what
  the engines reported, which falls when events lag behind the requests;
- router RSS and CPU% (of one core) while idle and under load.

Usage::

    python -m bench.large_fleet [--engines 2000] [--rate 20] [--duration-s 30] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from switchyard.loadtest.client import Result, replay
from switchyard.loadtest.fleet import MockFleet
from switchyard.loadtest.procs import cpu_seconds, free_port_block, wait_http
from switchyard.loadtest.prom import samples, values
from switchyard.loadtest.workloads import build_workload
from switchyard.mock.fleet import default_processes
from switchyard.mock.settings import DEFAULT_TOKENIZER
from switchyard.router.metrics import FLUSH_INTERVAL_S
from tools.worktree import REPO

MODEL = "mock-model"
ADMIN_KEY = "large-fleet-bench"
SCHEDULE = "switchyard_router_schedule_seconds"


@dataclass
class Report:
    engines: int
    fleet_processes: int
    fleet_start_s: float
    router_up_s: float
    router_ready_s: float
    requests: int
    errors: int
    hit_rate: float
    schedule_p50_ms: float | None
    schedule_p99_ms: float | None
    event_feeds_live: int
    event_lag_p50_ms: float | None
    event_lag_max_ms: float | None
    predicted_over_actual_cached: float | None
    router_rss_mib_idle: float
    router_rss_mib_after: float
    router_cpu_pct_idle: float
    router_cpu_pct_load: float
    first_errors: list[str]


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def buckets(text: str) -> dict[float, float]:
    """Cumulative counts of the schedule histogram by upper bound."""
    buckets: dict[float, float] = {}
    for s in samples(text, SCHEDULE + "_bucket"):
        if s.name == SCHEDULE + "_bucket":  # summed over the turn label
            bound = float(s.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + s.value
    return buckets


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """histogram_quantile over the counts added between two scrapes (seconds)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = bound, cum
    return lower


def router_command(fleet: MockFleet, port: int, policy: str) -> list[str]:
    args = [sys.executable, "-m", "switchyard", "router", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--policy", policy, "--log-level", "warning"]
    args += ["--tokenizer", DEFAULT_TOKENIZER]
    for e in fleet.engines:
        args += ["--worker", e.url]
    for e in fleet.engines:
        if e.kv_events:
            args += ["--kv-events", f"{e.url}={e.kv_events}"]
    return args


def wait_fleet_known(url: str, engines: int, timeout_s: float) -> None:
    """Until every worker is routable with its models and no worker lacks its event feed."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=30.0, headers=headers) as c:
        while True:
            rows = c.get(url + "/admin/workers").json()["workers"]
            known = sum(1 for w in rows if w["models"] and w["healthy"])
            metrics = c.get(url + "/metrics").text
            estimating = sum(values(metrics, "switchyard_router_kv_estimating"))
            if known >= engines and estimating == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"router knows {known}/{engines} workers, {estimating:.0f} without events"
                )
            time.sleep(3.0)  # each answer describes every worker: not too often


def metrics_text(url: str) -> str:
    """The router's /metrics once every process has written its samples (``FLUSH_INTERVAL_S``)."""
    time.sleep(2 * FLUSH_INTERVAL_S)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.get(url + "/metrics", headers=headers, timeout=30.0).text


def run(args: argparse.Namespace) -> Report:
    processes = args.fleet_processes or default_processes(args.engines)
    fleet = MockFleet(
        args.engines,
        num_gpu_blocks=args.num_gpu_blocks,
        speed=args.speed,
        seed=args.seed,
        processes=processes,
    )
    t0 = time.monotonic()
    fleet.start(check_each=False)
    fleet_start_s = time.monotonic() - t0
    port = free_port_block(1)
    env = dict(os.environ, PYTHONUNBUFFERED="1", SWITCHYARD_ROUTER_ADMIN_API_KEY=ADMIN_KEY)
    log = tempfile.TemporaryFile()
    t0 = time.monotonic()
    router = subprocess.Popen(
        router_command(fleet, port, args.policy), cwd=REPO, env=env, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", args.start_timeout_s, router)
        router_up_s = time.monotonic() - t0
        wait_fleet_known(url, args.engines, args.start_timeout_s)
        router_ready_s = time.monotonic() - t0
        time.sleep(args.settle_s)
        cpu0, w0 = cpu_seconds(router.pid), time.monotonic()
        time.sleep(args.idle_s)
        cpu_idle = (cpu_seconds(router.pid) - cpu0) / (time.monotonic() - w0) * 100
        rss_idle = rss_mib(router.pid)
        # A few requests first, so the router's cold paths (first tokenization, first
        # connection to a worker) stay out of the measured schedule times.
        warmup = build_workload("multiturn", args.seed + 1, rate=8.0, duration_s=1.0)
        asyncio.run(replay(url, warmup, MODEL, args.request_timeout_s))
        before = metrics_text(url)
        workload = build_workload(
            "multiturn",
            args.seed,
            rate=args.rate,
            duration_s=args.duration_s,
            tenants=args.tenants,
            active_sessions=args.sessions,
            max_tokens=args.max_tokens,
            answer_tokens=args.max_tokens,
        )
        cpu0, w0 = cpu_seconds(router.pid), time.monotonic()
        results: list[Result] = asyncio.run(replay(url, workload, MODEL, args.request_timeout_s))
        cpu_load = (cpu_seconds(router.pid) - cpu0) / (time.monotonic() - w0) * 100
        after = metrics_text(url)
        rss_after = rss_mib(router.pid)
    except Exception:
        log.seek(0)
        sys.stderr.write(log.read().decode(errors="replace")[-4000:])
        raise
    finally:
        router.terminate()
        try:
            router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            router.kill()
        log.close()
        fleet.stop()
    p50 = quantile(buckets(before), buckets(after), 0.50)
    p99 = quantile(buckets(before), buckets(after), 0.99)

    def total(text: str, name: str) -> float:
        return sum(values(text, name))

    predicted = total(after, "switchyard_router_predicted_cached_tokens_total") - total(
        before, "switchyard_router_predicted_cached_tokens_total"
    )
    actual = total(after, "switchyard_router_actual_cached_tokens_total") - total(
        before, "switchyard_router_actual_cached_tokens_total"
    )
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    estimating = values(after, "switchyard_router_kv_estimating")
    lags = sorted(values(after, "switchyard_kvstore_event_lag_seconds"))
    return Report(
        engines=args.engines,
        fleet_processes=processes,
        fleet_start_s=round(fleet_start_s, 1),
        router_up_s=round(router_up_s, 1),
        router_ready_s=round(router_ready_s, 1),
        requests=len(results),
        errors=len(results) - len(ok),
        hit_rate=round(sum(r.cached_tokens for r in ok) / prompt, 3) if prompt else 0.0,
        schedule_p50_ms=None if p50 is None else round(p50 * 1000, 2),
        schedule_p99_ms=None if p99 is None else round(p99 * 1000, 2),
        event_feeds_live=sum(1 for v in estimating if v == 0),
        event_lag_p50_ms=round(lags[len(lags) // 2] * 1000, 1) if lags else None,
        event_lag_max_ms=round(lags[-1] * 1000, 1) if lags else None,
        predicted_over_actual_cached=round(predicted / actual, 3) if actual else None,
        router_rss_mib_idle=round(rss_idle, 1),
        router_rss_mib_after=round(rss_after, 1),
        router_cpu_pct_idle=round(cpu_idle, 1),
        router_cpu_pct_load=round(cpu_load, 1),
        first_errors=sorted({r.error for r in results if not r.ok})[:5],
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--engines", type=int, default=2000)
    p.add_argument("--fleet-processes", type=int, default=0, help="0: one per 500 engines")
    p.add_argument("--policy", default="kv_aware")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--sessions", type=int, default=64, help="open conversations")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=2000)
    p.add_argument("--speed", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("--idle-s", type=float, default=20.0, help="idle window for router CPU")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    args = p.parse_args(argv)
    report = run(args)
    data: dict[str, Any] = asdict(report)
    if args.json:
        print(json.dumps(data))
        return
    width = max(len(k) for k in data)
    for key, value in data.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
