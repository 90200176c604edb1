"""The mock fleet a comparison runs against: started once, reset between runs, scraped.

Every policy must meet the same fleet in the same state, so between runs the harness
waits until no engine has work left and then empties every prefix cache
(``POST /reset_prefix_cache``, refused by an engine while blocks are still in use).
Which engine served how many requests comes from each engine's own ``/metrics``
counters, read before and after a run, so it needs nothing from the router.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from switchyard.loadtest.procs import free_port_block, wait_http
from switchyard.loadtest.prom import totals

SERVED = "vllm:e2e_request_latency_seconds_count"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
COUNTERS = (SERVED, HITS, QUERIES)
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class Engine:
    url: str
    kv_events: str | None


@dataclass
class RunningFleet:
    """Engines that already run (a real fleet, named by URL): reset and counted as the mock
    fleet is. No KV-event endpoints: the routers find them (``GET /kv_event_sources``)."""

    engines: list[Engine]

    def counters(self) -> list[dict[str, float]]:
        """Per engine: requests finished, prefix-cache hit and queried tokens so far."""
        with httpx.Client(timeout=10.0) as c:
            scraped = [totals(c.get(e.url + "/metrics").text) for e in self.engines]
        return [{name: m.get(name, 0.0) for name in COUNTERS} for m in scraped]

    def reset(self, timeout_s: float = 120.0) -> None:
        """Wait until every engine is idle, then empty every prefix cache."""
        reset_prefix_caches([e.url for e in self.engines], timeout_s, poll_s=0.2)


@dataclass
class MockFleet:
    """``switchyard mock-fleet`` as a child process, with what it printed about itself."""

    count: int
    num_gpu_blocks: int | None = None
    speed: float = 1.0
    seed: int = 0
    processes: int = 1
    extra_args: list[str] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 60.0, check_each: bool = True) -> MockFleet:
        """Start the fleet; with ``check_each`` also wait for every engine's ``/health`` in
        turn (mock-fleet prints its description once every process serves; checking
        thousands of engines one by one takes minutes)."""
        http = free_port_block(2 * self.count)  # one block: two separate ones could overlap
        zmq = http + self.count
        args = [
            sys.executable, "-m", "switchyard", "mock-fleet",
            "--count", str(self.count), "--base-port", str(http),
            "--kv-events-base-port", str(zmq), "--speed", str(self.speed),
            "--seed", str(self.seed), "--processes", str(self.processes),
            *(["--num-gpu-blocks", str(self.num_gpu_blocks)] if self.num_gpu_blocks else []),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError("mock fleet exited before printing its description")
        for e in json.loads(line)["engines"]:
            events = e.get("kv_events") or []
            endpoint = events[0]["endpoint"] if events else None
            self.engines.append(Engine(e["urls"][0]["url"], endpoint))
        deadline = time.monotonic() + timeout_s
        for engine in self.engines if check_each else ():
            wait_http(engine.url + "/health", deadline - time.monotonic(), self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def __enter__(self) -> MockFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def scrape(self) -> list[dict[str, float]]:
        with httpx.Client(timeout=5.0) as c:
            return [totals(c.get(e.url + "/metrics").text) for e in self.engines]

    def counters(self) -> list[dict[str, float]]:
        """Per engine: requests finished, prefix-cache hit and queried tokens so far."""
        return [{name: m.get(name, 0.0) for name in COUNTERS} for m in self.scrape()]

    def served(self) -> list[int]:
        """Requests each engine finished so far (its own counter)."""
        return [int(c[SERVED]) for c in self.counters()]

    def reset(self, timeout_s: float = 60.0) -> None:
        """Wait until every engine is idle, then empty every prefix cache."""
        reset_prefix_caches([e.url for e in self.engines], timeout_s)


def reset_prefix_caches(
    urls: list[str], timeout_s: float, request_timeout_s: float = 10.0, poll_s: float = 0.1
) -> None:
    """Wait until each engine (mock or vLLM) is idle, then empty its prefix cache.

    Idle first: a cache emptied under a running request is refilled by it, and the next
    run would start warm.
    """
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=request_timeout_s) as c:
        for url in urls:
            while True:
                metrics = totals(c.get(url + "/metrics").text)
                idle = all(metrics.get(name, 0.0) == 0 for name in BUSY)
                if idle and c.post(url + "/reset_prefix_cache").status_code == 200:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not become idle to reset its cache")
                time.sleep(poll_s)
