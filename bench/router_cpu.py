"""Router cost per request: Switchyard (kv_aware) and smg on the same mock fleet.

Replays the multi-turn and Mooncake workloads through each router in turn (alternating
the order on every repetition) and prints, per run, the router's CPU-seconds per 1,000
requests (utime + stime of its process from ``/proc/PID/stat``, over the replay only),
the schedule-time histogram (``switchyard_router_schedule_seconds``; smg exposes none)
and the clients' TTFT. ``--micro`` instead times the scheduling lookup per turn in this
process, with the message cache on and off, alternating; ``--ingest`` times KV-event
batches applied by the store (each one holds the event loop while it runs); ``--idle``
prints each router's CPU with no traffic (probes, scrapes, event feeds), which every
replay's CPU-seconds include; ``--siblings`` what the bus between a router's processes
costs per counts sync and per shared placement. ``--against REV`` also runs each of our
router configs from a worktree of git revision REV, in the same alternation, for a
before/after pair on one fleet. CPU is split into user (the router's own code) and system
time (mostly socket calls, which any router makes). Usage::

    python -m bench.router_cpu [multiturn mooncake] [--requests 300] [--repeats 2]
        [--routers kv_aware@1 round_robin@1 smg:cache_aware ...] [--against REV]
    python -m bench.router_cpu --idle [--idle-s 20]
    python -m bench.router_cpu --micro [--requests 600]
    python -m bench.router_cpu --ingest [--requests 2000]
    python -m bench.router_cpu --siblings [--requests 300]

The fixed-backend figure is ``bench.overhead``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from bench.compare_routing import MULTITURN, SCENARIOS
from switchyard.loadtest.client import Result, replay
from switchyard.loadtest.compare import MODEL, run_order
from switchyard.loadtest.fleet import MockFleet
from switchyard.loadtest.metrics import percentile
from switchyard.loadtest.procs import cpu_seconds, cpu_times
from switchyard.loadtest.prom import samples
from switchyard.loadtest.routers import RouterSpec, Unavailable, start_router
from switchyard.loadtest.workload import Workload
from switchyard.loadtest.workloads import build_workload
from switchyard.mock.settings import DEFAULT_TOKENIZER
from switchyard.router.metrics import FLUSH_INTERVAL_S
from tools.worktree import worktree

ROUTERS = ("kv_aware", "smg:cache_aware")
SCHEDULE = "switchyard_router_schedule_seconds_bucket"


def workload_for(name: str, requests: int, seed: int) -> Workload:
    if name == "multiturn":
        rate = float(MULTITURN["rate"])
        return build_workload(name, seed, **{**MULTITURN, "duration_s": requests / rate})
    if name == "mooncake":
        return build_workload(name, seed, **{**SCENARIOS["mooncake"]["params"], "limit": requests})
    raise ValueError(f"unknown workload {name!r}: multiturn or mooncake")


def schedule_buckets(url: str) -> tuple[dict[float, float], dict[float, float]]:
    """Cumulative counts of the schedule-time histogram by upper bound, of every request and
    of later turns (chats with earlier answers); both empty for smg. Read once every
    process has written its last samples (``FLUSH_INTERVAL_S``)."""
    time.sleep(2 * FLUSH_INTERVAL_S)
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}, {}
    every: dict[float, float] = {}
    later: dict[float, float] = {}
    for s in samples(text, SCHEDULE):
        if s.name == SCHEDULE:
            bound = float(s.labels["le"])
            every[bound] = every.get(bound, 0.0) + s.value
            if s.labels.get("turn") == "later":
                later[bound] = s.value
    return every, later


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (None without samples)."""
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return None
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return None


