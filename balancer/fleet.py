"""The embedded balancer: registry, health, load accounting and DP-rank choice in one object.

The router calls ``candidates``/``begin``/``first_token``/``end``/``choose_rank`` on
every request, so those are synchronous and touch only in-memory state. Everything
that does I/O (probes, model refresh, metric scrapes, discovery, Redis sharing) runs
in background tasks started by ``start``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import aiohttp
import orjson

from balancer import dp
from balancer.filesource import FileSource
from balancer.health import Circuit
from balancer.scrape import Scrape, parse_metrics
from balancer.settings import BalancerSettings
from balancer.shared import RedisShare
from balancer.worker import (
    EngineSample,
    Outcome,
    RankCounters,
    Role,
    Ticket,
    Worker,
    WorkerSpec,
)

log = logging.getLogger("switchyard.balancer")

Listener = Callable[[str, Worker], None]


class Source(Protocol):
    """A registry source run by the fleet (file watcher, Kubernetes, Redis sharing)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _rank_counters(ticket: Ticket) -> RankCounters | None:
    """The ticket's rank counters (None if a respec shrank the worker's ranks since)."""
    ranks = ticket.worker.ranks
    return ranks[ticket.rank] if ticket.rank < len(ranks) else None


class Fleet:
    """The set of workers a router may send to, and what it knows about each."""

    def __init__(
        self, settings: BalancerSettings | None = None, specs: Iterable[WorkerSpec] = ()
    ) -> None:
        self.settings = settings or BalancerSettings()
        self._workers: dict[str, Worker] = {}
        self._pools: dict[tuple[str | None, Role], list[Worker]] = {}
        self._listeners: list[Listener] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._sources: list[Source] = []
        self._session: aiohttp.ClientSession | None = None
        self._started = False
        self._ticket_ids = itertools.count(1)
        self.shared: RedisShare | None = None
        for text in self.settings.workers:
            self.add(WorkerSpec.parse(text))
        for spec in specs:
            self.add(spec)

    # Lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.probe_timeout)
        )
        for worker in list(self._workers.values()):
            self._spawn(worker)
        s = self.settings
        if s.redis_url:
            self.shared = RedisShare(self, s.redis_url)
            self._sources.append(self.shared)
        if s.workers_file:
            self._sources.append(FileSource(self, s.workers_file))
        if s.kubernetes:
            # Imported on demand: the kubernetes client costs ~0.25 s to import.
            from balancer.k8s import KubernetesSource

            self._sources.append(KubernetesSource(self))
        for source in self._sources:
            await source.start()

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        for source in reversed(self._sources):
            await source.stop()
        self._sources.clear()
        self.shared = None
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # Registry

    def add(self, spec: WorkerSpec, source: str = "static") -> Worker:
        """Add a worker, or update the spec of the one with the same URL."""
        existing = self._workers.get(spec.url)
        if existing is not None:
            if existing.spec != spec:
                self._respec(existing, spec)
                self._notify("changed", existing)
            if existing.draining and existing.remove_when_idle:
                existing.draining = existing.remove_when_idle = False
                self._notify("changed", existing)
            if source == "admin" and self.shared is not None:
                self.shared.publish_add(spec)
            return existing
        worker = Worker(spec, self.settings, source)
        self._workers[worker.id] = worker
        self._pools.clear()
        if self._started:
            self._spawn(worker)
        self._notify("added", worker)
        if source == "admin" and self.shared is not None:
            self.shared.publish_add(spec)
        return worker

    def remove(self, worker_id: str, *, broadcast: bool = True) -> bool:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return False
        self._pools.clear()
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self._wake.pop(worker_id, None)
        self._notify("removed", worker)
        if broadcast and worker.source == "admin" and self.shared is not None:
            self.shared.publish_remove(worker_id)
        return True

    def drain(
        self, worker_id: str, *, remove_when_idle: bool = False, broadcast: bool = True
    ) -> bool:
        """Stop sending new requests; in-flight ones finish. Optionally remove once idle."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.draining = True
        worker.remove_when_idle = worker.remove_when_idle or remove_when_idle
        self._notify("changed", worker)
        if broadcast and worker.source == "admin" and self.shared is not None:
            self.shared.publish_drain(worker_id)
        if worker.remove_when_idle and worker.local_inflight == 0:
            self.remove(worker_id, broadcast=broadcast)
        return True

    def undrain(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.draining = worker.remove_when_idle = False
        self._notify("changed", worker)
        return True

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def models(self) -> list[str]:
        return sorted({m for w in self._workers.values() for m in w.models})

    def has_model(self, model: str) -> bool:
        return any(model in w.models for w in self._workers.values())

    def subscribe(self, callback: Listener) -> None:
        """``callback(event, worker)`` with event "added", "removed" or "changed"."""
        self._listeners.append(callback)

    # Hot path

    def candidates(self, model: str | None, role: Role = Role.UNIFIED) -> list[Worker]:
        """Workers that may take a request now (see ``Worker.routable``)."""
        pool = self._pools.get((model, role))
        if pool is None:
            pool = [
                w
                for w in self._workers.values()
                if w.role == role and (model is None or model in w.models)
            ]
            self._pools[(model, role)] = pool
        now = time.monotonic()
        closed = Circuit.CLOSED
        return [
            w
            for w in pool
            if w.healthy
            and not w.draining
            and w.ejected_until <= now
            and (w.breaker.state is closed or w.breaker.admits(now))
        ]

    def begin(
        self,
        worker: Worker,
        *,
        prompt_tokens: int = 0,
        dp_rank: int | None = None,
        prefill_tokens: int | None = None,
    ) -> Ticket:
        """Count a request in flight; ``prefill_tokens`` is the part the engine must compute.

        A prompt the engine mostly holds in its prefix cache queues little prefill work
        but still adds its whole length to the decode context; without a cache estimate
        both are ``prompt_tokens``.
        """
        queued = prompt_tokens if prefill_tokens is None else prefill_tokens
        rank = dp_rank if dp_rank is not None and 0 <= dp_rank < len(worker.ranks) else 0
        trial = worker.breaker.on_begin()
        counters = worker.ranks[rank]
        counters.inflight += 1
        counters.prefill_tokens += queued
        totals = worker.totals
        totals.inflight += 1
        totals.prefill_tokens += queued
        worker.inflight += 1
        worker.local_inflight += 1
        worker.sent_since_scrape += 1
        return Ticket(
            worker,
            rank,
            prompt_tokens,
            trial=trial,
            id=f"t{next(self._ticket_ids)}",
            prefill_tokens=queued,
        )

    def first_token(self, ticket: Ticket) -> None:
        if ticket.decoding or ticket.done:
            return
        ticket.decoding = True
        worker = ticket.worker
        n = ticket.prompt_tokens
        for counters in (_rank_counters(ticket), worker.totals):
            if counters is None:
                continue
            counters.prefill_tokens -= ticket.prefill_tokens
            counters.decode_seqs += 1
            counters.decode_tokens += n

    def progress(self, ticket: Ticket, generated_tokens: int) -> None:
        """Optional: output tokens so far, so decode context (what a step attends) grows.

        Callers relaying a stream may report every few chunks; without it a decoding
        request counts its prompt tokens only.
        """
        if ticket.done or not ticket.decoding or generated_tokens <= ticket.generated:
            return
        grown = generated_tokens - ticket.generated
        rank = _rank_counters(ticket)
        if rank is not None:
            rank.decode_tokens += grown
        ticket.worker.totals.decode_tokens += grown
        ticket.generated = generated_tokens

    def end(self, ticket: Ticket, outcome: Outcome) -> None:
        if ticket.done:
            return
        ticket.done = True
        worker = ticket.worker
        for counters in (_rank_counters(ticket), worker.totals):
            if counters is None:
                continue
            counters.inflight -= 1
            if ticket.decoding:
                counters.decode_seqs -= 1
                counters.decode_tokens -= ticket.prompt_tokens + ticket.generated
            else:
                counters.prefill_tokens -= ticket.prefill_tokens
        worker.inflight -= 1
        worker.local_inflight -= 1
        self._record_outcome(worker, ticket.trial, Outcome(outcome))
        if worker.remove_when_idle and worker.local_inflight == 0 and worker.id in self._workers:
            self.remove(worker.id, broadcast=False)

    def choose_rank(self, worker: Worker, *, prompt_tokens: int = 0) -> int | None:
        if len(worker.ranks) == 1:
            return None
        policy = self.settings.dp_policy
        if policy == "step_balanced":
            prefill = worker.role is not Role.DECODE
            return dp.step_balanced(self.settings, worker.ranks, prompt_tokens, prefill=prefill)
        if policy == "minimum_tokens":
            return dp.minimum_tokens(worker.ranks)
        if policy == "least_requests":
            return dp.least_requests(worker.ranks)
        worker._rr = (worker._rr + 1) % len(worker.ranks)
        return worker._rr

    def rank_url(self, worker: Worker, rank: int) -> str:
        if worker.spec.dp_mode == "urls" and 0 <= rank < len(worker.spec.rank_urls):
            return worker.spec.rank_urls[rank]
        return worker.url

    # Passive health

    def _record_outcome(self, worker: Worker, trial: bool, outcome: Outcome) -> None:
        counted = outcome is not Outcome.CLIENT_ABORT
        failed = outcome.is_failure
        before = worker.breaker.state
        changed = worker.breaker.on_end(failed, trial, counted)
        if changed is Circuit.CLOSED:
            worker.warm_since = time.monotonic()
        if changed is not None or worker.breaker.state is not before:
            self._notify("changed", worker)
        if not counted:
            return
        worker.outliers.record(failed)
        if failed:
            worker.last_error = str(outcome)
            self._maybe_eject(worker)
            if outcome is Outcome.CONNECT_ERROR:
                self._wake_probe(worker)

    def _maybe_eject(self, worker: Worker) -> None:
        s = self.settings
        window = worker.outliers
        if len(window) < s.outlier_min_requests or window.error_rate < s.outlier_error_rate:
            return
        now = time.monotonic()
        if worker.ejected_until > now:
            return
        ejected = sum(1 for w in self._workers.values() if w.ejected_until > now)
        if ejected + 1 > s.outlier_max_ejected_fraction * len(self._workers):
            return
        worker.ejected_until = now + s.outlier_ejection_time
        worker.warm_since = worker.ejected_until
        window.clear()
        log.warning("ejected outlier %s for %.1fs", worker.id, s.outlier_ejection_time)
        self._notify("changed", worker)

    # Background work per worker

    def _spawn(self, worker: Worker) -> None:
        self._wake[worker.id] = asyncio.Event()
        self._tasks[worker.id] = asyncio.get_running_loop().create_task(
            self._watch_worker(worker), name=f"balancer:{worker.id}"
        )

    def _wake_probe(self, worker: Worker) -> None:
        event = self._wake.get(worker.id)
        if event is not None:
            event.set()

    async def _watch_worker(self, worker: Worker) -> None:
        s = self.settings
        next_probe = next_scrape = next_models = 0.0
        last_probe = float("-inf")
        event = self._wake[worker.id]
        while True:
            now = time.monotonic()
            if event.is_set():
                event.clear()
                if now - last_probe > min(0.05, s.probe_interval):
                    next_probe = now
            if now >= next_probe:
                last_probe = now
                await self._probe(worker)
                next_probe = time.monotonic() + s.probe_interval
            if worker.healthy and (not worker.models or now >= next_models):
                if not worker.spec.models:
                    await self._refresh_models(worker)
                next_models = time.monotonic() + (
                    s.model_refresh_interval if worker.models else s.probe_interval
                )
            if worker.healthy and now >= next_scrape:
                await self._scrape(worker)
                next_scrape = time.monotonic() + s.scrape_interval
            wait = min(next_probe, next_scrape, next_models) - time.monotonic()
            try:
                await asyncio.wait_for(event.wait(), timeout=max(wait, 0.01))
            except TimeoutError:
                pass

    async def _get(self, url: str, timeout: float) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()

    async def _probe(self, worker: Worker) -> None:
        s = self.settings
        try:
            status, _ = await self._get(worker.url + s.probe_path, s.probe_timeout)
            ok, error = 200 <= status < 300, f"probe status {status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, error = False, f"probe {type(exc).__name__}"
        if worker.id not in self._workers:
            return
        if ok:
            worker.probe_failures = 0
            worker.probe_successes += 1
            if not worker.healthy and worker.probe_successes >= s.healthy_threshold:
                worker.healthy = True
                worker.warm_since = time.monotonic()
                log.info("worker %s healthy", worker.id)
                self._notify("changed", worker)
            return
        worker.probe_successes = 0
        worker.probe_failures += 1
        worker.last_error = error
        if worker.healthy and worker.probe_failures >= s.unhealthy_threshold:
            worker.healthy = False
            log.warning("worker %s unhealthy: %s", worker.id, error)
            self._notify("changed", worker)

    async def _refresh_models(self, worker: Worker) -> None:
        try:
            status, body = await self._get(worker.url + "/v1/models", self.settings.probe_timeout)
            if status != 200:
                return
            data = orjson.loads(body).get("data", [])
            models = {str(item["id"]) for item in data if isinstance(item, dict) and "id" in item}
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError) as exc:
            log.debug("model refresh of %s failed: %s", worker.id, exc)
            return
        if models and models != worker.models and worker.id in self._workers:
            worker.models = models
            self._pools.clear()
            self._notify("changed", worker)

    async def _scrape(self, worker: Worker) -> None:
        s = self.settings
        urls = worker.spec.rank_urls if worker.spec.dp_mode == "urls" else [worker.url]
        samples = []
        for url in urls:
            try:
                status, body = await self._get(url + "/metrics", s.scrape_timeout)
            except (aiohttp.ClientError, TimeoutError, OSError):
                status, body = 0, b""
            if status != 200:
                for counters in worker.ranks:
                    counters.hidden_tokens = 0
                return
            samples.append(parse_metrics(body.decode("utf-8", "replace")))
        self.apply_scrape(worker, samples)

    def apply_scrape(self, worker: Worker, samples: list[Scrape]) -> None:
        """Take in one scrape: the whole worker's, or one per rank URL in "urls" mode.

        Also sets each rank's ``hidden_tokens``: KV tokens the engine holds beyond the
        router-side count (generated tokens, other clients), which ``step_balanced`` adds.
        """
        if not samples or samples[0].total is None:
            return
        if worker.flavor is None and samples[0].flavor is not None:
            worker.flavor = samples[0].flavor
        if len(samples) == 1:
            worker.engine = samples[0].total
            worker.engine_ranks = dict(samples[0].ranks)
            if not worker.engine_ranks and len(worker.ranks) == 1 and worker.engine is not None:
                worker.engine_ranks = {0: worker.engine}
        else:
            totals = [x.total for x in samples if x.total is not None]
            kvs = [t.kv_usage for t in totals if t.kv_usage is not None]
            worker.engine = EngineSample(
                running=sum(t.running for t in totals),
                waiting=sum(t.waiting for t in totals),
                kv_usage=sum(kvs) / len(kvs) if kvs else None,
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

    # Internals

    def _respec(self, worker: Worker, spec: WorkerSpec) -> None:
        worker.spec = spec
        worker.role = spec.role
        worker.flavor = spec.flavor or worker.flavor
        if spec.models:
            worker.models = set(spec.models)
        if spec.dp_size != len(worker.ranks):
            kept = worker.ranks[: spec.dp_size]
            worker.ranks = kept + [RankCounters() for _ in range(spec.dp_size - len(kept))]
        self._pools.clear()

    def _notify(self, event: str, worker: Worker) -> None:
        for callback in list(self._listeners):
            try:
                callback(event, worker)
            except Exception:
                log.exception("fleet listener failed on %s %s", event, worker.id)

    def describe(self) -> list[dict[str, Any]]:
        return [w.describe() for w in self._workers.values()]
