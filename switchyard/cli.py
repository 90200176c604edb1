"""The one ``switchyard`` command; each package adds its own subcommands."""

from __future__ import annotations

import typer

from balancer.cli import register as register_balancer
from kvstore.cli import register as register_kvstore
from loadtest.cli import register as register_loadtest
from mockengine.cli import register as register_mock
from router.cli import register as register_router

app = typer.Typer(
    help="Switchyard: router, DP balancer, KV metadata store and mock engines for LLM fleets.",
    no_args_is_help=True,
    add_completion=False,
)
register_router(app)
register_mock(app)
register_balancer(app)
register_kvstore(app)
register_loadtest(app)


@app.callback()
def root() -> None:
    """Switchyard: router, DP balancer, KV metadata store and mock engines for LLM fleets."""


def main() -> None:
    app()
