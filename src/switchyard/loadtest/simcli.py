"""``switchyard simulate`` and ``switchyard plan``: the command lines of ``loadtest.simulate``
and ``loadtest.simplan``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from switchyard.loadtest.cli import WORKLOADS, parse_params, require_demo_extra

if TYPE_CHECKING:
    from rich.console import Console

    from switchyard.loadtest.simplan import Objective, Plan, SplitPlan
    from switchyard.loadtest.simulate import SimConfig
    from switchyard.router.settings import Flow


def _tables(as_json: bool, out: Path | None) -> Console | None:
    """The console the tables go to, or None for a ``--json`` run without rich: the JSON
    line needs no report library, so only the tables and plots ask for the demo extra."""
    require_demo_extra(*(("matplotlib",) if out is not None else ()))
    if importlib.util.find_spec("rich") is None and as_json:
        return None
    require_demo_extra("rich")
    from switchyard.loadtest.report import wide_console

    return wide_console()


def _say(console: Console | None) -> Callable[[str], None]:
    """Where progress and "wrote" lines go: the console, else stderr, since stdout is the
    JSON line's."""
    if console is not None:
        return console.print
    return lambda line: click.echo(line, err=True)


@contextlib.contextmanager
def _router_notes_quiet() -> Iterator[None]:
    """The router's start-up notes (admin API off, ...) mean nothing without a server; the
    level comes back after, for whatever else runs in this process."""
    logger = logging.getLogger("switchyard.router")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@click.command(
    "simulate",
    short_help="The router's own policies over thousands of simulated engines, no HTTP.",
)
@click.option("--engines", default=8, show_default=True, help="Simulated engines (router workers).")
@click.option(
    "--dp",
    default=1,
    show_default=True,
    help="DP ranks per engine (the router picks the rank).",
)
@click.option(
    "--prefill-engines",
    default=0,
    show_default=True,
    help="P/D: this many of the engines prefill, the rest decode (0: unified).",
)
@click.option("--workload", default="multiturn", show_default=True, help=WORKLOADS)
@click.option(
    "--trace",
    type=click.Path(path_type=Path),
    help="Mooncake-format trace (JSONL) for --workload mooncake.",
)
@click.option(
    "--policy",
    default="kv_aware,round_robin",
    show_default=True,
    help="Comma list of router policies, each run on a fresh fleet.",
)
@click.option("--rate", type=float, help="Arrivals per second (generated workloads).")
@click.option("--duration", type=float, help="Seconds of arrivals (generated).")
@click.option("--max-tokens", type=int, help="Output tokens (generated).")
@click.option(
    "--param",
    multiple=True,
    help="Workload parameter KEY=VALUE, repeatable; mooncake: speedup (rate × N), "
    "block_tokens (tokens per trace block, 512 = the trace's own), limit, start, "
    "max_output_tokens.",
)
@click.option(
    "--num-gpu-blocks",
    type=int,
    help="KV blocks per engine [default: the engine model's 29000 of 16 tokens, an 8B "
    "model on one 80 GB GPU].",
)
@click.option(
    "--max-model-len",
    type=int,
    help="Served context, tokens; longer requests get vLLM's 400 [default: 131072, "
    "capped by one engine's KV cache].",
)
@click.option(
    "--speed",
    default=1.0,
    show_default=True,
    help="Workload seconds are wall seconds of a mock at this speed.",
)
@click.option("--seed", default=0, show_default=True, help="Workload, engine and policy seed.")
@click.option("--slo-ttft-ms", default=500.0, show_default=True, help="Goodput TTFT objective, ms.")
@click.option("--slo-tpot-ms", default=50.0, show_default=True, help="Goodput TPOT objective, ms.")
@click.option(
    "--mock-config",
    type=click.Path(path_type=Path),
    help="YAML 'mock' section for every engine (timing, limits).",
)
@click.option(
    "--token-times/--no-token-times",
    default=True,
    show_default=True,
    help="Keep every token's time (ITL); off saves memory on big runs.",
)
@click.option(
    "--flow/--no-flow",
    default=True,
    show_default=True,
    help="The router's flow control (queue while saturated, fair share between tenants); "
    "off: every request is routed at its arrival.",
)
@click.option(
    "--flow-option",
    multiple=True,
    help="Router flow setting KEY=VALUE, repeatable (the router's flow.* names, e.g. "
    "max_inflight_per_worker=4; a mapping as JSON, e.g. "
    "'tenant_tokens_per_minute={\"A\":60000}' for tenant rate limits) "
    "[default: the router's].",
)
@click.option(
    "--scrape-interval-ms",
    type=float,
    help="Between engine metrics scrapes, in workload (wall) ms; flow control's "
    "saturation reads them [default: the router's scrape interval].",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Directory for simulate.json and the PNG plots.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="End with one JSON line of the headline figures."
)
def simulate_command(
    engines: int,
    dp: int,
    prefill_engines: int,
    workload: str,
    trace: Path | None,
    policy: str,
    rate: float | None,
    duration: float | None,
    max_tokens: int | None,
    param: tuple[str, ...],
    num_gpu_blocks: int | None,
    max_model_len: int | None,
    speed: float,
    seed: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    mock_config: Path | None,
    token_times: bool,
    flow: bool,
    flow_option: tuple[str, ...],
    scrape_interval_ms: float | None,
    out: Path | None,
    as_json: bool,
) -> None:
    """Replay a workload through the router's own policies over simulated engines (no HTTP)."""
    console = _tables(as_json, out)
    from switchyard.loadtest.simreport import print_table, write_reports
    from switchyard.loadtest.simulate import SimConfig, simulate

    params = parse_params(param)
    for key, value in (("rate", rate), ("duration_s", duration), ("max_tokens", max_tokens)):
        if value is not None:
            params[key] = value
    if trace is not None:
        if workload != "mooncake":
            raise click.BadParameter("--trace is for --workload mooncake")
        params["trace"] = str(trace)
    cfg = SimConfig(
        engines=engines,
        workload=workload,
        workload_params=params,
        policies=[p.strip() for p in policy.split(",") if p.strip()],
        seed=seed,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
        speed=speed,
        dp_size=dp,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        mock_config=mock_config,
        record_token_times=token_times,
        prefill_engines=prefill_engines,
        flow=flow,
        flow_settings=flow_settings(parse_params(flow_option)),
        scrape_interval_ms=scrape_interval_ms,
    )
    try:
        with _router_notes_quiet():
            outcome = simulate(cfg)
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc)) from exc
    if console is not None:
        print_table(outcome, console)
    if out is not None:
        say = _say(console)
        for path in write_reports(outcome, out):
            say(f"wrote {path}")
    if as_json:
        sys.stdout.flush()
        print(json.dumps(outcome.headline()))


