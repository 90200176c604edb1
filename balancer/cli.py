"""``switchyard balancer``: the fleet as its own service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Opt = typer.Option


def register(app: typer.Typer) -> None:
    @app.command("balancer")
    def balancer_command(
        config: Annotated[Path | None, Opt(help="YAML config file (section 'balancer').")] = None,
        host: Annotated[str | None, Opt(help="Bind address.")] = None,
        port: Annotated[int | None, Opt(help="Bind port.")] = None,
        redis: Annotated[
            str | None, Opt(help="Redis URL: share in-flight counts and admin changes.")
        ] = None,
        worker: Annotated[
            list[str] | None,
            Opt("--worker", "-w", help="Worker, repeatable: 'http://h:p;role=prefill;dp=4'."),
        ] = None,
        workers_file: Annotated[str | None, Opt(help="Watched YAML/JSON list of workers.")] = None,
        kubernetes: Annotated[
            bool | None, Opt(help="Discover engine pods through the Kubernetes API.")
        ] = None,
        kubernetes_host: Annotated[
            str | None, Opt(help="Kubernetes API URL (default: in-cluster or kubeconfig).")
        ] = None,
        kubernetes_namespace: Annotated[str | None, Opt(help="Namespace to watch.")] = None,
        kubernetes_selector: Annotated[str | None, Opt(help="Pod label selector.")] = None,
        admin_key: Annotated[str | None, Opt(help="Key the admin endpoints require.")] = None,
        dp_policy: Annotated[
            str | None, Opt(help="round_robin, least_requests, minimum_tokens, step_balanced.")
        ] = None,
        probe_interval: Annotated[float | None, Opt(help="Seconds between probes.")] = None,
        lease_seconds: Annotated[
            float | None, Opt(help="Lease of this instance's counts in Redis.")
        ] = None,
        sync_interval: Annotated[float | None, Opt(help="Seconds between Redis syncs.")] = None,
        log_level: Annotated[str, Opt(help="uvicorn log level.")] = "warning",
    ) -> None:
        """Run the balancer service: fleet state, picks, admin API, /metrics."""
        import uvicorn

        from balancer.service import create_app
        from balancer.settings import BalancerSettings

        settings = BalancerSettings.load(
            config,
            host=host,
            port=port,
            redis_url=redis,
            workers=worker,
            workers_file=workers_file,
            kubernetes=kubernetes,
            kubernetes_host=kubernetes_host,
            kubernetes_namespace=kubernetes_namespace,
            kubernetes_selector=kubernetes_selector,
            admin_key=admin_key,
            dp_policy=dp_policy,
            probe_interval=probe_interval,
            lease_seconds=lease_seconds,
            sync_interval=sync_interval,
        )
        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=log_level,
            access_log=False,
        )
