"""``switchyard demo``: the stack on one machine and the comparison that shows why it exists.

It starts a fleet of mock engines with deliberately small KV caches, then replays a
multi-turn chat workload (tenants with shared system prompts, growing conversations)
through round_robin and through our best available prefix-aware policy (kv_aware,
else cache_aware, else least_load), plus smg's cache_aware when smg is installed,
each on the same reset fleet. It takes a minute or two.
"""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

from rich.console import Console

from switchyard.loadtest.compare import CompareConfig, Outcome, compare, fleet_for
from switchyard.loadtest.fleet import MockFleet
from switchyard.loadtest.report import aggregate, wide_console, write_reports
from switchyard.loadtest.routers import RouterSpec, Unavailable, start_router

BEST = "kv_aware|cache_aware|least_load"

DEMO_WORKLOAD = {
    "rate": 6.0,
    "duration_s": 12.0,
    "tenants": 4,
    "system_tokens": 2000,
    "active_sessions": 16,
    "turns": 6,
    "max_tokens": 24,
    "answer_tokens": 24,
}


def demo_config(engines: int, repeats: int, out: Path) -> CompareConfig:
    policies = ["round_robin", BEST]
    if shutil.which("smg"):
        policies.append("smg:cache_aware")
    return CompareConfig(
        engines=engines,
        workload="multiturn",
        policies=policies,
        workload_params=dict(DEMO_WORKLOAD),
        # 300 blocks = 4,800 tokens: one engine holds a tenant's system prompt and a
        # few conversations, not everyone's (routing matters); the fleet holds them all.
        num_gpu_blocks=300,
        # Real-time engines: prefill cost (~17 µs per uncached token) is visible in TTFT.
        speed=1.0,
        seed=0,
        repeats=repeats,
        out=out,
    )


def run_demo(
    engines: int = 6,
    repeats: int = 2,
    out: Path = Path("switchyard-demo"),
    serve: bool = False,
    port: int = 8000,
) -> None:
    console = wide_console()
    cfg = demo_config(engines, repeats, out)
    console.rule("[bold]switchyard demo")
    console.print(
        "Same mock fleet, same seeded multi-turn chat workload, one router config at a time; "
        "the fleet's prefix caches are emptied between runs."
    )
    with fleet_for(cfg) as fleet:
        outcome = compare(cfg, console, fleet)
        paths = write_reports(outcome, console)
        console.print(
            "[bold]How to read it:[/] hit rate = share of prompt tokens the engines "
            "served from their prefix cache (the ceiling is the best any router could "
            "do); TTFT = time to first token; max/mean load 1.00 = perfectly even."
        )
        line = headline(outcome)
        if line:
            console.print(line)
        for path in paths:
            console.print(f"wrote {path.resolve()}")
        if serve:
            best = [p for p in outcome.policies if p != "round_robin"][:1] or ["round_robin"]
            _serve(console, fleet, RouterSpec.parse(best[0]), port)


def headline(outcome: Outcome) -> str:
    """One sentence: our prefix-aware policy against round_robin, medians of the runs."""
    agg = aggregate(outcome)
    ours = next((p for p in outcome.policies if p != "round_robin" and ":" not in p), None)
    base = agg.get("round_robin")
    if ours is None or base is None:
        return ""
    mine = agg[ours]

    def med(row: dict[str, dict[str, float] | None], col: str) -> float:
        cell = row.get(col)
        return float("nan") if cell is None else cell["median"]

    return (
        f"[bold]{ours}[/] served {med(mine, 'hit rate'):.0%} of prompt tokens from cache "
        f"(round_robin {med(base, 'hit rate'):.0%}); TTFT p50 {med(mine, 'TTFT p50 ms'):.0f} ms "
        f"vs {med(base, 'TTFT p50 ms'):.0f} ms, p90 {med(mine, 'TTFT p90 ms'):.0f} ms "
        f"vs {med(base, 'TTFT p90 ms'):.0f} ms."
    )


def _serve(console: Console, fleet: MockFleet, spec: RouterSpec, port: int) -> None:
    """Keep the best config up on the fleet until Ctrl-C, with a request to try."""
    try:
        router = start_router(spec, fleet.engines, port=port)
    except Unavailable as exc:
        console.print(f"[red]could not start {spec.label}:[/] {exc}")
        return
    with router:
        console.rule(f"[bold]serving: {router.url}/v1  ({spec.label})")
        console.print("engines: " + ", ".join(e.url for e in fleet.engines))
        console.print(f'python: OpenAI(base_url="{router.url}/v1", api_key="none")')
        console.print(
            f"try: curl {router.url}/v1/chat/completions -H 'Content-Type: application/json' "
            """-d '{"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}'"""
        )
        console.print("Ctrl-C to stop.")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
