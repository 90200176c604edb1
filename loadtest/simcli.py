"""``switchyard simulate``: the command line of ``loadtest.simulate``."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from loadtest.cli import parse_params

Opt = typer.Option


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_command(
        engines: Annotated[int, Opt(help="Simulated engines (router workers).")] = 8,
        dp: Annotated[int, Opt(help="DP ranks per engine (the router picks the rank).")] = 1,
        workload: Annotated[
            str, Opt(help="multiturn, shared_prefix, random or mooncake.")
        ] = "multiturn",
        trace: Annotated[
            Path | None, Opt(help="Mooncake-format trace (JSONL) for --workload mooncake.")
        ] = None,
        policy: Annotated[
            str, Opt(help="Comma list of router policies, each run on a fresh fleet.")
        ] = "kv_aware,round_robin",
        rate: Annotated[
            float | None, Opt(help="Arrivals per second (generated workloads).")
        ] = None,
        duration: Annotated[float | None, Opt(help="Seconds of arrivals (generated).")] = None,
        max_tokens: Annotated[int | None, Opt(help="Output tokens (generated).")] = None,
        param: Annotated[
            list[str] | None,
            Opt(
                help="Workload parameter KEY=VALUE, repeatable; mooncake: speedup (rate × N), "
                "block_tokens (tokens per trace block, 512 = the trace's own), limit, start, "
                "max_output_tokens."
            ),
        ] = None,
        num_gpu_blocks: Annotated[int, Opt(help="KV blocks per engine (16 tokens each).")] = 2000,
        speed: Annotated[
            float, Opt(help="Workload seconds are wall seconds of a mock at this speed.")
        ] = 1.0,
        seed: Annotated[int, Opt(help="Workload, engine and policy seed.")] = 0,
        slo_ttft_ms: Annotated[float, Opt(help="Goodput TTFT objective, ms.")] = 500.0,
        slo_tpot_ms: Annotated[float, Opt(help="Goodput TPOT objective, ms.")] = 50.0,
        mock_config: Annotated[
            Path | None, Opt(help="YAML 'mock' section for every engine (timing, limits).")
        ] = None,
        token_times: Annotated[
            bool, Opt(help="Keep every token's time (ITL); off saves memory on big runs.")
        ] = True,
        out: Annotated[
            Path | None, Opt(help="Directory for simulate.json and the PNG plots.")
        ] = None,
        as_json: Annotated[
            bool, Opt("--json", help="End with one JSON line of the headline figures.")
        ] = False,
    ) -> None:
        """Replay a workload through the router's own policies over simulated engines (no HTTP)."""
        from loadtest.report import wide_console
        from loadtest.simreport import print_table, write_reports
        from loadtest.simulate import SimConfig, simulate

        params = parse_params(param)
        for key, value in (("rate", rate), ("duration_s", duration), ("max_tokens", max_tokens)):
            if value is not None:
                params[key] = value
        if trace is not None:
            if workload != "mooncake":
                raise typer.BadParameter("--trace is for --workload mooncake")
            params["trace"] = str(trace)
        cfg = SimConfig(
            engines=engines,
            workload=workload,
            workload_params=params,
            policies=[p.strip() for p in policy.split(",") if p.strip()],
            seed=seed,
            num_gpu_blocks=num_gpu_blocks,
            speed=speed,
            dp_size=dp,
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
            mock_config=mock_config,
            record_token_times=token_times,
        )
        # The router's start-up notes (admin API off, ...) mean nothing without a server.
        logging.getLogger("switchyard.router").setLevel(logging.ERROR)
        console = wide_console()
        try:
            outcome = simulate(cfg)
        except (ValueError, TypeError) as exc:
            raise typer.BadParameter(str(exc)) from exc
        print_table(outcome, console)
        if out is not None:
            for path in write_reports(outcome, out):
                console.print(f"wrote {path}")
        if as_json:
            sys.stdout.flush()
            print(json.dumps(outcome.headline()))
