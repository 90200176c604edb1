"""``RemoteFleet``: the Fleet interface backed by a balancer service (``--balancer URL``).

The hot-path methods stay local and synchronous: candidates come from a mirror of
``GET /v1/workers`` refreshed in the background, and ticket begin/first-token/end
are applied to the mirror at once and reported to the service without waiting
(each ticket's reports are kept in order). The service stays the authority on
health and on everyone's in-flight counts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any

import aiohttp

from balancer.fleet import Fleet
from balancer.health import Circuit
from balancer.settings import BalancerSettings
from balancer.shared import set_remote
from balancer.worker import Outcome, Ticket, Worker, WorkerSpec

log = logging.getLogger("switchyard.balancer.remote")

Call = tuple[str, str, dict[str, Any] | None, dict[str, str] | None]


class RemoteFleet(Fleet):
    def __init__(
        self,
        base_url: str,
        *,
        admin_key: str | None = None,
        refresh_interval: float = 0.5,
        settings: BalancerSettings | None = None,
    ) -> None:
        # Set before Fleet.__init__, which adds the settings' static workers through
        # this class's add() (queued to the service until start()).
        settings = settings or BalancerSettings()
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key or settings.admin_key
        self.refresh_interval = refresh_interval
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        self._http: aiohttp.ClientSession | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._reports: dict[str, asyncio.Task[None] | None] = {}
        self._pending: set[asyncio.Task[Any]] = set()
        self._queued: list[Call] = []
        super().__init__(settings)

    async def start(self) -> None:
        if self._http is not None:
            return
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
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
        if self._http is not None:
            await self._http.close()
            self._http = None

    # Mirror

    async def refresh(self) -> None:
        """Replace the mirror with the service's view (keeping this router's own counts)."""
        assert self._http is not None
        async with self._http.get(self.base_url + "/v1/workers") as resp:
            resp.raise_for_status()
            listing = await resp.json()
        seen = set()
        for item in listing.get("workers", []):
            spec = WorkerSpec.from_any(item["spec"])
            worker = super().add(spec, source=item.get("source", "remote"))
            seen.add(worker.id)
            self._mirror(worker, item)
        for worker in self.workers():
            if worker.id not in seen:
                super().remove(worker.id, broadcast=False)

    def _mirror(self, worker: Worker, item: dict[str, Any]) -> None:
        models = set(item.get("models") or [])
        if models != worker.models:
            worker.models = models
            self._pools.clear()
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
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.warning("balancer %s unreachable: %s", self.base_url, exc)

    # Reports to the service

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        params: dict[str, str] | None,
    ) -> None:
        if self._http is None:
            return
        headers = {"X-Admin-Key": self.admin_key} if self.admin_key else None
        try:
            async with self._http.request(
                method, self.base_url + path, json=body, params=params, headers=headers
            ) as resp:
                if resp.status >= 400:
                    log.warning("balancer %s %s -> %s", method, path, resp.status)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
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
        if self._http is None:
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

    def begin(
        self,
        worker: Worker,
        *,
        prompt_tokens: int = 0,
        dp_rank: int | None = None,
        prefill_tokens: int | None = None,
    ) -> Ticket:
        ticket = super().begin(
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
        super().first_token(ticket)
        previous = self._reports.get(ticket.id)
        self._reports[ticket.id] = self._send(
            "POST", f"/v1/tickets/{ticket.id}/first_token", after=previous
        )

    def end(self, ticket: Ticket, outcome: Outcome) -> None:
        if ticket.done:
            return
        super().end(ticket, outcome)
        previous = self._reports.pop(ticket.id, None)
        path = f"/v1/tickets/{ticket.id}/end"
        self._send("POST", path, {"outcome": str(outcome)}, after=previous)

    # Admin, forwarded

    def add(self, spec: WorkerSpec, source: str = "admin") -> Worker:
        worker = super().add(spec, source=source)
        self._send("POST", "/admin/workers", spec.to_dict())
        return worker

    def remove(self, worker_id: str, *, broadcast: bool = True) -> bool:
        removed = super().remove(worker_id, broadcast=False)
        if broadcast:
            self._send("DELETE", "/admin/workers", params={"id": worker_id})
        return removed

    def drain(
        self, worker_id: str, *, remove_when_idle: bool = False, broadcast: bool = True
    ) -> bool:
        drained = super().drain(worker_id, remove_when_idle=remove_when_idle, broadcast=False)
        if broadcast and drained:
            params = {"id": worker_id, "remove_when_idle": str(remove_when_idle).lower()}
            self._send("POST", "/admin/workers/drain", params=params)
        return drained
