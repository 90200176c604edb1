"""The balancer as its own service (FastAPI): fleet state, picks and tickets, admin, metrics.

Routers that delegate call ``POST /v1/pick`` (the service chooses and counts the
request) or pick themselves from ``GET /v1/workers`` and report through
``/v1/tickets`` (what ``RemoteFleet`` does). The admin API (``balancer.admin``, the
same as the router's) is off until ``admin_api_key`` is set; the data endpoints take
``api_key`` when one is set (see ``switchyard.core.auth``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import BaseModel, Field

from switchyard.balancer.admin import admin_router
from switchyard.balancer.fleet import Fleet
from switchyard.balancer.settings import BalancerSettings
from switchyard.balancer.worker import Outcome, Role, Ticket, Worker, normalise_url
from switchyard.core.auth import admin_access, data_access, startup_line
from switchyard.core.errors import APIError, install_error_handlers

log = logging.getLogger("switchyard.balancer.service")

# Bounds of client-given numbers: beyond them a request is refused (400) rather than
# skewing the load counters every router shares. 10M tokens exceeds any model's context.
MAX_PROMPT_TOKENS = 10_000_000
MAX_RANK = 4095
MAX_ID_CHARS = 512
PromptTokens = Annotated[
    int, Field(ge=0, le=MAX_PROMPT_TOKENS, description="prompt length in tokens")
]


class PickRequest(BaseModel):
    model: str | None = Field(None, max_length=MAX_ID_CHARS)
    role: Role = Role.UNIFIED
    prompt_tokens: PromptTokens = 0
    exclude: list[Annotated[str, Field(max_length=MAX_ID_CHARS)]] = Field([], max_length=1024)
    begin: bool = Field(True, description="count the request in flight and return a ticket")


class PickResponse(BaseModel):
    worker_id: str
    url: str
    rank: int | None
    rank_url: str
    ticket: str | None
    headers: dict[str, str]


class TicketOpen(BaseModel):
    worker_id: str = Field(max_length=MAX_ID_CHARS)
    prompt_tokens: PromptTokens = 0
    rank: int | None = Field(None, ge=0, le=MAX_RANK, description="one of the worker's DP ranks")
    id: str | None = Field(
        None, max_length=MAX_ID_CHARS, description="client-chosen ticket id (must be unique)"
    )


class TicketEnd(BaseModel):
    outcome: Outcome = Outcome.SUCCESS


class Tickets:
    """Tickets handed to remote routers; forgotten ones end as aborts after ``ticket_ttl_s``."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.open: dict[str, tuple[Ticket, float]] = {}

    def add(self, ticket: Ticket, ticket_id: str | None = None) -> str:
        if ticket_id:
            ticket.id = ticket_id
        self.open[ticket.id] = (ticket, time.monotonic())
        return ticket.id

    def take(self, ticket_id: str) -> Ticket:
        entry = self.open.get(ticket_id)
        if entry is None:
            raise APIError(404, f"Unknown ticket {ticket_id}", code="ticket_not_found")
        return entry[0]

    def end(self, ticket_id: str, outcome: Outcome) -> None:
        ticket = self.take(ticket_id)
        del self.open[ticket_id]
        self.fleet.end(ticket, outcome)

    def expire(self) -> int:
        cutoff = time.monotonic() - self.fleet.settings.ticket_ttl_s
        old = [tid for tid, (_, at) in self.open.items() if at < cutoff]
        for tid in old:
            self.end(tid, Outcome.CLIENT_ABORT)
        return len(old)


