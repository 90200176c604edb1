"""Active health: one background task per worker probes it, learns its models, scrapes its metrics.

The fleet owns the registry and decides what a result means for routing; this module
only does the I/O and tells the fleet what it saw (``set_healthy``, ``set_models``).
A connect error on the request path wakes a worker's task for an early probe.

Its cost is bounded for large fleets, whose probes and scrapes would otherwise keep an
idle router busy (see docs/benchmarks.md, large_fleet). While a fleet is small (workers /
budget under ``probe_interval_s``) every worker is probed and scraped at the base
intervals. Beyond that, a worker that passed its probes backs off (the interval doubles
per good probe) up to ``workers / probe_budget_per_s``, at most
``probe_max_interval_s``; one failed probe or a connect error brings it back to the
base interval. An idle worker (nothing in flight, nothing sent since its last scrape,
and that scrape showed no running or waiting request) is scraped on the same stretched
interval: the router's own count of its requests is the fresh load signal then. The
first request sent to it asks for a scrape at once. A fleet the budget covers is
checked together, on one grid of its interval (one wake-up for all, ``Prober._due``);
a larger fleet's intervals are jittered by ±10% so its probes do not bunch. At most
``_MAX_CONNECTIONS`` requests of the prober are in flight at once.

The processes of one router probe and scrape once for all: a probe or scrape another
process shares (``take_probe``, ``take``, from ``balancer.siblings``) stands for this
process's own while it is fresh, and each one this process makes goes to ``on_probe`` or
``on_scrape``. A probe this process asks for itself (a connect error on its request
path) it always makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from switchyard.balancer import dp
from switchyard.balancer.scrape import Scrape, parse_metrics
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import EngineSample, LoraSample, Worker
from switchyard.net.errors import TransportError
from switchyard.net.httpclient import ConnectionPool

if TYPE_CHECKING:
    from switchyard.balancer.fleet import Fleet

log = logging.getLogger("switchyard.balancer.probe")

# Shortest gap between a wake-up probe and the probe before it.
_MIN_WAKE_GAP_S = 0.05
# Each interval is drawn from [1 - _JITTER, 1 + _JITTER] times its nominal length.
_JITTER = 0.1
# Probe, model and scrape requests in flight at once. At start a large fleet's tasks all
# probe at once and wait their turn on a semaphore, outside the timeout: a wait in a
# client's connection queue would count against the probe timeout and fail the probes of
# healthy workers.
_MAX_CONNECTIONS = 64
# Idle keep-alive connections to workers stay open this long, longer than a stretched
# interval, so a probe of a large fleet reuses its connection instead of a new one.
_KEEPALIVE_S = 75.0
# The loop's timers may fire this early (uvloop rounds them to milliseconds): a check due
# that soon runs now, not after one more wake-up.
_TIMER_SLACK_S = 0.002
# A probe or scrape taken from another process stands for this one's own for this many of
# its intervals: the other's intervals are jittered too, and its message takes a moment.
_TAKEN_FOR = 1.5


class Prober:
    """Runs the probe/model/scrape loop of every worker of ``fleet`` while started."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.settings = fleet.settings
        self._pool: ConnectionPool | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._looked: dict[str, asyncio.Event] = {}  # set after a worker's first probe
        self._probe_asked: set[str] = set()
        self._rng = random.Random()
        self._slots = asyncio.Semaphore(_MAX_CONNECTIONS)
        self._taken: dict[str, float] = {}  # when another process's scrape of a worker came
        self._probe_taken: dict[str, float] = {}  # when another process's probe of it came
        self.on_scrape: Callable[[Worker, list[Scrape]], None] | None = None
        self.on_probe: Callable[[Worker, bool, str], None] | None = None

    async def start(self) -> None:
        self._pool = ConnectionPool(
            connect_timeout_s=self.settings.probe_timeout_s,
            keepalive_s=_KEEPALIVE_S,
            ssl_context=self.fleet.ssl_context,
        )
        for worker in self.fleet.workers():
            self.watch(worker)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._wake.clear()
        self._looked.clear()
        self._probe_asked.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def first_look(self, timeout_s: float) -> None:
        """Until every watched worker has been probed once and, if it answered, asked for
        its models (or ``timeout_s``): a router process that took requests before it knew
        its workers' models would answer them 503 (as a second process, started a moment
        after the first had answered /ready, did)."""
        looked = [event.wait() for event in self._looked.values()]
        if looked:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.gather(*looked)

    def watch(self, worker: Worker) -> None:
        """Start the worker's loop (a newly registered worker)."""
        self._looked[worker.id] = asyncio.Event()
        self._wake[worker.id] = asyncio.Event()
        self._tasks[worker.id] = asyncio.get_running_loop().create_task(
            self._loop(worker), name=f"balancer:{worker.id}"
        )

    def forget(self, worker_id: str) -> None:
        """Stop the loop of a worker that left the registry."""
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self._wake.pop(worker_id, None)
        self._looked.pop(worker_id, None)
        self._probe_asked.discard(worker_id)
        self._taken.pop(worker_id, None)
        self._probe_taken.pop(worker_id, None)

    def take_probe(self, worker: Worker, ok: bool, error: str) -> None:
        """Another process's probe of ``worker``: counted as if made here, and this process
        skips its own probes while such ones keep coming."""
        if self._registered(worker):
            self._record_probe(worker, ok, error)
            self._probe_taken[worker.id] = time.monotonic()

    def take(self, worker: Worker, samples: list[Scrape]) -> None:
        """Another process's scrape of ``worker``: applied as if made here, and this
        process skips its own scrapes while such ones keep coming."""
        if self._registered(worker):
            apply_scrape(worker, samples)
            self._taken[worker.id] = time.monotonic()

    def wake(self, worker: Worker) -> None:
        """Probe ``worker`` now rather than at its next interval (it just failed a connect)."""
        event = self._wake.get(worker.id)
        if event is not None:
            self._probe_asked.add(worker.id)
            event.set()

    def demand(self, worker: Worker) -> None:
        """A request went to ``worker`` after an idle scrape: scrape it at the busy interval."""
        event = self._wake.get(worker.id)
        if event is not None:
            event.set()

    def _jittered(self, interval_s: float) -> float:
        return interval_s * self._rng.uniform(1.0 - _JITTER, 1.0 + _JITTER)

    def _due(self, began: float, interval_s: float, jittered_at: float) -> float:
        """When the next check runs, the last one having begun at ``began``.

        A fleet the budget covers at ``interval_s`` checks its workers together: at the
        first multiple of ``interval_s`` (one grid for every worker and process, as the
        monotonic clock is the system's) a tenth of it after ``began``, so one wake-up of
        the loop serves them all and their news shares one bus frame; a check on the grid
        is followed by the next point, one joining it comes within 1.1 intervals, as a
        jittered one did. Each worker on its own jittered time would wake an idle router
        once per worker and interval, and its siblings with it. A larger fleet
        checks at ``jittered_at``, so that its checks spread over the budget."""
        if len(self._tasks) > self.settings.probe_budget_per_s * interval_s:
            return jittered_at
        return math.ceil((began + _JITTER * interval_s) / interval_s) * interval_s

    async def _loop(self, worker: Worker) -> None:
        s = self.settings
        next_probe = next_scrape = next_models = 0.0
        last_probe = last_scrape = float("-inf")
        interval = s.probe_interval_s
        asked = False  # a probe this process asked for (a connect error) is made here
        event = self._wake[worker.id]
        looked = self._looked[worker.id]
        while True:
            now = time.monotonic()
            if event.is_set():
                event.clear()
                if worker.id in self._probe_asked:
                    self._probe_asked.discard(worker.id)
                    interval = s.probe_interval_s
                    if now - last_probe > min(_MIN_WAKE_GAP_S, s.probe_interval_s):
                        next_probe, asked = now, True
                if busy(worker):
                    next_scrape = min(next_scrape, last_scrape + s.scrape_interval_s)
            if now + _TIMER_SLACK_S >= next_probe:
                taken = self._probe_taken.get(worker.id, float("-inf"))
                shared = not asked and now - taken < interval * _TAKEN_FOR
                if shared:
                    passed = worker.probe_failures == 0  # what the taken probe saw
                else:
                    last_probe = now
                    passed = await self._probe(worker)
                asked = False
                stable = passed and worker.healthy
                interval = (
                    min(interval * 2, stretched(s, s.probe_interval_s, len(self._tasks)))
                    if stable
                    else s.probe_interval_s
                )
                next_probe = self._due(
                    now,
                    interval,
                    taken + self._jittered(interval) * _TAKEN_FOR
                    if shared
                    else time.monotonic() + self._jittered(interval),
                )
            if worker.healthy and (not worker.models or now + _TIMER_SLACK_S >= next_models):
                if not worker.spec.models:
                    await self._refresh_models(worker)
                next_models = time.monotonic() + (
                    s.model_refresh_interval_s if worker.models else s.probe_interval_s
                )
            looked.set()
            if worker.healthy and now + _TIMER_SLACK_S >= next_scrape:
                every = self._scrape_every(worker)
                taken = self._taken.get(worker.id, float("-inf"))
                if now - taken < every * _TAKEN_FOR:
                    next_scrape = self._due(now, every, taken + self._jittered(every) * _TAKEN_FOR)
                else:
                    await self._scrape(worker)
                    last_scrape = time.monotonic()
                    every = self._scrape_every(worker)
                    next_scrape = self._due(now, every, last_scrape + self._jittered(every))
            wait = min(next_probe, next_scrape, next_models) - time.monotonic()
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that meets a
            # set event (gh-86296), and ``demand`` sets it on every idle worker's request.
            try:
                async with asyncio.timeout(max(wait, 0.01)):
                    await event.wait()
            except TimeoutError:
                pass

    def _scrape_every(self, worker: Worker) -> float:
        s = self.settings
        if busy(worker):
            return s.scrape_interval_s
        return stretched(s, s.scrape_interval_s, len(self._tasks))

    async def _get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """Status and body of a GET, all within ``timeout``, through the workers' HTTP client
        the data path uses: a general client's request machinery dominated an idle router's
        profile (``docs/decisions/0002-http-client.md``)."""
        assert self._pool is not None
        async with self._slots, asyncio.timeout(timeout):
            resp = await self._pool.get(url)
            try:
                return resp.status, await resp.read()
            finally:
                resp.close()

    def _registered(self, worker: Worker) -> bool:
        return self.fleet.get(worker.id) is worker

    async def _probe(self, worker: Worker) -> bool:
        """Probe once; True if the worker answered 2xx."""
        s = self.settings
        try:
            status, _ = await self._get(worker.url + s.probe_path, s.probe_timeout_s)
            ok, error = 200 <= status < 300, f"probe status {status}"
        except (TransportError, TimeoutError) as exc:
            ok, error = False, f"probe {type(exc).__name__}"
        if self._registered(worker):
            self._record_probe(worker, ok, error)
            if self.on_probe is not None:
                self.on_probe(worker, ok, error)
        return ok

    def _record_probe(self, worker: Worker, ok: bool, error: str) -> None:
        """Count one probe's outcome and move the worker in or out of the routable set."""
        s = self.settings
        if ok:
            worker.probe_failures = 0
            worker.probe_successes += 1
            if not worker.healthy and worker.probe_successes >= s.healthy_threshold:
                self.fleet.set_healthy(worker, True)
            return
        worker.probe_successes = 0
        worker.probe_failures += 1
        worker.last_error = error
        if worker.healthy and worker.probe_failures >= s.unhealthy_threshold:
            self.fleet.set_healthy(worker, False, reason=error)

    async def refresh_models(self, worker: Worker) -> None:
        """Read the worker's models now (its spec names none), outside its loop's schedule."""
        if not worker.spec.models:
            await self._refresh_models(worker)

    async def _refresh_models(self, worker: Worker) -> None:
        """The served models; an item with a ``parent`` is a LoRA adapter of that base model
        (vLLM's ``/v1/models``)."""
        try:
            status, body = await self._get(worker.url + "/v1/models", self.settings.probe_timeout_s)
            if status != 200:
                return
            data = orjson.loads(body).get("data", [])
            items = [item for item in data if isinstance(item, dict) and "id" in item]
            models = {str(item["id"]) for item in items}
            adapters = {
                str(item["id"]): str(item["parent"])
                for item in items
                if isinstance(item.get("parent"), str) and item["parent"]
            }
        except (TransportError, TimeoutError, ValueError, AttributeError) as exc:
            log.debug("model refresh of %s failed: %s", worker.id, exc)
            return
        changed = models != worker.models or adapters != worker.adapters
        if models and changed and self._registered(worker):
            self.fleet.set_models(worker, models, adapters)

    async def _scrape(self, worker: Worker) -> None:
        s = self.settings
        urls = worker.spec.rank_urls if worker.spec.dp_mode == "urls" else [worker.url]
        samples = []
        for url in urls:
            try:
                status, body = await self._get(url + "/metrics", s.scrape_timeout_s)
            except (TransportError, TimeoutError):
                status, body = 0, b""
            if status != 200:
                for counters in worker.ranks:
                    counters.hidden_tokens = 0
                return
            samples.append(parse_metrics(body.decode("utf-8", "replace")))
        apply_scrape(worker, samples)
        if self.on_scrape is not None:
            self.on_scrape(worker, samples)


