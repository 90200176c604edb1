"""How fast the mock engine model runs: step CPU cost, real-clock streaming, virtual clock.

    python -m bench.mock_sim [--requests 20000] [--engines 16] [--seed 0]
                             [--trace traces/mooncake_conversation_trace.jsonl]

Prints, reproducibly for a seed:
- the CPU cost of one engine step for a 256-sequence decode batch (target: well under 1 ms);
- tokens/s the real-clock driver streams to 1,024 concurrent consumers when the model's
  own time is compressed away (the driver's overhead, no HTTP);
- simulated requests per wall second of the virtual clock on a fleet with shared prefixes;
- with ``--trace``, the same for the first ``--trace-requests`` requests of the Mooncake
  conversation trace (12k-token prompts; each 512-token hash id becomes a fixed token
  block), routed by prefix affinity and round robin, with the prefix hit rate of each.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from pathlib import Path

from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import EngineCore
from switchyard.mock.engine.driver import RealClockEngine
from switchyard.mock.engine.virtual import VirtualFleet


def bench_step(steps: int = 500) -> float:
    core = EngineCore(EngineConfig())
    for i in range(256):
        core.add_request(EngineRequest(f"r{i}", list(range(i * 1000, i * 1000 + 500)), 2000))
    t = 0.0
    while core.waiting or any(s.num_generated == 0 for s in core.running):
        t += core.step(t).duration
    start = time.perf_counter()
    for _ in range(steps):
        t += core.step(t).duration
    return (time.perf_counter() - start) / steps


async def bench_stream(streams: int = 1024, tokens: int = 200) -> tuple[float, int]:
    engine = RealClockEngine(EngineConfig(max_num_seqs=streams, num_gpu_blocks=40_000, speed=1e9))
    await engine.start()

    async def consume(i: int) -> int:
        n = 0
        async for _ in engine.generate(EngineRequest(f"s{i}", [i + 1] * 32, tokens)):
            n += 1
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(consume(i) for i in range(streams)))
    elapsed = time.perf_counter() - start
    await engine.stop()
    total = sum(counts)
    return total / elapsed, total


def bench_virtual(requests: int, engines: int, seed: int) -> tuple[float, float, float]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(512)] for _ in range(64)]

    def route(fleet: VirtualFleet, now: float, req: EngineRequest) -> int:
        return hash(tuple(req.prompt_token_ids[:16])) % engines

    fleet = VirtualFleet([EngineConfig() for _ in range(engines)], route, record_token_times=False)
    rate = engines * 8.0  # requests per simulated second: a busy but stable fleet
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        prompt = prefixes[rng.randrange(len(prefixes))] + [
            rng.randrange(50_000) for _ in range(rng.randrange(16, 256))
        ]
        fleet.submit(t, None, EngineRequest(f"q{i}", prompt, rng.randrange(16, 256)))
    start = time.perf_counter()
    done = fleet.run()
    elapsed = time.perf_counter() - start
    hits = sum(r.num_cached_tokens for r in done) / sum(r.prompt_tokens for r in done)
    return len(done) / elapsed, fleet.now, hits


def bench_trace(
    path: Path, requests: int, engines: int, policy: str
) -> tuple[float, float, float, float]:
    rows = []
    with path.open() as f:
        for line in itertools.islice(f, requests):
            rows.append(json.loads(line))

    def block(hash_id: int) -> range:
        return range(hash_id * 512, hash_id * 512 + 512)  # distinct ids per hash id

    rr = itertools.count()

    def route(fleet: VirtualFleet, now: float, req: EngineRequest) -> int:
        if policy == "round_robin":
            return next(rr) % engines
        return hash(tuple(req.prompt_token_ids[512:528])) % engines  # first non-shared block

    config = EngineConfig(num_gpu_blocks=29_000, max_num_batched_tokens=8192)
    fleet = VirtualFleet([config] * engines, route, record_token_times=False)
    start = time.perf_counter()
    for i, row in enumerate(rows):
        t = row["timestamp"] / 1000.0
        fleet.run(until=t)  # keep only arrived requests' prompts in memory
        prompt = [tok for h in row["hash_ids"] for tok in block(h)][: row["input_length"]]
        fleet.submit(t, None, EngineRequest(f"m{i}", prompt, max(1, row["output_length"])))
    done = fleet.run()
    elapsed = time.perf_counter() - start
    hits = sum(r.num_cached_tokens for r in done) / sum(r.prompt_tokens for r in done)
    ttfts = sorted(r.ttft for r in done if r.ttft is not None)
    return len(done) / elapsed, hits, ttfts[len(ttfts) // 2], ttfts[int(len(ttfts) * 0.9)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--trace-requests", type=int, default=2000)
    ap.add_argument("--trace-engines", type=int, default=4)
    args = ap.parse_args()
    step = bench_step()
    print(f"engine step, 256-sequence decode batch: {step * 1e6:.0f} us CPU")
    tps, total = asyncio.run(bench_stream())
    print(f"real-clock driver, 1024 streams: {tps:,.0f} tokens/s ({total:,} tokens)")
    rps, span, hits = bench_virtual(args.requests, args.engines, args.seed)
    print(
        f"virtual clock, {args.engines} engines, {args.requests:,} requests: "
        f"{rps:,.0f} simulated requests per wall second "
        f"({span:,.1f} s simulated, prefix hit rate {hits:.2f})"
    )
    if args.trace is not None:
        for policy in ("prefix_affinity", "round_robin"):
            rps, hits, p50, p90 = bench_trace(
                args.trace, args.trace_requests, args.trace_engines, policy
            )
            print(
                f"virtual clock, Mooncake trace, first {args.trace_requests:,} requests, "
                f"{args.trace_engines} engines, {policy}: {rps:,.0f} simulated requests per "
                f"wall second, prefix hit rate {hits:.2f}, TTFT p50 {p50 * 1e3:,.0f} ms "
                f"p90 {p90 * 1e3:,.0f} ms"
            )


if __name__ == "__main__":
    main()
