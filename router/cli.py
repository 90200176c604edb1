"""``switchyard router``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("router")
    def router_command(
        worker: Annotated[
            list[str] | None,
            typer.Option(
                "--worker",
                "-w",
                help="Worker URL, repeatable; options as 'http://h:p;role=prefill;dp=4'.",
            ),
        ] = None,
        config: Annotated[Path | None, typer.Option(help="YAML config file.")] = None,
        policy: Annotated[
            str | None,
            typer.Option(help="round_robin, random, least_load, power_of_two, consistent_hash."),
        ] = None,
        host: Annotated[str | None, typer.Option(help="Bind address.")] = None,
        port: Annotated[int | None, typer.Option(help="Bind port.")] = None,
        api_key: Annotated[str | None, typer.Option(help="Bearer key clients must send.")] = None,
        admin_api_key: Annotated[str | None, typer.Option(help="Bearer key for /admin.")] = None,
        log_level: Annotated[str | None, typer.Option(help="uvicorn log level.")] = None,
    ) -> None:
        """Run the OpenAI-compatible router in front of a fleet of engines."""
        from router.server import run
        from router.settings import RouterSettings

        settings = RouterSettings.load(
            config,
            workers=worker,
            policy=policy,
            host=host,
            port=port,
            api_key=api_key,
            admin_api_key=admin_api_key,
            log_level=log_level,
        )
        run(settings, config)
