"""``switchyard mock`` (one engine, flags from :class:`MockSettings`) and ``mock-fleet``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import click
import typer

from switchyard.core.cliopts import require_tokenizer, settings_command
from switchyard.mock.settings import MockSettings

Opt = typer.Option


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


def register(app: typer.Typer) -> None:
    @app.command("mock-fleet")
    def mock_fleet_command(
        count: Annotated[int, Opt(help="Number of engines.")] = 2,
        base_port: Annotated[int, Opt(help="First HTTP port.")] = 8100,
        processes: Annotated[
            int | None,
            Opt(help="Spread the engines over K processes (default: one per 500 engines)."),
        ] = None,
        prefill: Annotated[int, Opt(help="How many engines are prefill role.")] = 0,
        decode: Annotated[int, Opt(help="How many engines are decode role.")] = 0,
        kv_events_base_port: Annotated[int | None, Opt(help="First ZMQ PUB port.")] = None,
        config: Annotated[Path | None, Opt(help="YAML: 'mock' section for every engine.")] = None,
        flavor: Annotated[str | None, Opt(help="vllm or sglang.")] = None,
        model: Annotated[str | None, Opt(help="Served model name.")] = None,
        dp_size: Annotated[int | None, Opt(help="DP ranks per engine.")] = None,
        dp_external: Annotated[bool | None, Opt(help="One port per DP rank.")] = None,
        num_gpu_blocks: Annotated[int | None, Opt(help="KV blocks per rank.")] = None,
        speed: Annotated[float | None, Opt(help="Time compression factor.")] = None,
        seed: Annotated[int | None, Opt(help="Random seed (engine i gets seed+i).")] = None,
        kv_events_encoding: Annotated[str | None, Opt(help="array or map.")] = None,
        spec_stdin: Annotated[bool, Opt(hidden=True)] = False,
    ) -> None:
        """Run many mock engines (one process or K), print a JSON description, serve forever."""
        from switchyard.mock.fleet import plan_fleet, run_fleet, run_specs

        if spec_stdin:
            run_specs(sys.stdin.read())
            return
        flags = {
            "flavor": flavor,
            "model": model,
            "dp_size": dp_size,
            "dp_external": dp_external,
            "num_gpu_blocks": num_gpu_blocks,
            "speed": speed,
            "seed": seed,
            "kv_events_encoding": kv_events_encoding,
        }
        specs = plan_fleet(config, flags, count, base_port, prefill, decode, kv_events_base_port)
        run_fleet(specs, processes)
