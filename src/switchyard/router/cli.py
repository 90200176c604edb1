"""``switchyard router``: flags generated from :class:`RouterSettings`."""

from __future__ import annotations

from pathlib import Path

import click

from switchyard.core.cliopts import CliError, require_tokenizer, settings_command
from switchyard.router.settings import RouterSettings

# The short spellings the README and deploy/ use, and engines' own where they have one.
ALIASES = {
    "workers": ["--worker", "-w"],
    "model_aliases": ["--model-alias"],
    "model_policies": ["--model-policy"],
    "redis_url": ["--redis", "--redis-url"],
    "pd.prefill": ["--prefill"],
    "pd.decode": ["--decode"],
    "pd.encode": ["--encode"],
    "tracing.otlp_traces_endpoint": ["--otlp-traces-endpoint"],  # vLLM's spelling
}


def command() -> click.Command:
    return settings_command(
        "router",
        RouterSettings,
        _run,
        help="Run the OpenAI-compatible router in front of a fleet of engines.",
        aliases=ALIASES,
    )


def _run(settings: RouterSettings, config: Path | None) -> None:
    from switchyard.router.server import preflight, run

    require_tokenizer(settings.tokenizer, "--tokenizer")
    try:
        preflight(settings, config)
    except ValueError as exc:
        raise CliError(" ".join(str(exc).split())) from None
    run(settings, config)