def stretched(settings: BalancerSettings, base_s: float, workers: int) -> float:
    """The longest interval a stable worker gets: ``workers`` spread over the budget, never
    below ``base_s`` (a small fleet keeps its base intervals) nor above the maximum."""
    spread = workers / settings.probe_budget_per_s
    return max(base_s, min(spread, settings.probe_max_interval_s))


def busy(worker: Worker) -> bool:
    """Whether the worker's load may have moved since its last scrape: requests in flight
    or sent since, or the scrape itself saw running or waiting requests."""
    if worker.inflight or worker.sent_since_scrape:
        return True
    sample = worker.engine
    return sample is not None and (sample.running > 0 or sample.waiting > 0)


def apply_scrape(worker: Worker, samples: list[Scrape]) -> None:
    """Take in one scrape: the whole worker's, or one per rank URL in "urls" mode.

    Also sets each rank's ``hidden_tokens``: KV tokens the engine holds beyond the
    router-side count (generated tokens, other clients), which ``step_balanced`` adds.
    """
    if not samples or samples[0].total is None:
        return
    if worker.flavor is None and samples[0].flavor is not None:
        worker.flavor = samples[0].flavor
    loras = [x.lora for x in samples if x.lora is not None]
    worker.lora = (
        None
        if not loras
        else loras[0]
        if len(loras) == 1
        else LoraSample(
            tuple(sorted({n for x in loras for n in x.running})),
            tuple(sorted({n for x in loras for n in x.waiting})),
            sum(x.max_lora for x in loras),
        )
    )
    if len(samples) == 1:
        worker.engine = samples[0].total
        worker.engine_ranks = dict(samples[0].ranks)
        if not worker.engine_ranks and len(worker.ranks) == 1 and worker.engine is not None:
            worker.engine_ranks = {0: worker.engine}
    else:
        totals = [x.total for x in samples if x.total is not None]
        kvs = [t.kv_usage for t in totals if t.kv_usage is not None]
        ttfts = [t for t in totals if t.ttft_sum is not None and t.ttft_count is not None]
        worker.engine = EngineSample(
            running=sum(t.running for t in totals),
            waiting=sum(t.waiting for t in totals),
            kv_usage=sum(kvs) / len(kvs) if kvs else None,
            ttft_sum=sum(t.ttft_sum or 0.0 for t in ttfts) if ttfts else None,
            ttft_count=sum(t.ttft_count or 0.0 for t in ttfts) if ttfts else None,
        )
        worker.engine_ranks = {i: x.total for i, x in enumerate(samples) if x.total}
    for i, counters in enumerate(worker.ranks):
        sample = worker.engine_ranks.get(i)
        if sample is None or sample.kv_tokens is None:
            counters.hidden_tokens = 0
        else:
            counters.hidden_tokens = max(sample.kv_tokens - dp.rank_tokens(counters), 0)
    worker.scraped_at = time.monotonic()
    worker.sent_since_scrape = 0
