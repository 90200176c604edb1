"""``switchyard balancer``: the fleet as its own service; flags from :class:`BalancerSettings`."""

from __future__ import annotations

from pathlib import Path

import click

from switchyard.balancer.settings import BalancerSettings
from switchyard.core.cliopts import CliError, settings_command


def command() -> click.Command:
    return settings_command(
        "balancer",
        BalancerSettings,
        _run,
        help="Run the balancer service: fleet state, picks, admin API, /metrics.",
        aliases={"workers": ["--worker", "-w"], "redis_url": ["--redis", "--redis-url"]},
    )


def _run(settings: BalancerSettings, config: Path | None) -> None:
    import uvicorn

    from switchyard.balancer.k8s import missing_client
    from switchyard.balancer.service import create_app

    if settings.kubernetes and (missing := missing_client()) is not None:
        raise CliError(missing)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
    )
