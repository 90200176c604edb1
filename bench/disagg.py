"""P/D disaggregation on the mock timing model: unified vs 1P:1D vs 2P:2D vs conditional P/D.

Runs on the virtual clock (``src/switchyard/mock/engine/virtual.py``: the same engine core as the
mock servers, in model time, deterministic), replaying the Mooncake conversation trace
(each hash id is a fixed 512-token block, so prefix reuse is the trace's). Every
configuration has the same number of engines and the same request stream.

The P/D flow is the vLLM one the router runs: a prefill leg (``max_tokens=1``, KV held)
on a prefill engine, then a decode leg on a decode engine with the prompt marked as
remotely prefilled (the core charges the pull, ``kv_transfer_us_per_block`` per block not
already local, before the sequence decodes). The held blocks are released when the decode
leg is submitted. Conditional P/D sends a request straight to its decode engine when that
engine already holds all but ``--threshold`` tokens of the prompt (llm-d's decider).

Routing is the same cost model in every pool: uncached prompt tokens on the engine
(its prefix-cache oracle) plus a queueing penalty; decode pools route by load only.

Reported per configuration: TTFT p50/p90, ITL p90 (all inter-token gaps), the share of
requests meeting the objectives (TTFT <= --ttft-slo and the request's p90 inter-token gap
<= --tbt-slo) and goodput = such requests per second of trace time.

    python -m bench.disagg [--trace FILE] [--requests 600] [--time-scale 3] [--tbt-slo 0.03]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from switchyard.loadtest.workloads.mooncake import DEFAULT_TRACE
from switchyard.mock.engine.api import EngineRequest
from switchyard.mock.engine.config import EngineConfig
from switchyard.mock.engine.core import EngineCore
from switchyard.mock.engine.virtual import RequestResult, VirtualFleet

BLOCK = 512


@dataclass(slots=True)
class Job:
    arrival: float
    prompt: list[int]
    output: int


def load(path: Path, requests: int, time_scale: float, max_output: int) -> list[Job]:
    jobs = []
    with path.open() as f:
        for line, _ in zip(f, range(requests), strict=False):
            row = json.loads(line)
            prompt = [tok for h in row["hash_ids"] for tok in range(h * BLOCK, h * BLOCK + BLOCK)][
                : row["input_length"]
            ]
            output = max(1, min(max_output, row["output_length"]))
            jobs.append(Job(row["timestamp"] / 1000.0 / time_scale, prompt, output))
    return jobs


def prefill_cost(core: EngineCore, prompt: list[int]) -> float:
    """Uncached prompt tokens here, plus a token-equivalent penalty for the queue."""
    uncached = len(prompt) - core.probe_prefix(prompt)
    return uncached + 4096 * len(core.waiting) + 16 * len(core.running)


def load_cost(core: EngineCore) -> float:
    return len(core.waiting) * 1000 + len(core.running)


def best(indices: list[int], cost: Callable[[int], float]) -> int:
    return min(indices, key=lambda i: (cost(i), i))


@dataclass(slots=True)
class Outcome:
    name: str
    ttft: list[float]
    gaps: list[float]
    good: int
    total: int
    horizon: float
    direct: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(
    name: str,
    jobs: list[Job],
    unified: int,
    prefill: int,
    decode: int,
    threshold: int | None,
    slo: tuple[float, float],
    config: EngineConfig,
) -> Outcome:
    n = unified + prefill + decode
    fleet = VirtualFleet([config] * n)
    cores = fleet.cores
    u_idx = list(range(unified))
    p_idx = list(range(unified, unified + prefill))
    d_idx = list(range(unified + prefill, n))
    arrival: dict[str, float] = {}
    legs: dict[str, tuple[int, list[int], int]] = {}  # prefill rid -> (job, prompt, output)
    final: dict[str, RequestResult] = {}
    direct = 0

    def on_finish(fleet: VirtualFleet, res: RequestResult) -> None:
        leg = legs.pop(res.request_id, None)
        if leg is None:
            return
        i, prompt, output = leg
        d = best(d_idx, lambda e: load_cost(cores[e]))
        rid = f"d{i}"
        fleet.submit(
            fleet.now,
            d,
            EngineRequest(rid, prompt, output, remote_prefilled_tokens=len(prompt)),
        )
        fleet.release_held(res.engine_index, res.request_id)

    fleet.on_finish = on_finish
    for i, job in enumerate(jobs):
        fleet.run(until=job.arrival)
        rid = f"r{i}"
        arrival[rid] = job.arrival
        if unified:
            e = best(u_idx, lambda e, prompt=job.prompt: prefill_cost(cores[e], prompt))
            fleet.submit(job.arrival, e, EngineRequest(rid, job.prompt, job.output))
            continue
        if threshold is not None:
            d = best(d_idx, lambda e, prompt=job.prompt: prefill_cost(cores[e], prompt))
            if len(job.prompt) - cores[d].probe_prefix(job.prompt) < threshold:
                direct += 1
                fleet.submit(job.arrival, d, EngineRequest(f"d{i}", job.prompt, job.output))
                continue
        p = best(p_idx, lambda e, prompt=job.prompt: prefill_cost(cores[e], prompt))
        pid = f"p{i}"
        legs[pid] = (i, job.prompt, job.output)
        fleet.submit(job.arrival, p, EngineRequest(pid, job.prompt, 1, hold_kv_after_prefill=True))
    fleet.run()
    for rid, res in fleet.results.items():
        if rid[0] in "rd":
            final[f"r{rid[1:]}"] = res
    ttfts, gaps, good = [], [], 0
    for rid, res in final.items():
        if res.first_token_time is None:
            continue
        ttft = res.first_token_time - arrival[rid]
        own = res.itl
        ttfts.append(ttft)
        gaps.extend(own)
        if ttft <= slo[0] and (not own or percentile(own, 0.9) <= slo[1]):
            good += 1
    horizon = max(jobs[-1].arrival, 1e-9)
    return Outcome(name, ttfts, gaps, good, len(jobs), horizon, direct)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (JSONL)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--time-scale", type=float, default=3.0, help="arrival-rate multiplier")
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--ttft-slo", type=float, default=10.0, help="seconds")
    ap.add_argument("--tbt-slo", type=float, default=0.03, help="seconds, per-request p90 gap")
    ap.add_argument("--threshold", type=int, default=1024, help="conditional P/D, tokens")
    args = ap.parse_args()
    if not args.trace.is_file():
        ap.error(f"Mooncake trace not found at {args.trace}: pass its path (--trace FILE)")
    jobs = load(args.trace, args.requests, args.time_scale, args.max_output)
    config = EngineConfig()
    slo = (args.ttft_slo, args.tbt_slo)
    rate = len(jobs) / max(jobs[-1].arrival, 1e-9)
    print(
        f"{len(jobs)} Mooncake requests at {rate:.2f} req/s (x{args.time_scale:g}), mean prompt "
        f"{statistics.mean(len(j.prompt) for j in jobs):.0f} tokens, output <= {args.max_output}; "
        f"objectives TTFT <= {args.ttft_slo:g} s, p90 TBT <= {args.tbt_slo * 1e3:g} ms"
    )
    setups = [
        ("unified x2", 2, 0, 0, None),
        ("1P:1D", 0, 1, 1, None),
        ("unified x4", 4, 0, 0, None),
        ("2P:2D", 0, 2, 2, None),
        (f"2P:2D cond<{args.threshold}", 0, 2, 2, args.threshold),
    ]
    header = (
        f"{'setup':<20}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p90':>10}"
        f"{'in SLO':>8}{'goodput':>10}{'direct':>8}{'sim s':>7}"
    )
    print(header)
    results: dict[str, Outcome] = {}
    for name, u, p, d, thr in setups:
        started = time.perf_counter()
        out = run(name, jobs, u, p, d, thr, slo, config)
        results[name] = out
        print(
            f"{name:<20}{percentile(out.ttft, 0.5):>9.2f}s{percentile(out.ttft, 0.9):>9.2f}s"
            f"{percentile(out.gaps, 0.9) * 1e3:>8.1f}ms{out.good / out.total:>8.0%}"
            f"{out.good / out.horizon:>7.2f}r/s{out.direct:>8}{time.perf_counter() - started:>7.1f}"
        )
    for pd, uni in (("1P:1D", "unified x2"), ("2P:2D", "unified x4")):
        a, b = results[pd].good, results[uni].good
        print(f"goodput {pd} / {uni}: {a / b:.2f}x" if b else f"goodput {pd}: {a} vs 0")


if __name__ == "__main__":
    main()
