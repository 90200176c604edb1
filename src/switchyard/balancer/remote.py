"""``RemoteFleet``: a ``FleetView`` backed by a balancer service (``--balancer URL``).

The hot-path methods stay local and synchronous: candidates come from a mirror of
``GET /v1/workers`` refreshed in the background, and ticket begin/first-token/end
are applied to the mirror at once and reported to the service without waiting
(each ticket's reports are kept in order). The service stays the authority on
health and on everyone's in-flight counts. The mirror is a ``Fleet`` this class
never starts: its registry and accounting, without probes or sources.

The service is called through the router's own pool (``switchyard.net.httpclient``), as
``RemoteKVStore`` calls its service: three ticket reports go out per routed request, so
they are data-path calls, not control-plane ones. Failures are the classes of
``switchyard.net.errors``; an answer that is not 2xx is ``ServiceRefused``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

import orjson

from switchyard.balancer.fleet import Fleet
from switchyard.balancer.health import Circuit
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.shared import set_remote
from switchyard.balancer.view import Listener
from switchyard.balancer.worker import LoraSample, Outcome, Role, Ticket, Worker, WorkerSpec
from switchyard.net.errors import TransportError
from switchyard.net.httpclient import ConnectionPool

log = logging.getLogger("switchyard.balancer.remote")

Call = tuple[str, str, dict[str, Any] | None, dict[str, str] | None]
# Each call to the service as a whole, waiting for a connection included.
_TIMEOUT_S = 5.0
# Connections to the service: the ticket reports of concurrent requests go in parallel.
_MAX_CONNECTIONS = 100
# Below uvicorn's 5 s keep-alive (the service's server), so a report is not written on a
# connection the service is closing: a request written is never sent twice.
_KEEPALIVE_S = 4.0


class ServiceRefused(Exception):
    """The balancer service answered, but not with a 2xx."""


class RemoteFleet:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        refresh_interval: float = 0.5,
        settings: BalancerSettings | None = None,
    ) -> None:
        settings = settings or BalancerSettings()
        self.settings = settings
        self.base_url = base_url.rstrip("/")
        # Sent on every call: the service's admin key (to add workers) or its data key.
        self.api_key = api_key or settings.admin_api_key
        self.refresh_interval = refresh_interval
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        self._headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._pool: ConnectionPool | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._reports: dict[str, asyncio.Task[None] | None] = {}
        self._pending: set[asyncio.Task[Any]] = set()
        self._queued: list[Call] = []
        self._mirror_fleet = Fleet(settings.model_copy(update={"workers": []}))
        # The settings' static workers are registered with the service (queued until start).
        for text in settings.workers:
            self.add(WorkerSpec.parse(text))

    async def start(self) -> None:
        if self._pool is not None:
            return
        self._pool = ConnectionPool(
            connect_timeout_s=_TIMEOUT_S, max_per_origin=_MAX_CONNECTIONS, keepalive_s=_KEEPALIVE_S
        )
        for method, path, body, params in self._queued:
            await self._call(method, path, body, params)
        self._queued.clear()
        await self.refresh()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None
        await asyncio.gather(*self._pending, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _exchange(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> bytes:
        """The body of the service's 2xx answer to one call, all of it within ``_TIMEOUT_S``;
        ``ServiceRefused`` for any other status."""
        assert self._pool is not None
        url = self.base_url + path + ("?" + urlencode(params) if params else "")
        headers = self._headers
        payload = b""
        if body is not None:
            headers = {**headers, "content-type": "application/json"}
            payload = orjson.dumps(body)
        async with asyncio.timeout(_TIMEOUT_S):
            answer = await self._pool.request(method, url, payload, headers)
            try:
                raw = await answer.read()
            finally:
                answer.close()
        if not 200 <= answer.status < 300:
            raise ServiceRefused(f"{method} {path} -> HTTP {answer.status}")
        return raw

    # Mirror

    async def refresh(self) -> None:
        """Replace the mirror with the service's view (keeping this router's own counts)."""
        listing = orjson.loads(await self._exchange("GET", "/v1/workers"))
        seen = set()
        for item in listing.get("workers", []):
            spec = WorkerSpec.from_any(item["spec"])
            worker = self._mirror_fleet.add(spec, source=item.get("source", "remote"))
            seen.add(worker.id)
            self._mirror(worker, item)
        for worker in self.workers():
            if worker.id not in seen:
                self._mirror_fleet.remove(worker.id, broadcast=False)

    def _mirror(self, worker: Worker, item: dict[str, Any]) -> None:
        models = set(item.get("models") or [])
        adapters = dict(item.get("adapters") or {})
        if models != worker.models or adapters != worker.adapters:
            self._mirror_fleet.set_models(worker, models, adapters)
        lora = item.get("lora")
        worker.lora = (
            None
            if lora is None
            else LoraSample(tuple(lora["running"]), tuple(lora["waiting"]), int(lora["max_lora"]))
        )
        worker.healthy = bool(item.get("healthy", True))
        worker.draining = bool(item.get("draining", False))
        worker.ejected_until = time.monotonic() + 3600 if item.get("ejected") else 0.0
        worker.flavor = item.get("flavor") or worker.flavor
        if item.get("circuit") == "open" and worker.breaker.state is Circuit.CLOSED:
            worker.breaker.trip()
        summed = [0, 0, 0, 0]
        for rank in item.get("ranks", []):
            i = int(rank["rank"])
            if i >= len(worker.ranks):
                continue
            c = worker.ranks[i]
            values = (
                max(int(rank["inflight"]) - c.inflight, 0),
                max(int(rank["prefill_tokens"]) - c.prefill_tokens, 0),
                max(int(rank["decode_seqs"]) - c.decode_seqs, 0),
                max(int(rank["decode_tokens"]) - c.decode_tokens, 0),
            )
            set_remote(c, values)
            summed = [a + b for a, b in zip(summed, values, strict=True)]
        set_remote(worker.totals, summed)
        worker.inflight = worker.local_inflight + summed[0]

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                await self.refresh()
            except (TransportError, TimeoutError, ServiceRefused, ValueError) as exc:
                log.warning("balancer %s unreachable: %s", self.base_url, exc)

    # Reports to the service

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        params: dict[str, str] | None,
    ) -> None:
        if self._pool is None:
            return
        try:
            await self._exchange(method, path, body, params)
        except ServiceRefused as exc:
            log.warning("balancer %s", exc)
        except (TransportError, TimeoutError) as exc:
            log.warning("balancer %s %s failed: %s", method, path, exc)

    def _send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        after: asyncio.Task[None] | None = None,
    ) -> asyncio.Task[None] | None:
        """Report to the service in the background, after ``after`` (same ticket) is done.

        Before ``start`` (no loop, no session yet) admin calls wait in a queue.
        """
        if self._pool is None:
            self._queued.append((method, path, body, params))
            return None

        async def send() -> None:
            if after is not None:
                await asyncio.gather(after, return_exceptions=True)
            await self._call(method, path, body, params)

        task = asyncio.get_running_loop().create_task(send())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    # Hot path: the mirror answers, the service hears about tickets

    def candidates(self, model: str | None, role: Role = Role.UNIFIED) -> list[Worker]:
        return self._mirror_fleet.candidates(model, role)

    def choose_rank(self, worker: Worker, *, prompt_tokens: int = 0) -> int | None:
        return self._mirror_fleet.choose_rank(worker, prompt_tokens=prompt_tokens)

    def address(self, worker: Worker, rank: int | None) -> tuple[str, Mapping[str, str]]:
        return self._mirror_fleet.address(worker, rank)

    def progress(self, ticket: Ticket, generated_tokens: int) -> None:
        self._mirror_fleet.progress(ticket, generated_tokens)

    def begin(
        self,
        worker: Worker,
        *,
        prompt_tokens: int = 0,
        dp_rank: int | None = None,
        prefill_tokens: int | None = None,
    ) -> Ticket:
        ticket = self._mirror_fleet.begin(
            worker, prompt_tokens=prompt_tokens, dp_rank=dp_rank, prefill_tokens=prefill_tokens
        )
        ticket.id = f"{self._prefix}-{next(self._ids)}"
        body = {
            "worker_id": worker.id,
            "prompt_tokens": prompt_tokens,
            "rank": ticket.rank,
            "id": ticket.id,
        }
        self._reports[ticket.id] = self._send("POST", "/v1/tickets", body)
        return ticket

    def first_token(self, ticket: Ticket) -> None:
        if ticket.decoding or ticket.done:
            return
        self._mirror_fleet.first_token(ticket)
        previous = self._reports.get(ticket.id)
        self._reports[ticket.id] = self._send(
            "POST", f"/v1/tickets/{ticket.id}/first_token", after=previous
        )

    def end(self, ticket: Ticket, outcome: Outcome) -> None:
        if ticket.done:
            return
        self._mirror_fleet.end(ticket, outcome)
        previous = self._reports.pop(ticket.id, None)
        path = f"/v1/tickets/{ticket.id}/end"
        self._send("POST", path, {"outcome": str(outcome)}, after=previous)

    # Admin, applied to the mirror and forwarded (workers are named by ``?url=``)

    def add(self, spec: WorkerSpec, source: str = "admin") -> Worker:
        worker = self._mirror_fleet.add(spec, source=source)
        self._send("POST", "/admin/workers", spec.to_dict())
        return worker

    def remove(self, worker_id: str, *, broadcast: bool = True) -> bool:
        removed = self._mirror_fleet.remove(worker_id, broadcast=False)
        if broadcast:
            self._send("DELETE", "/admin/workers", params={"url": worker_id})
        return removed

    def drain(
        self, worker_id: str, *, remove_when_idle: bool = False, broadcast: bool = True
    ) -> bool:
        drained = self._mirror_fleet.drain(
            worker_id, remove_when_idle=remove_when_idle, broadcast=False
        )
        if broadcast and drained:
            params = {"url": worker_id, "remove_when_idle": str(remove_when_idle).lower()}
            self._send("POST", "/admin/workers/drain", params=params)
        return drained

    def undrain(self, worker_id: str, *, broadcast: bool = True) -> bool:
        undrained = self._mirror_fleet.undrain(worker_id, broadcast=False)
        if broadcast and undrained:
            self._send("POST", "/admin/workers/undrain", params={"url": worker_id})
        return undrained

    # Reads, from the mirror

    def get(self, worker_id: str) -> Worker | None:
        return self._mirror_fleet.get(worker_id)

    def workers(self) -> list[Worker]:
        return self._mirror_fleet.workers()

    def models(self) -> list[str]:
        return self._mirror_fleet.models()

    def has_model(self, model: str) -> bool:
        return self._mirror_fleet.has_model(model)

    def parent_of(self, model: str) -> str | None:
        return self._mirror_fleet.parent_of(model)

    async def refresh_models(self, workers: Iterable[Worker] | None = None) -> None:
        """Mirror the service again: it reads the workers' models on its own schedule."""
        try:
            await self.refresh()
        except (TransportError, TimeoutError, ServiceRefused, ValueError) as exc:
            log.debug("mirror refresh failed: %s", exc)

    def subscribe(self, callback: Listener) -> None:
        self._mirror_fleet.subscribe(callback)

    def describe(self) -> list[dict[str, Any]]:
        return self._mirror_fleet.describe()
