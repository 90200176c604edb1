"""The router's control plane: health, readiness, models, metrics and the admin API (FastAPI)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from balancer.worker import Role, WorkerSpec
from router.errors import RouterError, error_body

if TYPE_CHECKING:
    from router.app import RouterApp


class WorkerIn(BaseModel):
    """A worker to add; ``url`` may carry options in WorkerSpec syntax (``;role=prefill``)."""

    url: str
    models: list[str] = Field(default_factory=list)
    role: Role = Role.UNIFIED
    flavor: str | None = None
    dp_size: int = 1
    dp_mode: str = "header"
    kv_events: str | None = None
    bootstrap_port: int | None = None


class _FleetCollector(Collector):
    """In-flight per worker, read from the fleet at scrape time (nothing on the hot path)."""

    def __init__(self, router: RouterApp) -> None:
        self.router = router

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "switchyard_router_inflight_requests",
            "Requests in flight per worker, as the router counts them.",
            labels=["worker"],
        )
        healthy = GaugeMetricFamily(
            "switchyard_router_worker_routable",
            "1 if the worker takes new requests now (healthy, circuit closed, not draining).",
            labels=["worker"],
        )
        estimating = GaugeMetricFamily(
            "switchyard_router_kv_estimating",
            "1 where the router estimates a worker's cache from its own placements "
            "(approximate mode: the engine publishes no KV events).",
            labels=["worker"],
        )
        kv = self.router.kv
        routable = {w.id for w in self.router.fleet.candidates(None)}
        for worker in self.router.fleet.workers():
            inflight.add_metric([worker.id], worker.inflight)
            healthy.add_metric([worker.id], 1.0 if worker.id in routable else 0.0)
            if kv is not None:
                estimating.add_metric([worker.id], 1.0 if kv.estimating(worker) else 0.0)
        yield inflight
        yield healthy
        yield estimating
        if kv is not None:
            prompt = kv.prompt._value.get()
            yield GaugeMetricFamily(
                "switchyard_router_fleet_hit_rate",
                "Cached / prompt tokens the engines reported, over answered requests.",
                value=kv.actual._value.get() / prompt if prompt else 0.0,
            )


def _error(status: int, message: str, param: str | None = None) -> Response:
    return Response(
        error_body(status, message, param=param), status_code=status, media_type="application/json"
    )


def build_control_app(router: RouterApp) -> FastAPI:
    app = FastAPI(
        title="Switchyard router",
        description="OpenAI-compatible router: control plane (the inference routes are "
        "POST /v1/completions, /v1/chat/completions and /v1/embeddings).",
        version="0.1.0",
    )
    fleet_collector = _FleetCollector(router)
    router.metrics.registry.register(fleet_collector)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"Invalid request: {first.get('msg', exc)}", param=param)

    @app.exception_handler(RouterError)
    async def router_error(_: Request, exc: RouterError) -> Response:
        return Response(
            exc.body(), status_code=exc.status, media_type="application/json", headers=exc.headers
        )

    def api_key(authorization: str | None = Header(default=None)) -> None:
        expected = router.settings.api_key
        if expected and authorization != f"Bearer {expected}":
            raise RouterError(401, "Invalid or missing API key", code="invalid_api_key")

    def admin_key(authorization: str | None = Header(default=None)) -> None:
        expected = router.settings.admin_api_key
        if expected and authorization != f"Bearer {expected}":
            raise RouterError(401, "Invalid or missing admin API key", code="invalid_api_key")

    def one_registry() -> None:
        """Several processes without Redis each keep their own registry: a change made
        through one of them would not reach the others."""
        settings = router.settings
        if settings.processes > 1 and settings.redis is None:
            raise RouterError(
                409,
                f"This router runs {settings.processes} processes without --redis: admin "
                "changes would reach only one of them. Start it with --redis, or change "
                "the workers in its config and restart.",
                code="admin_needs_redis",
            )

    @app.get("/health", summary="The router process is alive")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="At least one worker is routable")
    async def ready() -> JSONResponse:
        routable = len(router.fleet.candidates(None))
        if routable == 0:
            return JSONResponse(
                status_code=503,
                content={"status": "unavailable", "routable_workers": 0},
                headers={"retry-after": str(router.settings.retry_after_s)},
            )
        return JSONResponse({"status": "ready", "routable_workers": routable})

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        registry = router.metrics.registry
        if router.settings.processes > 1:
            # Every process writes its samples to files: sum them all, whichever answers.
            # The fleet gauges are the answering process's own view.
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            registry.register(fleet_collector)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(api_key)], summary="Union of the workers' models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "switchyard"}
                for m in sorted(router.fleet.models())
            ],
        }

    @app.get("/admin/workers", dependencies=[Depends(admin_key)], summary="Workers and state")
    async def list_workers() -> dict[str, Any]:
        return {"workers": [w.describe() for w in router.fleet.workers()]}

    changes = [Depends(admin_key), Depends(one_registry)]

    @app.post("/admin/workers", dependencies=changes, status_code=201)
    async def add_worker(worker: WorkerIn) -> dict[str, Any]:
        try:
            spec = (
                WorkerSpec.parse(worker.url)
                if ";" in worker.url
                else WorkerSpec(
                    url=worker.url,
                    models=worker.models,
                    role=worker.role,
                    flavor=worker.flavor,
                    dp_size=worker.dp_size,
                    dp_mode=worker.dp_mode,
                    kv_events=worker.kv_events,
                    bootstrap_port=worker.bootstrap_port,
                )
            )
        except ValueError as exc:
            raise RouterError(400, str(exc), param="url") from None
        added = router.fleet.add(spec, source="admin")
        return added.describe()

    @app.delete("/admin/workers", dependencies=changes)
    async def remove_worker(url: str = Query(..., description="the worker's URL (its id)")) -> dict:
        if not router.fleet.remove(WorkerSpec(url=url).url):
            raise RouterError(404, f"No worker {url}", param="url", code="worker_not_found")
        return {"removed": WorkerSpec(url=url).url}

    @app.post("/admin/workers/drain", dependencies=changes)
    async def drain_worker(url: str = Query(...)) -> dict[str, str]:
        if not router.fleet.drain(WorkerSpec(url=url).url):
            raise RouterError(404, f"No worker {url}", param="url", code="worker_not_found")
        return {"draining": WorkerSpec(url=url).url}

    return app
