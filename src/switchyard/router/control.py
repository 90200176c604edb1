"""The router's control plane: health, readiness, models, metrics and the admin API (FastAPI)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from switchyard.balancer.admin import admin_router
from switchyard.balancer.worker import Role
from switchyard.core.auth import RequireKey, admin_access, data_access, startup_line
from switchyard.core.errors import install_error_handlers
from switchyard.core.version import version
from switchyard.router.flow.control import thresholds_of
from switchyard.router.flow.saturation import saturated
from switchyard.router.metrics import METRICS_DIR_ENV, flush_metric_files
from switchyard.router.settings import RouterSettings

if TYPE_CHECKING:
    from switchyard.router.app import RouterApp

log = logging.getLogger("switchyard.router")


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
            prompt = _total(kv.prompt)
            yield GaugeMetricFamily(
                "switchyard_router_fleet_hit_rate",
                "Cached / prompt tokens the engines reported, over answered requests.",
                value=_total(kv.actual) / prompt if prompt else 0.0,
            )


class _CapacityCollector(Collector):
    """Scaling signals per model and role, read at scrape time: how many workers could take
    a request now (flow control's saturation test, whether or not flow control is on), and
    what waits in the router's queue. An autoscaler reads these rather than latencies,
    which only move once engines are already queueing."""

    def __init__(self, router: RouterApp) -> None:
        self.router = router
        self.thresholds = thresholds_of(router.settings.flow)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model", "role"]
        routable = GaugeMetricFamily(
            "switchyard_router_routable_workers",
            "Workers (or prefill/decode workers of a complete pair) that take new requests "
            "now, as /ready counts them: 0 means every request is refused.",
            value=float(_routable(self.router)),
        )
        workers = GaugeMetricFamily(
            "switchyard_router_model_workers",
            "Workers the router knows that serve the model, in any state.",
            labels=labels,
        )
        free = GaugeMetricFamily(
            "switchyard_router_model_free_workers",
            "Workers of the model that take a request now without it waiting: routable and "
            "not saturated (spare capacity).",
            labels=labels,
        )
        share = GaugeMetricFamily(
            "switchyard_router_model_saturation",
            "Share of the model's workers with no room now (saturated, unhealthy or "
            "draining), 0..1.",
            labels=labels,
        )
        fleet = self.router.fleet
        flow = self.router.flow
        thresholds = flow.thresholds if flow is not None else self.thresholds
        now = flow.clock() if flow is not None else time.monotonic()
        counts: dict[tuple[str, str], list[int]] = {}
        routable_ids: dict[tuple[str, str], set[str]] = {}
        for worker in fleet.workers():
            role = worker.role
            for model in worker.models:
                key = (model, str(role))
                ids = routable_ids.get(key)
                if ids is None:
                    ids = routable_ids[key] = {w.id for w in fleet.candidates(model, role)}
                known_free = counts.setdefault(key, [0, 0])
                known_free[0] += 1
                if worker.id in ids and not saturated(worker, thresholds, now):
                    known_free[1] += 1
        for (model, pool), (known, spare) in sorted(counts.items()):
            workers.add_metric([model, pool], known)
            free.add_metric([model, pool], spare)
            share.add_metric([model, pool], 1.0 - spare / known)
        yield routable
        yield workers
        yield free
        yield share
        if flow is None:
            return
        queued = GaugeMetricFamily(
            "switchyard_router_model_queued",
            "Requests waiting in the router's queue for the model.",
            labels=["model"],
        )
        oldest = GaugeMetricFamily(
            "switchyard_router_model_queue_oldest_seconds",
            "How long the model's longest-waiting queued request has waited (0: none waits).",
            labels=["model"],
        )
        waiting = flow.queue.by_model()
        for model in sorted(set(fleet.models()) | set(waiting)):
            count, since = waiting.get(model, (0, now))
            queued.add_metric([model], count)
            oldest.add_metric([model], max(0.0, now - since))
        yield queued
        yield oldest


def _routable(router: RouterApp) -> int:
    """Routable workers as /ready counts them: a P/D router serves through a complete pair."""
    fleet = router.fleet
    prefill, decode = fleet.candidates(None, Role.PREFILL), fleet.candidates(None, Role.DECODE)
    routable = len(fleet.candidates(None))
    if prefill and decode:
        routable += len(prefill) + len(decode)
    return routable


def _total(counter: Counter) -> float:
    """A counter's value, read through its public ``collect()``."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                return sample.value
    return 0.0


def observability_access(settings: RouterSettings) -> RequireKey:
    """Who may read /metrics (it lists the worker URLs), /docs and /openapi.json.

    ``metrics_auth``: ``none`` (open), ``api_key`` (a data key or the admin key; open while
    no data key is set), ``admin_key`` (the admin key; refused while none is set), or
    ``auto``: ``admin_key`` once an admin key is set, else ``none``.
    """
    rule = settings.metrics_auth
    if rule == "auto":
        rule = "admin_key" if settings.admin_api_key else "none"
    if rule == "admin_key":
        return admin_access(settings.admin_api_key)
    if rule == "api_key":
        return data_access(settings.api_key, settings.admin_api_key)
    return data_access(None)


def build_control_app(router: RouterApp) -> FastAPI:
    app = FastAPI(
        title="Switchyard router",
        description="OpenAI-compatible router: control plane (the inference routes are "
        "POST /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/messages, "
        "/v1/responses, /v1/rerank, /v1/score, /tokenize and /detokenize).",
        version=version(),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    observers = [Depends(observability_access(router.settings))]

    @app.get("/openapi.json", include_in_schema=False, dependencies=observers)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=observers)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False, dependencies=observers)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    router.metrics.register_live(_FleetCollector(router))
    router.metrics.register_live(_CapacityCollector(router))

    install_error_handlers(app)
    settings = router.settings
    log.log(
        logging.INFO if settings.admin_api_key else logging.WARNING,
        startup_line("router", settings.admin_api_key, settings.api_key),
    )

    running = version()

    @app.get("/health", summary="The router process is alive, and which version it runs")
    async def health() -> dict[str, str]:
        return {"status": "ok", "version": running}

    @app.get("/ready", summary="At least one worker, or a prefill/decode pair, is routable")
    async def ready() -> JSONResponse:
        routable = _routable(router)
        if router.draining:
            return JSONResponse(
                status_code=503,
                content={"status": "shutting_down", "routable_workers": routable},
                headers={"retry-after": str(router.settings.retry.after_s)},
            )
        if routable == 0:
            return JSONResponse(
                status_code=503,
                content={"status": "unavailable", "routable_workers": 0},
                headers={"retry-after": str(router.settings.retry.after_s)},
            )
        return JSONResponse({"status": "ready", "routable_workers": routable})

    @app.get("/metrics", summary="Prometheus metrics", dependencies=observers)
    async def metrics() -> Response:
        registry = router.metrics.registry
        for sync in router.metrics.before_scrape:
            sync()
        if METRICS_DIR_ENV in os.environ:
            # One of several processes, each writing its samples to files: sum them all,
            # whichever answers. The live gauges are the answering process's own view.
            flush_metric_files()
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # unannotated upstream
            for collector in router.metrics.live:
                registry.register(collector)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(
        "/v1/models", dependencies=[Depends(router.api_key)], summary="Union of the workers' models"
    )
    async def models() -> dict[str, Any]:
        served = set(router.fleet.models())
        aliases = router.settings.aliases
        # A served name that is also an alias answers as the alias: listed once, as that.
        cards: list[dict[str, Any]] = [
            {"id": m, "object": "model", "created": 0, "owned_by": "switchyard"}
            for m in sorted(served - aliases.keys())
        ]
        # An alias is listed while its served model is: ``root`` and ``parent`` name that.
        for public, target in sorted(aliases.items()):
            if target in served:
                cards.append(
                    {
                        "id": public,
                        "object": "model",
                        "created": 0,
                        "owned_by": "switchyard",
                        "root": target,
                        "parent": target,
                    }
                )
        return {"object": "list", "data": cards}

    app.include_router(
        admin_router(router.fleet, admin_access(settings.admin_api_key), router.adapters)
    )

    return app
