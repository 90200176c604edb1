"""``switchyard mock`` (one engine, flags from :class:`MockSettings`) and ``mock-fleet``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from switchyard.core.cliopts import require_tokenizer, settings_command
from switchyard.mock.settings import MockSettings


def command() -> click.Command:
    return settings_command(
        "mock",
        MockSettings,
        _run,
        help="Run one simulated vLLM/SGLang engine (DP ranks, P/D role, faults) on loopback.",
    )


def _run(settings: MockSettings, config: Path | None) -> None:
    import orjson

    from switchyard.mock.serve import build, run_blocking

    require_tokenizer(settings.tokenizer, "--tokenizer")
    deployment = build(settings)
    run_blocking([deployment], lambda: click.echo(orjson.dumps(deployment.describe()).decode()))


@click.command(
    "mock-fleet",
    short_help="Run many mock engines (one process or K), print a JSON description.",
)
@click.option("--count", default=2, show_default=True, help="Number of engines.")
@click.option("--base-port", default=8100, show_default=True, help="First HTTP port.")
@click.option(
    "--processes",
    type=int,
    help="Spread the engines over K processes (default: one per 500 engines).",
)
@click.option("--prefill", default=0, show_default=True, help="How many engines are prefill role.")
@click.option("--decode", default=0, show_default=True, help="How many engines are decode role.")
@click.option("--kv-events-base-port", type=int, help="First ZMQ PUB port.")
@click.option(
    "--config", type=click.Path(path_type=Path), help="YAML: 'mock' section for every engine."
)
@click.option("--flavor", help="vllm or sglang.")
@click.option("--model", help="Served model name.")
@click.option("--dp-size", type=int, help="DP ranks per engine.")
@click.option("--dp-external/--no-dp-external", default=None, help="One port per DP rank.")
@click.option("--num-gpu-blocks", type=int, help="KV blocks per rank.")
@click.option("--speed", type=float, help="Time compression factor.")
@click.option("--seed", type=int, help="Random seed (engine i gets seed+i).")
@click.option("--kv-events-encoding", help="array or map.")
@click.option("--spec-stdin", is_flag=True, hidden=True)
def fleet_command(
    count: int,
    base_port: int,
    processes: int | None,
    prefill: int,
    decode: int,
    kv_events_base_port: int | None,
    config: Path | None,
    spec_stdin: bool,
    **flags: object,
) -> None:
    """Run many mock engines (one process or K), print a JSON description, serve forever."""
    from switchyard.mock.fleet import plan_fleet, run_fleet, run_specs

    if spec_stdin:
        run_specs(sys.stdin.read())
        return
    specs = plan_fleet(config, flags, count, base_port, prefill, decode, kv_events_base_port)
    run_fleet(specs, processes)
