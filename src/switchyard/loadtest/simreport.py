"""Reports of a simulation: bench compare's table and JSON, and plots that scale to big fleets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from switchyard.loadtest.report import render_table, to_json
from switchyard.loadtest.simulate import SimOutcome
from switchyard.router.settings import Flow

if TYPE_CHECKING:
    # rich is imported by the tables, so that ``simulate --json`` needs no demo extra.
    from rich.console import Console
    from rich.table import Table


def print_table(outcome: SimOutcome, console: Console) -> None:
    console.print(render_table(outcome.as_compare()))
    cfg = outcome.config
    console.print(
        f"simulated: {outcome.sim_s:.1f} s of model time in {outcome.wall_s:.1f} s wall "
        f"(×{outcome.sim_s / outcome.wall_s if outcome.wall_s else 0:.0f}; "
        f"{outcome.cpu_s:.1f} s CPU; setup "
        f"{outcome.setup_wall_s:.1f} s), {cfg.engines} engines × {cfg.dp_size} DP rank(s), "
        f"peak RSS {outcome.peak_rss_bytes / 2**20:.0f} MiB. No HTTP, client or router CPU "
        f"time is in these latencies; KV events are applied at the step that emits them."
    )
    console.print(
        f"engine: {outcome.engine.describe()}; {outcome.refused_too_long} request(s) refused "
        f"as longer than that (vLLM's 400), counted as errors."
    )
    if outcome.flow:
        console.print(
            f"flow control: on (the router's, engine metrics scraped every "
            f"{cfg.scrape_interval_s() * 1e3:g} ms{rate_limits(cfg.flow_settings)}); its "
            f"refusals are counted as errors."
        )
    else:
        reason = "P/D pools are not queued" if cfg.flow else "--no-flow"
        console.print(f"flow control: off ({reason}); every request is routed at its arrival.")
    if any(len(run.tenants) > 1 or run.refused_by_flow for run in outcome.runs):
        console.print(tenant_table(outcome))


def rate_limits(flow: Flow) -> str:
    """The tenants' rate limits as the flow control line names them ("" when none)."""
    parts = []
    for unit, limits in (
        ("tokens", flow.tenant_tokens_per_minute),
        ("requests", flow.tenant_requests_per_minute),
    ):
        named = ", ".join(f"{tenant} {limit}" for tenant, limit in sorted(limits.items()))
        if any(limits.values()):
            parts.append(f"{unit} per minute {named}")
    return f"; tenant rate limits: {'; '.join(parts)}" if parts else ""


def tenant_table(outcome: SimOutcome) -> Table:
    """Per policy and tenant: requests, served, refused by reason, TTFT and queue wait."""
    from rich.table import Table

    table = Table(title=f"Per tenant, {outcome.workload.name} (simulated)")
    columns = (
        "policy", "tenant", "requests", "served", "refused", "TTFT p50 ms", "TTFT p90 ms",
        "wait p50 ms", "wait p90 ms", "prompt tok", "output tok",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("policy", "tenant", "refused") else "right")
    for run in outcome.runs:
        for name, fig in run.tenants.items():
            ttft, wait = fig.ttft_ms(), fig.wait_ms()
            refused = ", ".join(f"{k} {v}" for k, v in sorted(fig.refused.items())) or "-"
            table.add_row(
                run.policy, name, str(fig.requests), str(fig.served), refused,
                _ms(ttft["p50"]), _ms(ttft["p90"]), _ms(wait["p50"]), _ms(wait["p90"]),
                str(fig.prompt_tokens), str(fig.output_tokens),
            )  # fmt: skip
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def write_reports(outcome: SimOutcome, out: Path) -> list[Path]:
    """``simulate.json`` (bench compare's shape plus the simulation's figures) and the plots."""
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = to_json(outcome.as_compare())
    data["simulation"] = outcome.headline()
    path = out / "simulate.json"
    path.write_text(json.dumps(data, indent=2))
    return [path, *plot(outcome, out)]


def plot(outcome: SimOutcome, out: Path) -> list[Path]:
    """TTFT CDF per policy, hit rate against the ceiling, and requests per engine sorted
    (a curve rather than one bar per engine, so a thousand engines stay readable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    name = outcome.workload.name
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in outcome.runs:
        xs = sorted(run.ttft_ms)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=run.policy)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("time to first token, ms (simulated, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, {name}, {outcome.config.engines} engines (simulated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    policies = [r.policy for r in outcome.runs]
    bars = ax.bar(policies, [r.summary.hit_rate for r in outcome.runs], color="tab:blue")
    ax.bar_label(bars, fmt="%.3f")
    ax.axhline(outcome.ceiling.bounded_hit_rate, color="black", ls="--", label="ceiling")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fleet prefix-cache hit rate (cached / prompt tokens)")
    ax.set_title(f"Hit rate, {name} (simulated)")
    ax.legend(loc="lower right")
    paths.append(_save(fig, out / "hit_rate.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in outcome.runs:
        served = sorted(run.summary.per_engine, reverse=True)
        ax.plot(range(1, len(served) + 1), served, label=run.policy)
    ax.set_xlabel("engines, busiest first")
    ax.set_ylabel("requests served")
    ax.set_title(f"Load spread, {name} (simulated)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "load_spread.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