def flow_settings(options: dict[str, object]) -> Flow:
    """The router's ``Flow`` group with these settings changed; a bad name or value is the
    command's one-line error."""
    import pydantic

    from switchyard.router.settings import Flow

    unknown = sorted(set(options) - set(Flow.model_fields))
    if unknown:
        raise click.BadParameter(
            f"no flow setting(s) {', '.join(unknown)}", param_hint="--flow-option"
        )
    try:
        flow = Flow(**options)  # type: ignore[arg-type]
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise click.BadParameter(f"{where}: {first['msg']}", param_hint="--flow-option") from None
    return flow


@click.command(
    "plan",
    short_help="The fewest simulated engines that meet a TTFT/TPOT objective at a rate.",
)
@click.option("--rate", type=float, required=True, help="Arrivals per second to plan for.")
@click.option("--slo-ttft-ms", default=500.0, show_default=True, help="Objective: TTFT p90, ms.")
@click.option("--slo-tpot-ms", default=50.0, show_default=True, help="Objective: TPOT p90, ms.")
@click.option(
    "--workload",
    default="multiturn",
    show_default=True,
    help="multiturn, shared_prefix or random.",
)
@click.option("--duration", default=30.0, show_default=True, help="Seconds of arrivals per probe.")
@click.option(
    "--policy",
    default="kv_aware",
    show_default=True,
    help="Policy the engine count is searched with.",
)
@click.option(
    "--compare",
    default="kv_aware,round_robin,least_load",
    show_default=True,
    help="Comma list of policies compared at the size found.",
)
@click.option("--max-engines", default=256, show_default=True, help="Largest fleet tried.")
@click.option("--param", multiple=True, help="Workload parameter KEY=VALUE, repeatable.")
@click.option(
    "--num-gpu-blocks",
    default=2000,
    show_default=True,
    help="KV blocks per engine (16 tokens each).",
)
@click.option("--seed", default=0, show_default=True, help="Workload, engine and policy seed.")
@click.option(
    "--mock-config",
    type=click.Path(path_type=Path),
    help="YAML 'mock' section: the engines' timing model and limits.",
)
@click.option("--out", type=click.Path(path_type=Path), help="Directory for plan.png.")
@click.option(
    "--pd-engines",
    type=int,
    help="Instead: the best prefill:decode split (xPyD) of this many engines.",
)
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line of the answer.")
def plan_command(
    rate: float,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    workload: str,
    duration: float,
    policy: str,
    compare: str,
    max_engines: int,
    param: tuple[str, ...],
    num_gpu_blocks: int,
    seed: int,
    mock_config: Path | None,
    out: Path | None,
    pd_engines: int | None,
    as_json: bool,
) -> None:
    """The fewest simulated engines that meet a TTFT/TPOT objective at a rate, or the
    best prefill:decode split of a given fleet (--pd-engines)."""
    console = _tables(as_json, out)
    from switchyard.loadtest.simplan import Objective, assumptions, plan
    from switchyard.loadtest.simulate import SimConfig

    if workload == "mooncake":
        raise click.BadParameter("plan takes generated workloads (rate and duration)")
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
    say = _say(console)
    with _router_notes_quiet():
        objective = Objective(slo_ttft_ms, slo_tpot_ms)
        if pd_engines is not None:
            title = (
                f"{workload} at {rate:g} req/s on {pd_engines} engines: objective TTFT p90 ≤ "
                f"{slo_ttft_ms:g} ms, TPOT p90 ≤ {slo_tpot_ms:g} ms"
            )
            split = search_split(say, base, objective, policy, pd_engines)
            if console is not None:
                print_split(console, base, split, title)
            if as_json:
                sys.stdout.flush()
                print(json.dumps({**split.as_json(), "assumed": split_assumptions(base)}))
            return
        try:
            result = plan(
                base,
                objective,
                policy,
                [p.strip() for p in compare.split(",") if p.strip()],
                max_engines,
                on_probe=lambda n, run: say(
                    f"  {n} engines: TTFT p90 {run.summary.ttft_ms['p90']:.0f} ms, TPOT p90 "
                    f"{run.summary.tpot_ms['p90'] or 0:.1f} ms"
                ),
            )
        except (ValueError, TypeError) as exc:
            raise click.BadParameter(str(exc)) from exc
        if console is not None:
            title = (
                f"{workload} at {rate:g} req/s: objective TTFT p90 ≤ {slo_ttft_ms:g} ms, "
                f"TPOT p90 ≤ {slo_tpot_ms:g} ms"
            )
            print_plan(console, base, result, max_engines, title)
        if out is not None:
            say(f"wrote {plot_plan(result, out)}")
        if as_json:
            sys.stdout.flush()
            answer = {**result.as_json(), "max_engines": max_engines}
            print(json.dumps({**answer, "assumed": assumptions(base)}))


