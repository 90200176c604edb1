"""Soak: a router in front of two mock engines under steady load for ``--minutes`` (30).

Prints the router's RSS and open fd count at the start, half way and the end (Linux
``/proc``), with the requests answered so far, so growth over time shows; then each
failure's reason (HTTP status or client error) by the minute it happened in. Not in CI: it
runs for as long as asked. ``python -m bench.soak --minutes 2``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx

from switchyard.loadtest.procs import Server, free_port

MODEL = "mock-model"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Load:
    """Requests sent back to back by ``concurrency`` threads until stopped."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.began = time.monotonic()
        self.url = url
        self.concurrency = concurrency
        self.stop = threading.Event()
        self.ok = 0
        self.failed = 0
        self.reasons: Counter[str] = Counter()  # why requests failed: status or error class
        self.lock = threading.Lock()

    def worker(self, n: int) -> None:
        with httpx.Client(timeout=30) as client:
            i = 0
            while not self.stop.is_set():
                body = {"model": MODEL, "prompt": f"soak {n} {i} " * 16, "max_tokens": 8}
                body["stream"] = i % 2 == 0
                try:
                    status = client.post(self.url + "/v1/completions", json=body).status_code
                    reason = "" if status == 200 else f"HTTP {status}"
                except httpx.HTTPError as exc:
                    reason = type(exc).__name__
                with self.lock:
                    self.ok += not reason
                    self.failed += bool(reason)
                    if reason:
                        self.reasons[f"minute {int(self.minute())}: {reason}"] += 1
                i += 1

    def minute(self) -> float:
        return (time.monotonic() - self.began) / 60

    def run(self) -> ThreadPoolExecutor:
        pool = ThreadPoolExecutor(self.concurrency)
        for n in range(self.concurrency):
            pool.submit(self.worker, n)
        return pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to soak")
    parser.add_argument("--concurrency", type=int, default=4)
    opts = parser.parse_args(argv)
    if opts.minutes <= 0 or opts.concurrency < 1:
        parser.error("--minutes must be positive and --concurrency at least 1")
    with ExitStack() as stack:
        args = ["router", "--policy", "kv_aware"]
        for _ in range(2):
            port = free_port()
            engine = Server(["mock", "--port", str(port), "--speed", "20"], port)
            stack.callback(engine.stop)
            engine.start()
            args += ["--worker", f"{engine.url};models={MODEL}"]
        port = free_port()
        router = Server([*args, "--port", str(port)], port)
        stack.callback(router.stop)
        router.start()
        assert router.proc is not None
        pid = router.proc.pid
        load = Load(router.url, opts.concurrency)
        pool = load.run()
        total_s = opts.minutes * 60
        began = time.monotonic()
        print("| minute | router RSS MB | router fds | ok | failed |\n|---|---|---|---|---|")
        for at in (0.0, total_s / 2, total_s):
            time.sleep(max(0.0, began + at - time.monotonic()))
            print(
                f"| {at / 60:.1f} | {rss_mb(pid):.1f} | {fd_count(pid)} "
                f"| {load.ok} | {load.failed} |",
                flush=True,
            )
        load.stop.set()
        pool.shutdown(wait=True)
    for reason, count in sorted(load.reasons.items()):
        print(f"failed: {reason} x{count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
