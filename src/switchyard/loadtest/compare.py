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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import httpx

from switchyard.loadtest.ceiling import Ceiling, ceiling
from switchyard.loadtest.client import Result, replay
from switchyard.loadtest.fleet import HITS, QUERIES, SERVED, Engine, MockFleet, RunningFleet
from switchyard.loadtest.metrics import SLO, Summary, summarize
from switchyard.loadtest.routers import RouterSpec, Unavailable, start_router
from switchyard.loadtest.workload import Workload
from switchyard.loadtest.workloads import build_workload
from switchyard.mock.settings import DEFAULT_TOKENIZER

if TYPE_CHECKING:
    # The report library is imported where a run prints, so that ``switchyard simulate``,
    # which shares this module's shapes, runs without the demo extra.
    from rich.console import Console
    from rich.progress import Progress

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
    # Running engines to compare on instead of a mock fleet (URLs), and the model to ask
    # for (None: the mock's, or the first worker's /v1/models).
    workers: list[str] = field(default_factory=list)
    model: str | None = None
    request_timeout_s: float = 120.0
    settle_s: float = 0.5
    out: Path = Path("bench-results")
    progress: bool = True
    # Router configs given as specs, after ``policies``: e.g. ours run from another checkout.
    specs: list[RouterSpec] = field(default_factory=list)


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


class Fleet(Protocol):
    @property
    def engines(self) -> list[Engine]: ...

    def counters(self) -> list[dict[str, float]]: ...

    def reset(self, timeout_s: float = ...) -> None: ...


def served_model(url: str) -> str:
    """The first model an OpenAI endpoint lists."""
    listing = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).raise_for_status().json()
    models = listing.get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


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
    fleet: Fleet,
    spec: RouterSpec,
    workload: Workload,
    cfg: CompareConfig,
    model: str,
    on_done: Callable[[Result], None] | None,
) -> tuple[list[Result], list[dict[str, float]]]:
    """Results, and per engine how much each of its counters grew during the run."""
    fleet.reset()
    before = fleet.counters()
    with start_router(spec, fleet.engines, DEFAULT_TOKENIZER, model=model) as router:
        time.sleep(cfg.settle_s)
        results = asyncio.run(
            replay(router.url, workload, model, cfg.request_timeout_s, on_done=on_done)
        )
    after = fleet.counters()
    return results, [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]


def compare(
    cfg: CompareConfig, console: Console | None = None, fleet: MockFleet | None = None
) -> Outcome:
    """Run the comparison: on ``fleet`` if given (left running), on ``cfg.workers`` (a
    running fleet, left running), else on a mock fleet of its own."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    console = console or Console()
    started = time.monotonic()
    workload = build_workload(cfg.workload, cfg.seed, **cfg.workload_params)
    running = [Engine(url.rstrip("/"), None) for url in cfg.workers]
    if running:
        cfg = replace(cfg, engines=len(running))
    engines = cfg.engines
    ceil = ceiling(workload, engines, None if running else cfg.num_gpu_blocks)
    outcome = Outcome(cfg, workload, ceil)
    slo = SLO(cfg.slo_ttft_ms / 1000.0, cfg.slo_tpot_ms / 1000.0)
    where = (
        f"{engines} running engines"
        if running
        else f"{engines} mock engines, {cfg.num_gpu_blocks or 'default'} KV blocks each, "
        f"speed ×{cfg.speed:g}"
    )
    console.print(
        f"[bold]{workload.name}[/]: {len(workload.requests)} requests over "
        f"{workload.duration_s:.1f}s, seed {cfg.seed}; {where}"
    )
    model = cfg.model or (served_model(running[0].url) if running else MODEL)
    own = fleet is None and not running
    chosen: Fleet = fleet or (RunningFleet(running) if running else fleet_for(cfg))
    if isinstance(chosen, MockFleet) and own:
        chosen.start()
    # Each slot holds its alternatives until one of them has started once.
    slots = [[RouterSpec.parse(a) for a in p.split("|")] for p in cfg.policies]
    slots += [[spec] for spec in cfg.specs]
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
                        ok = _attempt(
                            chosen, spec, workload, cfg, model, slo, repeat, progress, outcome
                        )
                        if ok:
                            del slot[1:]
                            break
                        slot.pop(0)
    finally:
        if isinstance(chosen, MockFleet) and own:
            chosen.stop()
    outcome.wall_s = time.monotonic() - started
    return outcome


def _attempt(
    fleet: Fleet,
    spec: RouterSpec,
    workload: Workload,
    cfg: CompareConfig,
    model: str,
    slo: SLO,
    repeat: int,
    progress: Progress,
    outcome: Outcome,
) -> bool:
    """One run of ``spec``; False (and the reason recorded) when it cannot start."""
    label = f"{spec.label:>18} run {repeat + 1}/{cfg.repeats}"
    task = progress.add_task(label, total=len(workload.requests))
    try:
        results, deltas = _one_run(
            fleet, spec, workload, cfg, model, lambda _: progress.advance(task)
        )
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


def run_target(cfg: CompareConfig, target: str, console: Console | None = None) -> Outcome:
    """Replay the workload ``cfg.repeats`` times against any OpenAI endpoint (a router, an
    engine, a hosted API), with no router of ours in front: reported as config "target".
    Nothing is reset between runs (an arbitrary endpoint has no reset), the hit rate is
    the engines' own ``cached_tokens`` seen by the client, and the engines behind it are
    unknown (``engines`` 0, no load spread)."""
    from rich.console import Console

    cfg = replace(cfg, engines=0)
    console = console or Console()
    started = time.monotonic()
    workload = build_workload(cfg.workload, cfg.seed, **cfg.workload_params)
    outcome = Outcome(cfg, workload, ceiling(workload, 1, None))
    slo = SLO(cfg.slo_ttft_ms / 1000.0, cfg.slo_tpot_ms / 1000.0)
    model = cfg.model or served_model(target)
    console.print(
        f"[bold]{workload.name}[/]: {len(workload.requests)} requests over "
        f"{workload.duration_s:.1f}s, seed {cfg.seed}; target {target}, model {model}"
    )
    for repeat in range(cfg.repeats):
        results = asyncio.run(replay(target.rstrip("/"), workload, model, cfg.request_timeout_s))
        ttfts = [r.ttft_s * 1000.0 for r in results if r.ok and r.ttft_s is not None]
        outcome.runs.append(Run("target", repeat, summarize(results, slo), ttfts))
    outcome.wall_s = time.monotonic() - started
    return outcome
