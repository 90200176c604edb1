"""``switchyard simulate``: the command line of ``loadtest.simulate``."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from switchyard.loadtest.cli import parse_params

if TYPE_CHECKING:
    from rich.console import Console

    from switchyard.loadtest.simplan import Objective, Plan
    from switchyard.loadtest.simulate import SimConfig

Opt = typer.Option


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_command(
        engines: Annotated[int, Opt(help="Simulated engines (router workers).")] = 8,
        dp: Annotated[int, Opt(help="DP ranks per engine (the router picks the rank).")] = 1,
        prefill_engines: Annotated[
            int, Opt(help="P/D: this many of the engines prefill, the rest decode (0: unified).")
        ] = 0,
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
        from switchyard.loadtest.report import wide_console
        from switchyard.loadtest.simreport import print_table, write_reports
        from switchyard.loadtest.simulate import SimConfig, simulate

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
            prefill_engines=prefill_engines,
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


def register_plan(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        rate: Annotated[float, Opt(help="Arrivals per second to plan for.")],
        slo_ttft_ms: Annotated[float, Opt(help="Objective: TTFT p90, ms.")] = 500.0,
        slo_tpot_ms: Annotated[float, Opt(help="Objective: TPOT p90, ms.")] = 50.0,
        workload: Annotated[str, Opt(help="multiturn, shared_prefix or random.")] = "multiturn",
        duration: Annotated[float, Opt(help="Seconds of arrivals per probe.")] = 30.0,
        policy: Annotated[str, Opt(help="Policy the engine count is searched with.")] = "kv_aware",
        compare: Annotated[
            str, Opt(help="Comma list of policies compared at the size found.")
        ] = "kv_aware,round_robin,least_load",
        max_engines: Annotated[int, Opt(help="Largest fleet tried.")] = 256,
        param: Annotated[
            list[str] | None, Opt(help="Workload parameter KEY=VALUE, repeatable.")
        ] = None,
        num_gpu_blocks: Annotated[int, Opt(help="KV blocks per engine (16 tokens each).")] = 2000,
        seed: Annotated[int, Opt(help="Workload, engine and policy seed.")] = 0,
        mock_config: Annotated[
            Path | None, Opt(help="YAML 'mock' section: the engines' timing model and limits.")
        ] = None,
        out: Annotated[Path | None, Opt(help="Directory for plan.png.")] = None,
        pd_engines: Annotated[
            int | None,
            Opt(help="Instead: the best prefill:decode split (xPyD) of this many engines."),
        ] = None,
    ) -> None:
        """The fewest simulated engines that meet a TTFT/TPOT objective at a rate, or the
        best prefill:decode split of a given fleet (--pd-engines)."""
        from rich.table import Table

        from switchyard.loadtest.report import wide_console
        from switchyard.loadtest.simplan import Objective, assumptions, plan
        from switchyard.loadtest.simulate import SimConfig

        if workload == "mooncake":
            raise typer.BadParameter("plan takes generated workloads (rate and duration)")
        params = {**parse_params(param), "rate": rate, "duration_s": duration}
        base = SimConfig(
            workload=workload,
            workload_params=params,
            seed=seed,
            num_gpu_blocks=num_gpu_blocks,
            mock_config=mock_config,
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
            record_token_times=False,
        )
        logging.getLogger("switchyard.router").setLevel(logging.ERROR)
        console = wide_console()
        objective = Objective(slo_ttft_ms, slo_tpot_ms)
        if pd_engines is not None:
            title = (
                f"{workload} at {rate:g} req/s on {pd_engines} engines: objective TTFT p90 ≤ "
                f"{slo_ttft_ms:g} ms, TPOT p90 ≤ {slo_tpot_ms:g} ms"
            )
            print_split(console, base, objective, policy, pd_engines, title)
            return
        try:
            result = plan(
                base,
                objective,
                policy,
                [p.strip() for p in compare.split(",") if p.strip()],
                max_engines,
                on_probe=lambda n, run: console.print(
                    f"  {n} engines: TTFT p90 {run.summary.ttft_ms['p90']:.0f} ms, TPOT p90 "
                    f"{run.summary.tpot_ms['p90'] or 0:.1f} ms"
                ),
            )
        except (ValueError, TypeError) as exc:
            raise typer.BadParameter(str(exc)) from exc
        table = Table(
            title=f"{workload} at {rate:g} req/s: objective TTFT p90 ≤ {slo_ttft_ms:g} ms, "
            f"TPOT p90 ≤ {slo_tpot_ms:g} ms"
        )
        for col in ("engines", "policy", "TTFT p90 ms", "TPOT p90 ms", "hit rate", "met"):
            table.add_column(col, justify="right")
        for n, run in sorted(result.probes.items()):
            s = run.summary
            table.add_row(
                str(n), policy, f"{s.ttft_ms['p90']:.0f}", f"{s.tpot_ms['p90'] or 0:.1f}",
                f"{s.hit_rate:.3f}", "yes" if objective.met(run) else "no",
            )  # fmt: skip
        for run in result.compared[1:]:
            s = run.summary
            table.add_row(
                str(result.engines), run.policy, f"{s.ttft_ms['p90']:.0f}",
                f"{s.tpot_ms['p90'] or 0:.1f}", f"{s.hit_rate:.3f}",
                "yes" if objective.met(run) else "no",
            )  # fmt: skip
        console.print(table)
        if result.engines is None:
            console.print(f"No fleet up to {max_engines} engines meets the objective.")
        else:
            console.print(f"Fewest engines meeting the objective with {policy}: {result.engines}.")
        console.print(f"Assumed: {assumptions(base)}")
        if out is not None:
            console.print(f"wrote {plot_plan(result, out)}")


def print_split(
    console: Console, base: SimConfig, objective: Objective, policy: str, engines: int, title: str
) -> None:
    """The xPyD search's table, its answer and what it assumed."""
    from rich.table import Table

    from switchyard.loadtest.simplan import assumptions, plan_split

    try:
        result = plan_split(
            base,
            objective,
            policy,
            engines,
            on_probe=lambda p, run: console.print(
                f"  {p}P{engines - p}D: TTFT p90 {run.summary.ttft_ms['p90'] or 0:.0f} ms, "
                f"TPOT p90 {run.summary.tpot_ms['p90'] or 0:.1f} ms"
            ),
        )
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    table = Table(title=title)
    for col in ("split", "TTFT p90 ms", "TPOT p90 ms", "hit rate", "goodput req/s", "met"):
        table.add_column(col, justify="right")
    for p, run in sorted(result.runs.items()):
        s = run.summary
        table.add_row(
            f"{p}P{engines - p}D", f"{s.ttft_ms['p90'] or 0:.0f}", f"{s.tpot_ms['p90'] or 0:.1f}",
            f"{s.hit_rate:.3f}", f"{s.goodput_rps:.2f}", "yes" if objective.met(run) else "no",
        )  # fmt: skip
    console.print(table)
    if result.best is None:
        console.print(f"No split of {engines} engines meets the objective with {policy}.")
    else:
        best = result.best
        console.print(
            f"Best split with {policy}: {best}P{engines - best}D "
            f"(the most headroom: {result.headroom(best):.2f} of the objective)."
        )
    console.print(f"Assumed: {assumptions(dataclasses.replace(base, prefill_engines=1))}")


def plot_plan(result: Plan, out: Path) -> Path:
    """TTFT p90 against engine count, with the objective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    sizes = sorted(result.probes)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    p90 = [result.probes[n].summary.ttft_ms["p90"] or 0.0 for n in sizes]
    ax.plot(sizes, p90, "o-", label="TTFT p90")
    ax.axhline(result.objective.ttft_p90_ms, color="black", ls="--", label="objective")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("engines")
    ax.set_ylabel("TTFT p90, ms (simulated)")
    ax.set_title(f"Engines needed, policy {result.policy}")
    ax.legend()
    fig.tight_layout()
    path = out / "plan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