@dataclass
class Row:
    workload: str
    router: str
    repeat: int
    ok: int
    cpu_s: float
    sys_s: float
    ttft_ms: list[float]
    buckets: dict[float, float]
    later: dict[float, float]  # turns >= 2 of chats

    def line(self) -> str:
        per_k = self.cpu_s / self.ok * 1000 if self.ok else float("nan")
        sys_k = self.sys_s / self.ok * 1000 if self.ok else float("nan")
        p50, p90 = (percentile(self.ttft_ms, q) for q in (50, 90))
        s50, s90 = (bucket_quantile(self.buckets, q) for q in (0.5, 0.9))
        sched = "n/a" if s50 is None else f"≤{s50 * 1e3:g} / ≤{(s90 or 0) * 1e3:g}"
        l50 = bucket_quantile(self.later, 0.5)
        if l50 is not None:
            sched += f"; turns ≥ 2: ≤{l50 * 1e3:g}"
        return (
            f"{self.workload:>9} {self.router:>22} {self.repeat + 1:>3} {self.ok:>5} "
            f"{self.cpu_s:>7.2f} {per_k:>9.2f} {per_k - sys_k:>7.2f} {sys_k:>6.2f} "
            f"{p50 or 0:>8.1f} {p90 or 0:>8.1f}  {sched}"
        )


def one_run(fleet: MockFleet, spec: RouterSpec, workload: Workload, repeat: int) -> Row:
    fleet.reset()
    with start_router(spec, fleet.engines, DEFAULT_TOKENIZER) as router:
        time.sleep(0.5)
        user0, sys0 = cpu_times(router.proc.pid)
        results: list[Result] = asyncio.run(replay(router.url, workload, MODEL))
        user1, sys1 = cpu_times(router.proc.pid)
        buckets, later = schedule_buckets(router.url)
    ttft = [r.ttft_s * 1e3 for r in results if r.ok and r.ttft_s is not None]
    ok = sum(r.ok for r in results)
    cpu, system = user1 - user0 + sys1 - sys0, sys1 - sys0
    return Row(workload.name, spec.label, repeat, ok, cpu, system, ttft, buckets, later)


def idle_bench(args: argparse.Namespace) -> None:
    """CPU of each router in front of the mock fleet, with no requests."""
    specs = [RouterSpec.parse(r) for r in args.routers]
    print(f"idle routers, {args.engines} engines; load {os.getloadavg()[0]:.1f}")
    with MockFleet(args.engines, 300, args.speed, args.seed) as fleet:
        for repeat in range(args.repeats):
            for spec in run_order(specs, repeat):
                try:
                    with start_router(spec, fleet.engines, DEFAULT_TOKENIZER) as router:
                        time.sleep(2.0)
                        before = cpu_seconds(router.proc.pid)
                        time.sleep(args.idle_s)
                        cpu = cpu_seconds(router.proc.pid) - before
                except Unavailable as exc:
                    print(f"{spec.label}: not available ({exc})", file=sys.stderr)
                    continue
                print(
                    f"{spec.label:>16} run {repeat + 1}: {cpu:.2f} CPU-s in {args.idle_s:g} s "
                    f"({cpu / args.idle_s:.1%} of a core)",
                    flush=True,
                )


def histogram_lines(rows: list[Row]) -> list[str]:
    out = []
    for row in rows:
        for which, buckets in (("", row.buckets), (" turns ≥ 2", row.later)):
            total = buckets.get(float("inf"), 0.0)
            if not total:
                continue
            cells = " ".join(
                f"≤{b * 1e3:g}ms:{buckets[b] / total:.0%}" for b in sorted(buckets)[:-1]
            )
            out.append(f"{row.workload} {row.router} run {row.repeat + 1}{which}: {cells}")
    return out


def replay_bench(args: argparse.Namespace) -> None:
    specs = [RouterSpec.parse(r) for r in args.routers]
    with ExitStack() as stack:
        if args.against:
            code = worktree(stack, args.against)
            specs += [s.run_from(code, args.against) for s in specs if s.kind == "switchyard"]
        replay_runs(args, specs)