def print_plan(
    console: Console, base: SimConfig, result: Plan, max_engines: int, title: str
) -> None:
    """The engine search's table, its answer and what it assumed."""
    from rich.table import Table

    from switchyard.loadtest.simplan import assumptions

    objective, policy = result.objective, result.policy
    table = Table(title=title)
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


def search_split(
    say: Callable[[str], None], base: SimConfig, objective: Objective, policy: str, engines: int
) -> SplitPlan:
    """The xPyD search, each split's figures said as it is simulated."""
    from switchyard.loadtest.simplan import plan_split

    try:
        return plan_split(
            base,
            objective,
            policy,
            engines,
            on_probe=lambda p, run: say(
                f"  {p}P{engines - p}D: TTFT p90 {run.summary.ttft_ms['p90'] or 0:.0f} ms, "
                f"TPOT p90 {run.summary.tpot_ms['p90'] or 0:.1f} ms"
            ),
        )
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc)) from exc


def split_assumptions(base: SimConfig) -> str:
    from switchyard.loadtest.simplan import assumptions

    return assumptions(dataclasses.replace(base, prefill_engines=1))


def print_split(console: Console, base: SimConfig, result: SplitPlan, title: str) -> None:
    """The xPyD search's table, its answer and what it assumed."""
    from rich.table import Table

    objective, policy, engines = result.objective, result.policy, result.engines
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
    console.print(f"Assumed: {split_assumptions(base)}")


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
