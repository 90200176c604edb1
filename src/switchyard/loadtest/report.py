"""Reports of a comparison: a terminal table, a JSON file and three PNG plots."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from switchyard.loadtest.compare import Outcome, median_and_worst
from switchyard.loadtest.metrics import Summary

if TYPE_CHECKING:
    # rich is imported by what prints a table, so that the JSON reports need no demo extra.
    from rich.console import Console
    from rich.table import Table


def wide_console() -> Console:
    """A rich console; when output is not a terminal, wide enough for the whole table."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=180)


@dataclass(frozen=True)
class Column:
    title: str
    value: Callable[[Summary], float | None]
    higher_is_better: bool
    fmt: str


COLUMNS = [
    Column("hit rate", lambda s: s.hit_rate, True, "{:.3f}"),
    Column("TTFT p50 ms", lambda s: s.ttft_ms["p50"], False, "{:.0f}"),
    Column("TTFT p90 ms", lambda s: s.ttft_ms["p90"], False, "{:.0f}"),
    Column("TTFT p99 ms", lambda s: s.ttft_ms["p99"], False, "{:.0f}"),
    Column("TPOT p90 ms", lambda s: s.tpot_ms["p90"], False, "{:.1f}"),
    Column("req/s", lambda s: s.throughput_rps, True, "{:.2f}"),
    Column("out tok/s", lambda s: s.output_tps, True, "{:.0f}"),
    Column("goodput req/s", lambda s: s.goodput_rps, True, "{:.2f}"),
    Column("errors", lambda s: float(s.errors), False, "{:.0f}"),
    Column("max/mean load", lambda s: s.spread, False, "{:.2f}"),
]


def aggregate(outcome: Outcome) -> dict[str, dict[str, dict[str, float] | None]]:
    """Per policy, per column: median and worst value over its runs."""
    table: dict[str, dict[str, dict[str, float] | None]] = {}
    for policy in outcome.policies:
        row: dict[str, dict[str, float] | None] = {}
        summaries = [r.summary for r in outcome.runs_of(policy)]
        for col in COLUMNS:
            values = [v for s in summaries if (v := col.value(s)) is not None]
            if not values:
                row[col.title] = None
                continue
            median, worst = median_and_worst(values, col.higher_is_better)
            row[col.title] = {"median": median, "worst": worst}
        table[policy] = row
    return table


def render_table(outcome: Outcome) -> Table:
    from rich.table import Table

    cfg = outcome.config
    runs = max((len(outcome.runs_of(p)) for p in outcome.policies), default=0)
    title = (
        f"{outcome.workload.name}: {len(outcome.workload.requests)} requests, "
        f"{cfg.engines} engines × {cfg.num_gpu_blocks or 'default'} KV blocks, speed ×{cfg.speed:g}"
    )
    caption = (
        f"median (worst) of {runs} run(s) per policy, alternating order; latencies in wall ms. "
        f"Ceiling = perfect routing into one LRU cache of the fleet's total KV "
        f"(no eviction: {outcome.ceiling.infinite_hit_rate:.3f}). "
        f"Goodput SLO: TTFT ≤ {cfg.slo_ttft_ms:g} ms and TPOT ≤ {cfg.slo_tpot_ms:g} ms."
    )
    table = Table(title=title, caption=caption, caption_justify="left")
    table.add_column("policy", style="bold")
    for col in COLUMNS:
        table.add_column(col.title, justify="right")
    agg = aggregate(outcome)
    for policy, row in agg.items():
        cells = []
        for col in COLUMNS:
            cell = row[col.title]
            if cell is None:
                cells.append("-")
            elif runs > 1:
                cells.append(f"{col.fmt.format(cell['median'])} ({col.fmt.format(cell['worst'])})")
            else:
                cells.append(col.fmt.format(cell["median"]))
        table.add_row(policy, *cells)
    blanks = ["-"] * (len(COLUMNS) - 1)
    table.add_row("ceiling", f"{outcome.ceiling.bounded_hit_rate:.3f}", *blanks, style="dim")
    for policy in outcome.unavailable:
        table.add_row(policy, "not available", *blanks, style="red")
    return table


def to_json(outcome: Outcome) -> dict[str, Any]:
    cfg = dataclasses.asdict(outcome.config)
    for key in ("out", "mock_config"):
        cfg[key] = None if cfg[key] is None else str(cfg[key])
    cfg["specs"] = [spec.label for spec in outcome.config.specs]
    return {
        "config": cfg,
        "workload": outcome.workload.describe(),
        "ceiling": outcome.ceiling.as_dict(),
        "aggregate": aggregate(outcome),
        "runs": [
            {"policy": r.policy, "repeat": r.repeat, **dataclasses.asdict(r.summary)}
            for r in outcome.runs
        ],
        "unavailable": outcome.unavailable,
        "wall_s": outcome.wall_s,
    }


def plot(outcome: Outcome, out: Path) -> list[Path]:
    """TTFT CDF, hit rate per policy against the ceiling, requests per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    policies = outcome.policies
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        xs = sorted(t for r in outcome.runs_of(policy) for t in r.ttft_ms)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=policy)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("time to first token, wall ms (log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, {outcome.workload.name} (all runs pooled)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    agg = aggregate(outcome)
    medians = [(agg[p]["hit rate"] or {}).get("median", 0.0) for p in policies]
    worst = [(agg[p]["hit rate"] or {}).get("worst", 0.0) for p in policies]
    bars = ax.bar(policies, medians, color="tab:blue", label="median run")
    ax.scatter(policies, worst, color="tab:red", zorder=3, label="worst run")
    ax.bar_label(bars, fmt="%.2f")
    ax.axhline(outcome.ceiling.bounded_hit_rate, color="black", ls="--", label="ceiling")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fleet prefix-cache hit rate (cached / prompt tokens)")
    ax.set_title(f"Hit rate, {outcome.workload.name}")
    ax.legend(loc="lower right")
    paths.append(_save(fig, out / "hit_rate.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = outcome.config.engines
    width = 0.8 / max(1, len(policies))
    for k, policy in enumerate(policies):
        runs = outcome.runs_of(policy)
        per_engine = [sum(r.summary.per_engine[i] for r in runs) / len(runs) for i in range(n)]
        ax.bar([i + k * width for i in range(n)], per_engine, width, label=policy)
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(n)])
    ax.set_xticklabels([f"engine {i}" for i in range(n)])
    ax.set_ylabel("requests served (mean over runs)")
    ax.set_title(f"Load spread, {outcome.workload.name}")
    ax.legend()
    paths.append(_save(fig, out / "load_spread.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(outcome: Outcome, console: Console) -> list[Path]:
    """Print the table and write ``compare.json`` and the plots into the config's ``out``."""
    out = outcome.config.out
    out.mkdir(parents=True, exist_ok=True)
    console.print(render_table(outcome))
    for policy, reason in outcome.unavailable.items():
        console.print(f"[red]{policy} not available:[/] {reason}")
    json_path = out / "compare.json"
    json_path.write_text(json.dumps(to_json(outcome), indent=2))
    return [json_path, *plot(outcome, out)]
