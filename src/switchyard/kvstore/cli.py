"""``switchyard kvstore``: the KV metadata store as its own service; flags from its settings."""

from __future__ import annotations

from pathlib import Path

import click

from switchyard.core.cliopts import CliError, require_tokenizer, settings_command
from switchyard.kvstore.settings import KVStoreSettings


def command() -> click.Command:
    return settings_command(
        "kvstore",
        KVStoreSettings,
        _run,
        help="Run the cross-request KV metadata store (lookups, engine KV events).",
        aliases={"workers": ["--worker"], "redis_url": ["--redis", "--redis-url"]},
    )


def _run(settings: KVStoreSettings, config: Path | None) -> None:
    import logging

    import uvicorn

    from switchyard.kvstore.build import store_from_settings
    from switchyard.kvstore.service import create_app

    require_tokenizer(settings.tokenizer, "--tokenizer")
    try:
        store = store_from_settings(settings)
    except (ValueError, OSError) as exc:
        raise CliError(" ".join(str(exc).split())) from None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(store, settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        loop="uvloop",
        http="httptools",
    )