def replay_runs(args: argparse.Namespace, specs: list[RouterSpec]) -> None:
    rows: list[Row] = []
    for name in args.workloads:
        workload = workload_for(name, args.requests, args.seed)
        blocks = int(SCENARIOS[name]["blocks"])
        with MockFleet(args.engines, blocks, args.speed, args.seed) as fleet:
            for repeat in range(args.repeats):
                for spec in run_order(specs, repeat):
                    try:
                        row = one_run(fleet, spec, workload, repeat)
                    except Unavailable as exc:
                        print(f"{spec.label}: not available ({exc})", file=sys.stderr)
                        continue
                    rows.append(row)
                    print(row.line(), flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        f"{'workload':>9} {'router':>22} {'run':>3} {'ok':>5} {'cpu_s':>7} {'cpu/1k':>9} "
        f"{'user':>7} {'sys':>6} "
        f"{'ttft_p50':>8} {'ttft_p90':>8}  schedule p50 / p90; turns ≥ 2 p50 (ms, bucket bounds)"
    )
    for row in rows:
        print(row.line())
    print("\nschedule-time histogram (cumulative share of requests):")
    for line in histogram_lines(rows):
        print(line)
    print("\nmedian CPU-seconds per 1,000 requests:")
    for name in args.workloads:
        for spec in specs:
            per_k = [
                r.cpu_s / r.ok * 1000
                for r in rows
                if r.workload == name and r.ok and r.router == spec.label
            ]
            if per_k:
                print(f"{name:>9} {spec.label:>22} {statistics.median(per_k):8.2f}")


async def _lookup_times(workload: Workload, incremental: bool) -> dict[str, list[float]]:
    """Seconds per scheduling lookup (probe, else whole lookup), by first or later turn."""
    from switchyard.kvstore.memory import MemoryIndex
    from switchyard.kvstore.store import KVStore
    from switchyard.kvstore.tokenize import RoutingTokenizer
    from switchyard.router.kv import EmbeddedPrefixes

    tok = RoutingTokenizer.from_dir(DEFAULT_TOKENIZER)
    if not incremental:
        tok._layout = None  # the message cache off: a full render and the head probe
    store = KVStore(MemoryIndex(), block_size=16, tokenizer=tok)
    source = EmbeddedPrefixes(store)
    workers = [f"w{i}" for i in range(8)]
    times: dict[str, list[float]] = {"turn 1": [], "turns ≥ 2": []}
    for i, req in enumerate(workload.requests):
        prompt: dict[str, Any] = {"messages": req.messages}
        t0 = time.perf_counter()
        result = await source.probe(MODEL, prompt, None, workers)
        if result is None:
            result = await source.lookup(MODEL, prompt, None, workers)
        elapsed = time.perf_counter() - t0
        times["turn 1" if len(req.messages) <= 2 else "turns ≥ 2"].append(elapsed)
        best = max(result.matches, key=lambda m: m.matched_tokens, default=None)
        worker = best.instance if best is not None else workers[i % len(workers)]
        ids, _ = await store.tokenize(MODEL, messages=req.messages)
        await store.record_placement(store.keys_for(ids), worker, 0, 3600.0)
    return times


def _prompt_times(prompts: list[str], space_cuts: bool) -> tuple[list[float], float]:
    """Seconds per completion prompt tokenized, and the share of pieces from the cache."""
    from switchyard.kvstore.tokenize import RoutingTokenizer

    tok = RoutingTokenizer.from_dir(DEFAULT_TOKENIZER)
    if not space_cuts:
        tok._cuts = tok._cuts[:1]  # newline cuts only, as before space cuts
    times = []
    for text in prompts:
        t0 = time.perf_counter()
        tok.encode_prompt(text)
        times.append(time.perf_counter() - t0)
    hits, misses = tok.cache_stats["by_kind"]["piece"]
    return times, hits / max(1, hits + misses)


