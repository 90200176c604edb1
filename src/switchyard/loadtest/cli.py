"""``switchyard bench compare``, ``switchyard bench run`` and ``switchyard demo``."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import httpx

from switchyard.core.cliopts import CliError

WORKLOADS = "multiturn, shared_prefix, random, mooncake or noisy."


def parse_params(items: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` workload parameters; values read as JSON when they parse (numbers, lists)."""
    import json

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def default_policies() -> str:
    import shutil

    peers = ",smg:cache_aware" if shutil.which("smg") else ""
    return "round_robin,least_load,cache_aware,kv_aware" + peers


def require_demo_extra(*modules: str) -> None:
    """Fail in one line, before any work, when a report library of ``[demo]`` is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(
            f"needs {' and '.join(missing)}, not installed: pip install 'switchyard[demo]'"
        )


REPORTS = ("rich", "matplotlib")


@click.group(
    "bench",
    no_args_is_help=True,
    short_help="Load tests against mock fleets.",
)
def bench_group() -> None:
    """Load tests against mock fleets, running fleets or any OpenAI endpoint."""


@bench_group.command("compare")
@click.option("--engines", default=4, show_default=True, help="Mock engines in the fleet.")
@click.option("--workload", default="multiturn", show_default=True, help=WORKLOADS)
@click.option(
    "--policies",
    help="Comma list: POLICY, smg:POLICY, or fallbacks A|B (first that starts). "
    "Default: round_robin,least_load,cache_aware,kv_aware (+ smg:cache_aware "
    "when smg is installed).",
)
@click.option("--rate", type=float, help="Arrivals per second (generated workloads).")
@click.option("--duration", type=float, help="Seconds of arrivals (generated).")
@click.option("--max-tokens", type=int, help="Output tokens (generated).")
@click.option(
    "--param",
    multiple=True,
    help="Workload parameter KEY=VALUE, repeatable (e.g. speedup=20, limit=500).",
)
@click.option(
    "--num-gpu-blocks",
    default=2000,
    show_default=True,
    help="KV blocks per engine (16 tokens each).",
)
@click.option("--speed", default=10.0, show_default=True, help="Mock time compression.")
@click.option("--seed", default=0, show_default=True, help="Workload and engine seed.")
@click.option("--repeats", default=3, show_default=True, help="Runs per policy, alternating order.")
@click.option(
    "--slo-ttft-ms", default=500.0, show_default=True, help="Goodput TTFT objective, wall ms."
)
@click.option(
    "--slo-tpot-ms", default=50.0, show_default=True, help="Goodput TPOT objective, wall ms."
)
@click.option(
    "--fleet-processes",
    default=1,
    show_default=True,
    help="Processes the fleet is spread over.",
)
@click.option(
    "--mock-config",
    type=click.Path(path_type=Path),
    help="YAML 'mock' section for every engine (timing, limits).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Directory for compare.json and the PNG plots.",
)
@click.option(
    "--progress/--no-progress", default=True, show_default=True, help="Show progress bars."
)
@click.option(
    "--worker",
    multiple=True,
    help="A running engine (vLLM, SGLang or mock) to compare on instead of a mock "
    "fleet, repeatable; the routers find its KV events themselves.",
)
@click.option("--model", help="Model to ask for (default: the first worker's /v1/models).")
def compare_command(
    engines: int,
    workload: str,
    policies: str | None,
    rate: float | None,
    duration: float | None,
    max_tokens: int | None,
    param: tuple[str, ...],
    num_gpu_blocks: int,
    speed: float,
    seed: int,
    repeats: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    fleet_processes: int,
    mock_config: Path | None,
    out: Path,
    progress: bool,
    worker: tuple[str, ...],
    model: str | None,
) -> None:
    """Replay one seeded workload through each router config on the same fleet (mock, or
    the running engines given by --worker)."""
    require_demo_extra(*REPORTS)
    from switchyard.loadtest.compare import CompareConfig, compare
    from switchyard.loadtest.report import wide_console, write_reports

    params = parse_params(param)
    for key, value in (("rate", rate), ("duration_s", duration), ("max_tokens", max_tokens)):
        if value is not None:
            params[key] = value
    cfg = CompareConfig(
        engines=engines,
        workload=workload,
        policies=[p.strip() for p in (policies or default_policies()).split(",") if p.strip()],
        workload_params=params,
        num_gpu_blocks=num_gpu_blocks,
        speed=speed,
        seed=seed,
        repeats=repeats,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        fleet_processes=fleet_processes,
        mock_config=mock_config,
        out=out,
        progress=progress,
        workers=list(worker),
        model=model,
    )
    console = wide_console()
    try:
        outcome = compare(cfg, console)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    for path in write_reports(outcome, console):
        console.print(f"wrote {path}")


@bench_group.command("run")
@click.option("--target", required=True, help="Base URL of any OpenAI endpoint (without /v1).")
@click.option("--workload", default="multiturn", show_default=True, help=WORKLOADS)
@click.option(
    "--param",
    multiple=True,
    help="Workload parameter KEY=VALUE, repeatable (mooncake: trace=FILE).",
)
@click.option("--model", help="Model to ask for (default: the target's /v1/models).")
@click.option("--seed", default=0, show_default=True, help="Workload seed.")
@click.option(
    "--repeats", default=1, show_default=True, help="Runs (nothing is reset between them)."
)
@click.option(
    "--slo-ttft-ms", default=500.0, show_default=True, help="Goodput TTFT objective, wall ms."
)
@click.option(
    "--slo-tpot-ms", default=50.0, show_default=True, help="Goodput TPOT objective, wall ms."
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Directory for compare.json and the PNG plots.",
)
def run_command(
    target: str,
    workload: str,
    param: tuple[str, ...],
    model: str | None,
    seed: int,
    repeats: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    out: Path,
) -> None:
    """Replay one seeded workload against any OpenAI endpoint; prints the compare table."""
    require_demo_extra(*REPORTS)
    from switchyard.loadtest.compare import CompareConfig, run_target
    from switchyard.loadtest.report import wide_console, write_reports

    cfg = CompareConfig(
        engines=0,
        workload=workload,
        policies=["target"],
        workload_params=parse_params(param),
        num_gpu_blocks=None,
        seed=seed,
        repeats=repeats,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        out=out,
        progress=False,
        model=model,
    )
    console = wide_console()
    try:
        outcome = run_target(cfg, target, console)
    except (ValueError, httpx.HTTPError) as exc:
        raise click.BadParameter(str(exc)) from exc
    for path in write_reports(outcome, console):
        console.print(f"wrote {path}")


@click.command(
    "demo",
    short_help="A local stack (router + mock engines) and a short routing comparison.",
)
@click.option("--engines", default=6, show_default=True, help="Mock engines (4-8).")
@click.option("--repeats", default=2, show_default=True, help="Runs per policy.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("switchyard-demo"),
    show_default=True,
    help="Where the table, JSON and plots go.",
)
@click.option(
    "--serve/--no-serve",
    default=False,
    show_default=True,
    help="Afterwards keep the stack up (router + engines) until Ctrl-C.",
)
@click.option(
    "--port",
    default=8000,
    show_default=True,
    help="With --serve: the router's port (0 picks a free one).",
)
def demo_command(engines: int, repeats: int, out: Path, serve: bool, port: int) -> None:
    """A local stack (router + mock engines) and a short routing comparison you can read."""
    require_demo_extra(*REPORTS)
    from switchyard.loadtest.demo import run_demo

    run_demo(engines=engines, repeats=repeats, out=out, serve=serve, port=port)
