"""What the router learns from and does to a real engine: its load, and cancellation."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from switchyard.loadtest.prom import values
from tests.real.conftest import ADMIN_API_KEY, MODEL
from tests.support import Server, eventually
from tools.realvllm import VllmEngine

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a very long story about a lighthouse."}],
    "max_tokens": 1900,
    "ignore_eos": True,
    "stream": True,
}


def engine_metric(engine_url: str, name: str, **labels: str) -> float:
    return sum(values(httpx.get(engine_url + "/metrics", timeout=10).text, name, **labels))


def test_vllm_metrics_become_the_workers_engine_load(router: Server) -> None:
    # The engines must still be running a request when the router next scrapes them, so
    # the test holds the load itself: two long answers are streamed again and again until
    # the router has shown it (a single answer can end before the first scrape). Many
    # answers at once would keep the API servers so busy that they answer /metrics slower
    # than the scrape timeout (see the next test's comment) and the router could miss
    # the running requests; two streams leave the API servers nearly idle.
    admin = {"Authorization": f"Bearer {ADMIN_API_KEY}"}
    with StreamingLoad(router.url + "/v1/chat/completions", LONG, streams=2) as load:

        def loaded_rank() -> dict:
            load.raise_if_failed()
            listing = httpx.get(router.url + "/admin/workers", headers=admin, timeout=30).json()
            ranks = [rank for worker in listing["workers"] for rank in worker["ranks"]]
            return next((rank for rank in ranks if shows_load(rank)), {})

        rank = eventually(loaded_rank, timeout_s=120, interval_s=0.2, message="a loaded rank")
    assert rank["engine_running"] >= 1
    assert rank["kv_usage"] > 0


def shows_load(rank: dict) -> bool:
    """One scrape's view of a rank with a running request holding KV blocks."""
    return (rank["engine_running"] or 0) >= 1 and (rank["kv_usage"] or 0.0) > 0


class StreamingLoad:
    """Keeps ``streams`` streamed requests in flight (each sent again as soon as it
    ends) until the ``with`` block is left: load that lasts as long as the test needs it,
    however fast the engine answers."""

    def __init__(self, url: str, body: dict, streams: int) -> None:
        self._url, self._body = url, body
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=streams)
        self._streams = streams
        self._runs: list[Future[None]] = []

    def __enter__(self) -> StreamingLoad:
        self._runs = [self._pool.submit(self._stream_again) for _ in range(self._streams)]
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """A stream that failed stops the test with its error, not with a timeout."""
        for run in self._runs:
            if run.done():
                run.result()

    def _stream_again(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                with client.stream("POST", self._url, json=self._body) as answer:
                    assert answer.status_code == 200, answer.read()
                    for _ in answer.iter_lines():
                        if self._stop.is_set():
                            return


def settled(engine_url: str, quiet_s: float = 2.0, timeout_s: float = 120.0) -> None:
    """Waits until the engine runs and queues nothing and its generated-token count stays
    put for ``quiet_s``: a request still running moves that count every step."""
    deadline = time.monotonic() + timeout_s
    last = engine_metric(engine_url, "vllm:generation_tokens_total")
    while True:
        time.sleep(quiet_s)
        now = engine_metric(engine_url, "vllm:generation_tokens_total")
        idle = engine_metric(engine_url, "vllm:num_requests_running") == 0
        idle = idle and engine_metric(engine_url, "vllm:num_requests_waiting") == 0
        if idle and now == last:
            return
        assert time.monotonic() < deadline, "the engine did not settle in time"
        last = now


def test_an_abandoned_stream_is_aborted_in_the_engine(
    router: Server, pair: list[VllmEngine]
) -> None:
    # vLLM does not count client aborts in request_success_total{finished_reason="abort"};
    # an aborted request is one that leaves the engine without finishing by its length.
    # 32 answers of 1900 tokens keep the engine busy for seconds past the disconnect. (A
    # busy API server can lag its engine so far that the running gauge never shows the
    # request, so the test does not wait for it: it waits for the engine to settle, and
    # an unaborted request would have finished, counted, by then.) The counts are read
    # before the request: read while an engine streams the 32 answers, its /metrics can
    # take long enough for every token to be generated before the client reads a line.
    before = {}
    for engine in pair:
        settled(engine.url)
        before[engine.url] = (
            engine_metric(engine.url, "vllm:request_success_total"),
            engine_metric(engine.url, "vllm:generation_tokens_total"),
        )
    body = {**LONG, "n": 32}
    sent = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=120) as r:
        worker = r.headers["x-switchyard-worker"]
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    closed_s = time.monotonic() - sent
    finished, generated = before[worker]
    settled(worker)
    tokens = engine_metric(worker, "vllm:generation_tokens_total") - generated
    done = engine_metric(worker, "vllm:request_success_total") - finished
    assert (done, tokens < 32 * 1900) == (0, True), f"{tokens=:.0f}, closed after {closed_s:.2f} s"
