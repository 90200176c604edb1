"""``--processes N``: several router processes on one port, one set of metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from switchyard.loadtest.prom import values
from switchyard.router.kv import COUNTER_SYNC_S
from switchyard.router.metrics import FLUSH_INTERVAL_S
from tests.router.conftest import StartRouter
from tests.router.stub_backend import StubBackend
from tests.support import TOKENIZER_DIR, eventually, redis_server

pytestmark = pytest.mark.timeout(60)

REQUESTS = 24
ADMIN = ("--admin-api-key", "adm")
AUTH = {"Authorization": "Bearer adm"}


def router_processes(pid: int) -> list[int]:
    """The serving children of a router's supervisor (not multiprocessing's helpers)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def complete_prompt(base_url: str, prompt: str) -> str:
    """One request on a connection of its own, so either process may accept it."""
    with openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0) as client:
        return client.completions.create(model="stub-model", prompt=prompt, max_tokens=4).id


def complete_once(base_url: str) -> str:
    return complete_prompt(base_url, "hello")


def wait_all_ready(url: str, timeout_s: float = 30.0) -> None:
    """Until /ready answers 200 on 10 fresh connections in a row: /health answering means
    one process is up, not that every process has probed its workers."""

    def all_ready() -> bool:
        return all(httpx.get(url + "/ready").status_code == 200 for _ in range(10))

    eventually(all_ready, timeout_s, 0.02, "router processes not all ready")


def test_two_processes_serve_one_port_and_sum_their_metrics(
    stub: StubBackend, start_router: StartRouter
) -> None:
    router = start_router(stub.url, args=("--processes", "2", "--policy", "round_robin"))
    assert router.proc is not None
    assert len(router_processes(router.proc.pid)) == 2
    wait_all_ready(router.url)
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(complete_once, [router.url] * REQUESTS))
    assert ids == ["cmpl-stub"] * REQUESTS
    # Each process writes its samples behind (``FLUSH_INTERVAL_S``): the sum is whole soon.
    deadline = time.monotonic() + 10 * FLUSH_INTERVAL_S
    while True:
        metrics = httpx.get(router.url + "/metrics").text
        answered = sum(values(metrics, "switchyard_router_requests_total", status="200"))
        if answered == REQUESTS or time.monotonic() > deadline:
            break
        time.sleep(FLUSH_INTERVAL_S / 2)
    assert answered == REQUESTS
    assert "switchyard_router_worker_routable" in metrics


def test_an_admin_change_reaches_every_process_without_redis(
    stub: StubBackend, stub2: StubBackend, start_router: StartRouter
) -> None:
    router = start_router(stub.url, args=("--processes", "2", *ADMIN))
    wait_all_ready(router.url)
    time.sleep(0.5)  # each process's bus finds the other within 0.1 s of the later start
    added = httpx.post(router.url + "/admin/workers", json={"url": stub2.url}, headers=AUTH)
    assert added.status_code == 201
    time.sleep(0.5)
    # Each GET is a fresh connection, which either process may accept: 20 in a row
    # listing the worker leave ~1e-6 odds that one process lacks it.
    for _ in range(20):
        workers = httpx.get(router.url + "/admin/workers", headers=AUTH).json()["workers"]
        assert stub2.url in {w["url"] for w in workers}


def test_requests_in_flight_on_one_process_count_in_the_others_load(
    stub: StubBackend, start_router: StartRouter
) -> None:
    router = start_router(stub.url, args=("--processes", "2", *ADMIN))
    wait_all_ready(router.url)
    stub.state.delay_s = 2.0
    with ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(complete_once, router.url) for _ in range(4)]
        time.sleep(0.8)
        seen = []
        for _ in range(10):
            workers = httpx.get(router.url + "/admin/workers", headers=AUTH).json()["workers"]
            seen.append(workers[0]["inflight"])
        assert all(p.result() == "cmpl-stub" for p in pending)
    assert seen == [4] * 10, "every process counts the 4 requests, wherever they run"


def test_an_admin_change_reaches_every_router_sharing_redis(
    stub: StubBackend, stub2: StubBackend, start_router: StartRouter
) -> None:
    with redis_server() as (url, _):
        first = start_router(stub.url, args=("--redis", url, *ADMIN))
        second = start_router(stub.url, args=("--redis", url, *ADMIN))
        added = httpx.post(first.url + "/admin/workers", json={"url": stub2.url}, headers=AUTH)
        assert added.status_code == 201

        def seen() -> set[str]:
            workers = httpx.get(second.url + "/admin/workers", headers=AUTH).json()["workers"]
            return {w["url"] for w in workers}

        eventually(lambda: stub2.url in seen(), 5, 0.05)


def test_a_process_that_dies_is_replaced_within_a_second(
    stub: StubBackend, start_router: StartRouter
) -> None:
    router = start_router(stub.url, args=("--processes", "2"))
    assert router.proc is not None
    wait_all_ready(router.url)
    first = router_processes(router.proc.pid)
    os.kill(first[0], signal.SIGKILL)

    def replaced() -> bool:
        now = router_processes(router.proc.pid)
        return len(now) == 2 and first[0] not in now

    # The bound is the behaviour: the supervisor looks every 0.5 s; a ping is not needed.
    eventually(replaced, 1.5, 0.05, "the killed process was not replaced")
    wait_all_ready(router.url)
    assert complete_once(router.url) == "cmpl-stub"


def test_each_process_tokenizer_cache_counts_reach_the_summed_metrics(
    stub: StubBackend, start_router: StartRouter
) -> None:
    # The counters move at a scrape in the answering process and every COUNTER_SYNC_S in
    # the others; each distinct prompt is one text piece, tokenized once where it landed.
    # (No parity canaries: they are chats tokenized by the same caches.)
    tokenizer = ("--tokenizer", str(TOKENIZER_DIR), "--no-kv-parity")
    args = ("--processes", "2", "--policy", "kv_aware", *tokenizer)
    router = start_router(stub.url, args=args)
    wait_all_ready(router.url)
    prompts = [f"prompt number {i}" for i in range(REQUESTS)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: complete_prompt(router.url, p), prompts))
    # One kept-alive connection, as a Prometheus scraper keeps: one process answers every
    # scrape, so the other's counts come from its own syncs.
    deadline = time.monotonic() + 3 * COUNTER_SYNC_S + 10 * FLUSH_INTERVAL_S
    with httpx.Client(base_url=router.url) as scraper:
        while True:
            metrics = scraper.get("/metrics").text
            name = "switchyard_router_tokenize_cache_total"
            misses = sum(values(metrics, name, outcome="miss"))
            if misses == REQUESTS or time.monotonic() > deadline:
                break
            time.sleep(FLUSH_INTERVAL_S)
    assert misses == REQUESTS