class FleetCollector:
    """Prometheus view of the fleet, computed at scrape time."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily(
            "switchyard_balancer_worker_healthy", "1 if probes pass", labels=labels
        )
        routable = GaugeMetricFamily(
            "switchyard_balancer_worker_routable", "1 if it may take requests now", labels=labels
        )
        circuit = GaugeMetricFamily(
            "switchyard_balancer_worker_circuit_open",
            "0 closed, 1 open, 0.5 half-open",
            labels=labels,
        )
        inflight = GaugeMetricFamily(
            "switchyard_balancer_worker_inflight", "in-flight requests, all routers", labels=labels
        )
        score = GaugeMetricFamily(
            "switchyard_balancer_worker_load_score", "combined load score", labels=labels
        )
        rank_labels = ["worker", "rank"]
        rank_inflight = GaugeMetricFamily(
            "switchyard_balancer_rank_inflight", "in-flight requests per rank", labels=rank_labels
        )
        rank_tokens = GaugeMetricFamily(
            "switchyard_balancer_rank_tokens",
            "in-flight prefill plus decode context tokens per DP rank",
            labels=rank_labels,
        )
        now = time.monotonic()
        for w in self.fleet.workers():
            lv = [w.id, str(w.role)]
            healthy.add_metric(lv, float(w.healthy))
            routable.add_metric(lv, float(w.routable(now)))
            circuit.add_metric(lv, {"closed": 0.0, "open": 1.0}.get(w.circuit, 0.5))
            inflight.add_metric(lv, float(w.inflight))
            score.add_metric(lv, w.load().score)
            for r in w.rank_loads():
                rank_inflight.add_metric([w.id, str(r.rank)], float(r.inflight))
                rank_tokens.add_metric(
                    [w.id, str(r.rank)], float(r.prefill_tokens + r.decode_tokens)
                )
        yield from (healthy, routable, circuit, inflight, score, rank_inflight, rank_tokens)


def least_loaded(candidates: list[Worker]) -> Worker:
    return min(candidates, key=lambda w: (w.load().score, random.random()))


def create_app(settings: BalancerSettings | None = None, fleet: Fleet | None = None) -> FastAPI:
    settings = settings or (fleet.settings if fleet else BalancerSettings())
    fleet = fleet or Fleet(settings)
    tickets = Tickets(fleet)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(fleet))

    async def sweep() -> None:
        while True:
            await asyncio.sleep(max(1.0, min(settings.ticket_ttl_s / 4, 30.0)))
            tickets.expire()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.log(
            logging.INFO if settings.admin_api_key else logging.WARNING,
            startup_line("balancer", settings.admin_api_key, settings.api_key),
        )
        await fleet.start()
        task = asyncio.create_task(sweep())
        try:
            yield
        finally:
            task.cancel()
            await fleet.stop()

    app = FastAPI(title="Switchyard balancer", lifespan=lifespan)
    app.state.fleet = fleet
    app.state.tickets = tickets
    install_error_handlers(app)
    needs_key = [Depends(data_access(settings.api_key, settings.admin_api_key))]
    app.include_router(admin_router(fleet, admin_access(settings.admin_api_key)))

    def known(worker_id: str) -> Worker:
        worker = fleet.get(normalise_url(worker_id))
        if worker is None:
            raise APIError(
                404, f"No worker {worker_id}", param="worker_id", code="worker_not_found"
            )
        return worker

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "workers": len(fleet.workers())}

    @app.get("/v1/workers", dependencies=needs_key)
    async def workers() -> dict[str, Any]:
        peers = fleet.shared.peers if fleet.shared is not None else 0
        return {"workers": fleet.describe(), "peers": peers}

    @app.get("/v1/models", dependencies=needs_key)
    async def models() -> dict[str, Any]:
        data = [{"id": m, "object": "model", "owned_by": "switchyard"} for m in fleet.models()]
        return {"object": "list", "data": data}

    @app.post("/v1/pick", response_model=PickResponse, dependencies=needs_key)
    async def pick(req: PickRequest) -> PickResponse:
        candidates = [
            w for w in fleet.candidates(req.model, req.role) if w.id not in set(req.exclude)
        ]
        if not candidates:
            raise APIError(
                503,
                f"No routable worker for model={req.model} role={req.role}",
                code="no_routable_worker",
            )
        worker = least_loaded(candidates)
        rank = fleet.choose_rank(worker, prompt_tokens=req.prompt_tokens)
        ticket_id = None
        if req.begin:
            ticket = fleet.begin(worker, prompt_tokens=req.prompt_tokens, dp_rank=rank)
            ticket_id = tickets.add(ticket)
        rank_url, headers = fleet.address(worker, rank)
        return PickResponse(
            worker_id=worker.id,
            url=worker.url,
            rank=rank,
            rank_url=rank_url,
            ticket=ticket_id,
            headers=dict(headers),
        )

    @app.post("/v1/tickets", dependencies=needs_key)
    async def open_ticket(req: TicketOpen) -> dict[str, str]:
        worker = known(req.worker_id)
        if req.rank is not None and req.rank >= len(worker.ranks):
            raise APIError(
                400,
                f"Worker {worker.id} has DP ranks 0..{len(worker.ranks) - 1}, not {req.rank}",
                param="rank",
                code="invalid_rank",
            )
        if req.id and req.id in tickets.open:
            raise APIError(409, f"Ticket {req.id} exists", param="id", code="ticket_exists")
        ticket = fleet.begin(worker, prompt_tokens=req.prompt_tokens, dp_rank=req.rank)
        return {"ticket": tickets.add(ticket, req.id)}

    @app.post("/v1/tickets/{ticket_id}/first_token", dependencies=needs_key)
    async def first_token(ticket_id: str) -> dict[str, str]:
        fleet.first_token(tickets.take(ticket_id))
        return {"ticket": ticket_id}

    @app.post("/v1/tickets/{ticket_id}/end", dependencies=needs_key)
    async def end_ticket(ticket_id: str, req: TicketEnd) -> dict[str, str]:
        tickets.end(ticket_id, req.outcome)
        return {"ticket": ticket_id, "outcome": str(req.outcome)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
