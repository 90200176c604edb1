"""``switchyard bench compare``, ``switchyard bench run`` and ``switchyard demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

Opt = typer.Option


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` workload parameters; values read as JSON when they parse (numbers, lists)."""
    import json

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def default_policies() -> str:
    import shutil

    peers = ",smg:cache_aware" if shutil.which("smg") else ""
    return "round_robin,least_load,cache_aware,kv_aware" + peers


def register(app: typer.Typer) -> None:
    bench = typer.Typer(
        help="Load tests against mock fleets, running fleets or any OpenAI endpoint.",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
    app.add_typer(bench, name="bench")

    @bench.command("compare")
    def compare_command(
        engines: Annotated[int, Opt(help="Mock engines in the fleet.")] = 4,
        workload: Annotated[
            str, Opt(help="multiturn, shared_prefix, random or mooncake.")
        ] = "multiturn",
        policies: Annotated[
            str | None,
            Opt(
                help="Comma list: POLICY, smg:POLICY, or fallbacks A|B (first that starts). "
                "Default: round_robin,least_load,cache_aware,kv_aware (+ smg:cache_aware "
                "when smg is installed)."
            ),
        ] = None,
        rate: Annotated[
            float | None, Opt(help="Arrivals per second (generated workloads).")
        ] = None,
        duration: Annotated[float | None, Opt(help="Seconds of arrivals (generated).")] = None,
        max_tokens: Annotated[int | None, Opt(help="Output tokens (generated).")] = None,
        param: Annotated[
            list[str] | None,
            Opt(help="Workload parameter KEY=VALUE, repeatable (e.g. speedup=20, limit=500)."),
        ] = None,
        num_gpu_blocks: Annotated[int, Opt(help="KV blocks per engine (16 tokens each).")] = 2000,
        speed: Annotated[float, Opt(help="Mock time compression.")] = 10.0,
        seed: Annotated[int, Opt(help="Workload and engine seed.")] = 0,
        repeats: Annotated[int, Opt(help="Runs per policy, alternating order.")] = 3,
        slo_ttft_ms: Annotated[float, Opt(help="Goodput TTFT objective, wall ms.")] = 500.0,
        slo_tpot_ms: Annotated[float, Opt(help="Goodput TPOT objective, wall ms.")] = 50.0,
        fleet_processes: Annotated[int, Opt(help="Processes the fleet is spread over.")] = 1,
        mock_config: Annotated[
            Path | None, Opt(help="YAML 'mock' section for every engine (timing, limits).")
        ] = None,
        out: Annotated[Path, Opt(help="Directory for compare.json and the PNG plots.")] = Path(
            "bench-results"
        ),
        progress: Annotated[bool, Opt(help="Show progress bars.")] = True,
        worker: Annotated[
            list[str] | None,
            Opt(
                help="A running engine (vLLM, SGLang or mock) to compare on instead of a mock "
                "fleet, repeatable; the routers find its KV events themselves."
            ),
        ] = None,
        model: Annotated[
            str | None, Opt(help="Model to ask for (default: the first worker's /v1/models).")
        ] = None,
    ) -> None:
        """Replay one seeded workload through each router config on the same fleet (mock, or
        the running engines given by --worker)."""
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
            workers=list(worker or []),
            model=model,
        )
        console = wide_console()
        try:
            outcome = compare(cfg, console)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        for path in write_reports(outcome, console):
            console.print(f"wrote {path}")

    @bench.command("run")
    def run_command(
        target: Annotated[str, Opt(help="Base URL of any OpenAI endpoint (without /v1).")],
        workload: Annotated[
            str, Opt(help="multiturn, shared_prefix, random or mooncake.")
        ] = "multiturn",
        param: Annotated[
            list[str] | None,
            Opt(help="Workload parameter KEY=VALUE, repeatable (mooncake: trace=FILE)."),
        ] = None,
        model: Annotated[
            str | None, Opt(help="Model to ask for (default: the target's /v1/models).")
        ] = None,
        seed: Annotated[int, Opt(help="Workload seed.")] = 0,
        repeats: Annotated[int, Opt(help="Runs (nothing is reset between them).")] = 1,
        slo_ttft_ms: Annotated[float, Opt(help="Goodput TTFT objective, wall ms.")] = 500.0,
        slo_tpot_ms: Annotated[float, Opt(help="Goodput TPOT objective, wall ms.")] = 50.0,
        out: Annotated[Path, Opt(help="Directory for compare.json and the PNG plots.")] = Path(
            "bench-results"
        ),
    ) -> None:
        """Replay one seeded workload against any OpenAI endpoint; prints the compare table."""
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
            raise typer.BadParameter(str(exc)) from exc
        for path in write_reports(outcome, console):
            console.print(f"wrote {path}")

    @app.command("demo")
    def demo_command(
        engines: Annotated[int, Opt(help="Mock engines (4-8).")] = 6,
        repeats: Annotated[int, Opt(help="Runs per policy.")] = 2,
        out: Annotated[Path, Opt(help="Where the table, JSON and plots go.")] = Path(
            "switchyard-demo"
        ),
        serve: Annotated[
            bool, Opt(help="Afterwards keep the stack up (router + engines) until Ctrl-C.")
        ] = False,
        port: Annotated[
            int, Opt(help="With --serve: the router's port (0 picks a free one).")
        ] = 8000,
    ) -> None:
        """A local stack (router + mock engines) and a short routing comparison you can read."""
        from switchyard.loadtest.demo import run_demo

        run_demo(engines=engines, repeats=repeats, out=out, serve=serve, port=port)
