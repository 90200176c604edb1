"""``switchyard kvstore``: the KV metadata store as its own service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Opt = typer.Option


def register(app: typer.Typer) -> None:
    @app.command("kvstore")
    def kvstore_command(
        config: Annotated[Path | None, Opt(help="YAML config file (section 'kvstore').")] = None,
        host: Annotated[str | None, Opt(help="Bind address.")] = None,
        port: Annotated[int | None, Opt(help="HTTP port.")] = None,
        redis: Annotated[str | None, Opt(help="redis://HOST:PORT/DB; memory if unset.")] = None,
        redis_prefix: Annotated[str | None, Opt(help="Key prefix (namespace) in Redis.")] = None,
        subscribe: Annotated[
            list[str] | None,
            Opt(help="INSTANCE=tcp://HOST:PORT[,replay=tcp://…][,flavor=sglang][,rank=N]."),
        ] = None,
        tokenizer: Annotated[str | None, Opt(help="HF tokenizer dir (chat_template).")] = None,
        tokenize_url: Annotated[str | None, Opt(help="Engine base URL for /tokenize.")] = None,
        block_size: Annotated[int | None, Opt(help="Engine KV block size in tokens.")] = None,
        seed: Annotated[int | None, Opt(help="Block-key hash seed.")] = None,
        capacity_blocks: Annotated[int | None, Opt(help="Memory index LRU bound.")] = None,
        speculative_ttl_s: Annotated[float | None, Opt(help="Placement entry TTL.")] = None,
        lookup_timeout_ms: Annotated[float | None, Opt(help="Degraded after this.")] = None,
        log_level: Annotated[str | None, Opt(help="uvicorn log level.")] = None,
    ) -> None:
        """Run the cross-request KV metadata store (lookups, engine KV events)."""
        import logging

        import uvicorn

        from kvstore.build import store_from_settings
        from kvstore.service import create_app
        from kvstore.settings import KVStoreSettings

        flags = {k: v for k, v in locals().items() if k != "config"}
        settings = KVStoreSettings.load(config, **flags)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        app = create_app(store_from_settings(settings))
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            loop="uvloop",
            http="httptools",
        )
