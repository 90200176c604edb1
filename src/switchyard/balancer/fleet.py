"""The embedded balancer: registry, load accounting, passive health and DP-rank choice.

The router calls ``candidates``/``begin``/``first_token``/``end``/``choose_rank``/
``address`` on every request, so those are synchronous and touch only in-memory
state. The I/O runs in components ``start`` starts: the prober (``balancer.probe``:
probes, model refresh, metric scrapes) and the sources (file, Kubernetes, Redis).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from collections.abc import Iterable, Mapping
from functools import cache
from types import MappingProxyType
from typing import Any, Protocol

from switchyard.balancer import dp
from switchyard.balancer.filesource import FileSource
from switchyard.balancer.health import Circuit
from switchyard.balancer.probe import Prober
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.shared import FleetShare, RedisShare
from switchyard.balancer.view import Listener
from switchyard.balancer.worker import Outcome, RankCounters, Role, Ticket, Worker, WorkerSpec

log = logging.getLogger("switchyard.balancer")

# vLLM's and SGLang's header naming the DP rank that should serve a request.
RANK_HEADER = "X-data-parallel-rank"
NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@cache
def _rank_headers(rank: int) -> Mapping[str, str]:
    """The rank header, built once per rank (read-only: callers merge, never mutate)."""
    return MappingProxyType({RANK_HEADER: str(rank)})


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
        self,
        settings: BalancerSettings | None = None,
        specs: Iterable[WorkerSpec] = (),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``ssl_context``: how ``https://`` workers are probed (the router's ``tls``
        settings; None: the system's CAs)."""
        self.settings = settings or BalancerSettings()
        self.ssl_context = ssl_context
        self._workers: dict[str, Worker] = {}
        self._pools: dict[tuple[str | None, Role], list[Worker]] = {}
        self._parents: dict[str, str] | None = None  # adapter -> base model, built on demand
        self._model_refresh: asyncio.Task[None] | None = None
        self._model_refreshed = float("-inf")
        self._listeners: list[Listener] = []
        self._sources: list[Source] = []
        self._prober: Prober | None = None
        self._ticket_ids = itertools.count(1)
        self.shared: FleetShare | None = None
        self._siblings: FleetShare | None = None
        for text in self.settings.workers:
            self.add(WorkerSpec.parse(text))
        for spec in specs:
            self.add(spec)

    # Lifecycle

    async def start(self) -> None:
        if self._prober is not None:
            return
        self._prober = Prober(self)
        await self._prober.start()
        # A probe and a model list, each within the probe timeout.
        await self._prober.first_look(2 * self.settings.probe_timeout_s)
        s = self.settings
        self.shared = RedisShare(self, s.redis_url) if s.redis_url else self._siblings
        if self.shared is not None:
            self._sources.append(self.shared)
        if s.workers_file:
            self._sources.append(FileSource(self, s.workers_file))
        if s.kubernetes:
            # Imported on demand: the kubernetes client costs ~0.25 s to import.
            from switchyard.balancer.k8s import KubernetesSource

            self._sources.append(KubernetesSource(self))
        for source in self._sources:
            await source.start()

    async def stop(self) -> None:
        prober = self._prober
        if prober is None:
            return
        for source in reversed(self._sources):
            await source.stop()
        self._sources.clear()
        self.shared = None
        self._prober = None
        await prober.stop()

    @property
    def prober(self) -> Prober | None:
        """The probe loop while started."""
        return self._prober

    def share_with_siblings(self, share: FleetShare) -> None:
        """Share counts and admin changes with the other processes of this router, unless
        Redis shares them with every replica (set before ``start``)."""
        self._siblings = share

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
        self._forget_pools()
        if self._prober is not None:
            self._prober.watch(worker)
        self._notify("added", worker)
        if source == "admin" and self.shared is not None:
            self.shared.publish_add(spec)
        return worker

    def remove(self, worker_id: str, *, broadcast: bool = True) -> bool:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return False
        self._forget_pools()
        if self._prober is not None:
            self._prober.forget(worker_id)
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

    def undrain(self, worker_id: str, *, broadcast: bool = True) -> bool:
        """Take new requests again (and cancel a pending remove-when-idle)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.draining = worker.remove_when_idle = False
        self._notify("changed", worker)
        if broadcast and worker.source == "admin" and self.shared is not None:
            self.shared.publish_undrain(worker.spec)
        return True

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def models(self) -> list[str]:
        return sorted({m for w in self._workers.values() for m in w.models})

    def has_model(self, model: str) -> bool:
        return any(model in w.models for w in self._workers.values())

    def parent_of(self, model: str) -> str | None:
        """The base model of a LoRA adapter some worker lists, else None."""
        parents = self._parents
        if parents is None:
            parents = self._parents = {
                name: base for w in self._workers.values() for name, base in w.adapters.items()
            }
        return parents.get(model)

    async def refresh_models(self, workers: Iterable[Worker] | None = None) -> None:
        """Read models again now: of ``workers`` (one just loaded an adapter), or of every
        worker (a request named a model none lists) at most once per
        ``model_refresh_on_miss_s``, callers in that moment sharing the one read."""
        prober = self._prober
        if prober is None:
            return
        if workers is not None:
            await asyncio.gather(*(prober.refresh_models(w) for w in workers))
            return
        running = self._model_refresh
        if running is None or running.done():
            if time.monotonic() - self._model_refreshed < self.settings.model_refresh_on_miss_s:
                return
            self._model_refreshed = time.monotonic()
            running = self._model_refresh = asyncio.get_running_loop().create_task(
                self.refresh_models(
                    [w for w in self._workers.values() if w.healthy and not w.spec.models]
                )
            )
        await asyncio.shield(running)

    def subscribe(self, callback: Listener) -> None:
        """``callback(event, worker)`` with event "added", "removed" or "changed"."""
        self._listeners.append(callback)

    # What the prober saw

    def set_healthy(self, worker: Worker, healthy: bool, reason: str = "") -> None:
        """Active health changed: a recovered worker warms up again from slow start."""
        worker.healthy = healthy
        if healthy:
            worker.warm_since = time.monotonic()
            log.info("worker %s healthy", worker.id)
        else:
            log.warning("worker %s unhealthy: %s", worker.id, reason)
        self._notify("changed", worker)

    def set_models(
        self, worker: Worker, models: set[str], adapters: dict[str, str] | None = None
    ) -> None:
        worker.models = models
        if adapters is not None:
            worker.adapters = adapters
        self._forget_pools()
        self._notify("changed", worker)

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
        if worker.sent_since_scrape == 0 and worker.inflight == 0 and self._prober is not None:
            self._prober.demand(worker)  # an idle worker's scrape was stretched: due now
        counters = worker.ranks[rank]
        counters.inflight += 1
        counters.prefill_tokens += queued
        totals = worker.totals
        totals.inflight += 1
        totals.prefill_tokens += queued
        worker.inflight += 1
        worker.local_inflight += 1
        worker.sent_since_scrape += 1
        worker.begun_at = time.monotonic()
        if self.shared is not None:
            self.shared.changed(worker)
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
        if self.shared is not None:
            self.shared.changed(worker)

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
        if self.shared is not None:
            self.shared.changed(worker)
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

    def address(self, worker: Worker, rank: int | None) -> tuple[str, Mapping[str, str]]:
        """Where a request for ``rank`` goes: the rank's own URL ("urls" mode, rank 0 when
        none was chosen), or the worker's URL plus the rank header ("header" mode)."""
        spec = worker.spec
        if spec.dp_mode == "urls":
            i = rank or 0
            return (spec.rank_urls[i] if 0 <= i < len(spec.rank_urls) else worker.url), NO_HEADERS
        if rank is None:
            return worker.url, NO_HEADERS
        return worker.url, _rank_headers(rank)

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
            if outcome is Outcome.CONNECT_ERROR and self._prober is not None:
                self._prober.wake(worker)

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
        worker.ejected_until = now + s.outlier_ejection_s
        worker.warm_since = worker.ejected_until
        window.clear()
        log.warning("ejected outlier %s for %.1fs", worker.id, s.outlier_ejection_s)
        self._notify("changed", worker)

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
        self._forget_pools()

    def _forget_pools(self) -> None:
        """The registry or a worker's models changed: candidate pools are built again."""
        self._pools.clear()
        self._parents = None

    def _notify(self, event: str, worker: Worker) -> None:
        for callback in list(self._listeners):
            try:
                callback(event, worker)
            except Exception:
                log.exception("fleet listener failed on %s %s", event, worker.id)

    def describe(self) -> list[dict[str, Any]]:
        return [w.describe() for w in self._workers.values()]