def micro_bench(args: argparse.Namespace) -> None:
    workload = workload_for("multiturn", args.requests, args.seed)
    print(f"multiturn, {len(workload.requests)} requests, 8 workers; load {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[dict[str, list[float]]]] = {"cache off": [], "cache on": []}
    for repeat in range(args.repeats):
        for label in run_order(["cache off", "cache on"], repeat):
            runs[label].append(asyncio.run(_lookup_times(workload, label == "cache on")))
    prompts = [
        str(r.messages[-1]["content"])
        for r in workload_for("mooncake", args.requests, args.seed).requests
    ]
    print(f"mooncake texts as completion prompts: {len(prompts)}, shared prefixes, no newlines")
    for space_cuts in (False, True, False, True)[: 2 * args.repeats]:
        times, hit_share = _prompt_times(prompts, space_cuts)
        how = "newline and space cuts" if space_cuts else "newline cuts only"
        print(
            f"{how:>23}: p50 {(percentile(times, 50) or 0) * 1e3:.3f} ms, "
            f"total {sum(times):.2f} s, pieces from the cache {hit_share:.0%}"
        )
    for label, results in runs.items():
        for turn in ("turn 1", "turns ≥ 2"):
            values = sorted(v for r in results for v in r[turn])
            p50, p90 = (percentile(values, q) or 0.0 for q in (50, 90))
            how = "by message" if label == "cache on" else "full render + head probe"
            print(
                f"message {label:>9} ({how}) {turn:>9}: n={len(values)} "
                f"p50={p50 * 1e3:.3f} ms p90={p90 * 1e3:.3f} ms"
            )


async def _ingest_times(engines: int, blocks_per_batch: int, batches: int) -> list[float]:
    """Seconds per event batch applied by the store (decode, re-key, index), ``engines``
    publishers taking turns: each batch is one request's new blocks, chained on the last."""
    from switchyard.kvstore.memory import MemoryIndex
    from switchyard.kvstore.store import KVStore
    from switchyard.mock.engine.events import BlockStored, KVEventBatch
    from switchyard.mock.kvevents import encode_batch

    store = KVStore(MemoryIndex(), block_size=16)
    parents: dict[int, int | None] = {}
    times: list[float] = []
    next_hash = 1
    for n in range(batches):
        engine = n % engines
        hashes: list[int | bytes] = list(range(next_hash, next_hash + blocks_per_batch))
        tokens = [(next_hash * 7 + i) % 8000 for i in range(16 * blocks_per_batch)]
        event = BlockStored(hashes, parents.get(engine), tokens, 16)
        payload = encode_batch(KVEventBatch(time.time(), [event]))
        parents[engine] = next_hash + blocks_per_batch - 1
        next_hash += blocks_per_batch
        t0 = time.perf_counter()
        await store.ingest(f"engine-{engine}", payload, seq=n // engines)
        times.append(time.perf_counter() - t0)
    return times


def ingest_bench(args: argparse.Namespace) -> None:
    """What KV events cost the event loop: per batch (a stall of request handling) and
    per block, from many engines."""
    print(f"KV-event ingestion, load {os.getloadavg()[0]:.1f}")
    for engines, blocks in ((8, 13), (400, 13), (400, 128), (400, 512)):
        times = sorted(asyncio.run(_ingest_times(engines, blocks, args.requests)))
        p50, p99 = (percentile(times, q) or 0.0 for q in (50, 99))
        print(
            f"{engines:>4} engines, {blocks:>3} blocks/batch: batch p50 {p50 * 1e3:.3f} ms "
            f"p99 {p99 * 1e3:.3f} ms max {times[-1] * 1e3:.3f} ms; "
            f"{p50 / blocks * 1e6:.1f} us/block at p50"
        )


async def _sibling_costs(workers: int, syncs: int, placements: int) -> tuple[list[float], float]:
    """CPU seconds per counts sync (send ours, fold a sibling's, ``workers`` all busy), with
    counts changing between syncs and unchanged, and per placement of a 2,000-token prompt
    shared (publish, receive, record): two processes' ends of the bus in this one."""
    import tempfile

    from switchyard.balancer import BalancerSettings, Fleet, WorkerSpec
    from switchyard.balancer.siblings import SiblingBus, SiblingShare
    from switchyard.kvstore.store import KVStore
    from switchyard.router.kv import EmbeddedPrefixes

    with tempfile.TemporaryDirectory() as tmp:
        specs = [WorkerSpec.parse(f"http://10.0.{i // 250}.{i % 250}:8000") for i in range(workers)]
        fleets = [Fleet(BalancerSettings(sibling_sync_interval_s=3600), specs) for _ in range(2)]
        buses = [SiblingBus(tmp) for _ in range(2)]
        shares = [SiblingShare(f, b) for f, b in zip(fleets, buses, strict=True)]
        stores = [KVStore(block_size=16) for _ in range(2)]
        sources = [EmbeddedPrefixes(s, siblings=b) for s, b in zip(stores, buses, strict=True)]
        for bus, share, source in zip(buses, shares, sources, strict=True):
            await bus.start()
            await share.start()
            await source.start()
        for fleet in fleets:
            for worker in fleet.workers():
                fleet.begin(worker, prompt_tokens=100)
        await asyncio.sleep(0.5)  # the SUB sockets connect
        per_sync: list[float] = []
        for changing in (True, False):
            t0 = time.process_time()
            for n in range(syncs):
                for fleet, share in zip(fleets, shares, strict=True):
                    if changing:  # a request starts on some worker between two syncs
                        fleet.begin(fleet.workers()[n % workers], prompt_tokens=10)
                    share.sync()
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
            per_sync.append((time.process_time() - t0) / (2 * syncs))
        keys = stores[0].keys_for(list(range(2000)))
        t0 = time.process_time()
        for n in range(placements):
            await sources[0].place(keys, f"http://engine-{n % 8}:8000", 0, 30.0)
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        per_place = (time.process_time() - t0) / placements
        for bus, share, source in zip(buses, shares, sources, strict=True):
            await source.stop()
            await share.stop()
            await bus.stop()
    return per_sync, per_place


def siblings_bench(args: argparse.Namespace) -> None:
    """What sharing state between a router's processes costs (the sibling bus)."""
    for workers in (8, 400):
        (changing, still), per_place = asyncio.run(_sibling_costs(workers, 500, args.requests))
        print(
            f"{workers:>3} workers: per counts sync and process {changing * 1e6:.0f} us CPU "
            f"when they changed ({changing * 50 * 100:.2f}% of a core at 50 syncs/s), "
            f"{still * 1e6:.0f} us when not; {per_place * 1e6:.0f} us per 2,000-token "
            "placement shared (both ends, recorded locally too)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.router_cpu", description=__doc__.split("\n")[0]
    )
    ap.add_argument("workloads", nargs="*", default=["multiturn", "mooncake"])
    ap.add_argument("--requests", type=int, default=300, help="requests per workload")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS))
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--speed", type=float, default=10.0, help="mock engine speed-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--against", help="also run our routers from this git revision")
    ap.add_argument("--micro", action="store_true", help="schedule lookup per turn, in-process")
    ap.add_argument("--ingest", action="store_true", help="KV-event ingestion cost, in-process")
    ap.add_argument("--idle", action="store_true", help="each router's CPU with no traffic")
    ap.add_argument("--siblings", action="store_true", help="sharing between processes, in-process")
    ap.add_argument("--idle-s", type=float, default=20.0, help="seconds measured with --idle")
    args = ap.parse_args(argv)
    bad = [w for w in args.workloads if w not in ("multiturn", "mooncake")]
    if bad or args.requests < 1 or args.repeats < 1:
        ap.error(f"workloads are multiturn and mooncake; counts must be positive ({bad or ''})")
    if args.idle_s <= 0:
        ap.error("--idle-s must be positive")
    if args.idle:
        idle_bench(args)
    elif args.ingest:
        ingest_bench(args)
    elif args.micro:
        micro_bench(args)
    elif args.siblings:
        siblings_bench(args)
    else:
        replay_bench(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
