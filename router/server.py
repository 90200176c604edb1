"""Assemble the router from its settings and run it under uvicorn (uvloop + httptools)."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from balancer.fleet import Fleet
from balancer.settings import BalancerSettings
from balancer.worker import WorkerSpec
from router.app import RouterApp
from router.scheduler.policies import build_scheduler
from router.settings import RouterSettings


def build_app(settings: RouterSettings, config_file: str | Path | None = None) -> RouterApp:
    fleet = Fleet(
        BalancerSettings.load(config_file),
        specs=[WorkerSpec.parse(w) for w in settings.workers],
    )
    scheduler = build_scheduler(settings.policy, settings.policy_options)
    return RouterApp(settings, fleet, scheduler)


def run(settings: RouterSettings, config_file: str | Path | None = None) -> None:
    app = build_app(settings, config_file)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level=settings.log_level,
        timeout_keep_alive=30,
        server_header=False,
        date_header=False,
    )
