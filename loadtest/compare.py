"""One comparison: one fleet, one seeded workload, every router config, repeated.

A config may list fallbacks, ``kv_aware|cache_aware|least_load``: the first one that
starts is used for every repetition, the others are reported as unavailable.

Started once, the mock fleet is reset to the same state (idle, empty prefix caches)
before every run, and every run replays the identical workload. Repetitions alternate
the order of the configs (forward, backward, …) so that warm-up or drift cannot always
favour the same one; the report gives each config's median and its worst run, because
on a small shared machine one run against one run proves nothing.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.ceiling import Ceiling, ceiling
from loadtest.client import Result, replay
from loadtest.fleet import HITS, QUERIES, SERVED, MockFleet
from loadtest.metrics import SLO, Summary, summarize
from loadtest.routers import RouterSpec, Unavailable, start_router
from loadtest.workload import Workload
from loadtest.workloads import build_workload
from mockengine.settings import DEFAULT_TOKENIZER

MODEL = "mock-model"
T = TypeVar("T")


@dataclass
class CompareConfig:
    engines: int = 4
    workload: str = "multiturn"
    policies: list[str] = field(default_factory=lambda: ["round_robin", "least_load"])
    workload_params: dict[str, Any] = field(default_factory=dict)
    num_gpu_blocks: int | None = 2000
    speed: float = 10.0
    seed: int = 0
    repeats: int = 3
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 50.0
    fleet_processes: int = 1
    # YAML with a 'mock' section for every engine (timing model, max_num_seqs, …).
    mock_config: Path | None = None
    request_timeout_s: float = 120.0
    settle_s: float = 0.5
    out: Path = Path("bench-results")
    progress: bool = True


@dataclass
class Run:
    policy: str
    repeat: int
    summary: Summary
    ttft_ms: list[float]


@dataclass
class Outcome:
    config: CompareConfig
    workload: Workload
    ceiling: Ceiling
    runs: list[Run] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0

    def runs_of(self, policy: str) -> list[Run]:
        return [r for r in self.runs if r.policy == policy]

    @property
    def policies(self) -> list[str]:
        """Configs that ran, in first-run order."""
        return list(dict.fromkeys(r.policy for r in self.runs))


def fleet_for(cfg: CompareConfig) -> MockFleet:
    extra = ["--config", str(cfg.mock_config)] if cfg.mock_config else []
    return MockFleet(
        cfg.engines,
        cfg.num_gpu_blocks,
        cfg.speed,
        cfg.seed,
        processes=cfg.fleet_processes,
        extra_args=extra,
    )


def run_order(items: list[T], repeat: int) -> list[T]:
    """Forward on even repetitions, backward on odd ones."""
    return list(items) if repeat % 2 == 0 else list(reversed(items))


def _one_run(
    fleet: MockFleet,
    spec: RouterSpec,
    workload: Workload,
    cfg: CompareConfig,
    on_done: Callable[[Result], None] | None,
) -> tuple[list[Result], list[dict[str, float]]]:
    """Results, and per engine how much each of its counters grew during the run."""
    fleet.reset()
    before = fleet.counters()
    with start_router(spec, fleet.engines, DEFAULT_TOKENIZER) as router:
        time.sleep(cfg.settle_s)
        results = asyncio.run(
            replay(router.url, workload, MODEL, cfg.request_timeout_s, on_done=on_done)
        )
    after = fleet.counters()
    return results, [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]


def compare(
    cfg: CompareConfig, console: Console | None = None, fleet: MockFleet | None = None
) -> Outcome:
    """Run the comparison; on ``fleet`` if given (left running), else on a fleet of its own."""
    console = console or Console()
    started = time.monotonic()
    workload = build_workload(cfg.workload, cfg.seed, **cfg.workload_params)
    ceil = ceiling(workload, cfg.engines, cfg.num_gpu_blocks)
    outcome = Outcome(cfg, workload, ceil)
    slo = SLO(cfg.slo_ttft_ms / 1000.0, cfg.slo_tpot_ms / 1000.0)
    console.print(
        f"[bold]{workload.name}[/]: {len(workload.requests)} requests over "
        f"{workload.duration_s:.1f}s, seed {cfg.seed}; {cfg.engines} mock engines, "
        f"{cfg.num_gpu_blocks or 'default'} KV blocks each, speed ×{cfg.speed:g}"
    )
    own = fleet is None
    fleet = fleet or fleet_for(cfg)
    if own:
        fleet.start()
    # Each slot holds its alternatives until one of them has started once.
    slots = [[RouterSpec.parse(a) for a in p.split("|")] for p in cfg.policies]
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not cfg.progress,
    )
    try:
        with progress:
            for repeat in range(cfg.repeats):
                for slot in run_order(slots, repeat):
                    while slot:
                        spec = slot[0]
                        if _attempt(fleet, spec, workload, cfg, slo, repeat, progress, outcome):
                            del slot[1:]
                            break
                        slot.pop(0)
    finally:
        if own:
            fleet.stop()
    outcome.wall_s = time.monotonic() - started
    return outcome


def _attempt(
    fleet: MockFleet,
    spec: RouterSpec,
    workload: Workload,
    cfg: CompareConfig,
    slo: SLO,
    repeat: int,
    progress: Progress,
    outcome: Outcome,
) -> bool:
    """One run of ``spec``; False (and the reason recorded) when it cannot start."""
    label = f"{spec.label:>18} run {repeat + 1}/{cfg.repeats}"
    task = progress.add_task(label, total=len(workload.requests))
    try:
        results, deltas = _one_run(fleet, spec, workload, cfg, lambda _: progress.advance(task))
    except Unavailable as exc:
        outcome.unavailable[spec.label] = str(exc)
        progress.update(task, description=f"{spec.label:>18} not available")
        return False
    per_engine = [int(d[SERVED]) for d in deltas]
    queried = sum(d[QUERIES] for d in deltas)
    summary = summarize(results, slo, per_engine)
    summary.engine_hit_rate = sum(d[HITS] for d in deltas) / queried if queried else None
    ttfts = [r.ttft_s * 1000.0 for r in results if r.ok and r.ttft_s is not None]
    outcome.runs.append(Run(spec.label, repeat, summary, ttfts))
    return True


def median_and_worst(values: list[float], higher_is_better: bool) -> tuple[float, float]:
    worst = min(values) if higher_is_better else max(values)
    return statistics.median(values), worst
