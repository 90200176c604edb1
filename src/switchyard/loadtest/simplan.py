"""``switchyard plan``: the fewest engines that meet a latency objective, found by simulation.

Each probe is one ``switchyard simulate`` run of the workload at the given size; sizes
double until the objective holds, then a bisection finds the smallest that does (the
objective is assumed to hold at every larger size). The policies are then compared at
that size.

``plan_split`` searches the prefill:decode ratio (xPyD) of a fleet of a given size: one
simulation of the P/D pools per split (every split up to 16 engines, 15 spread ones
beyond); the best split meets the objective with the most headroom.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from switchyard.loadtest.simulate import PolicyRun, SimConfig, simulate

ASSUMPTIONS = (
    "timing model: the mock engine's step time, BLIS fit for Llama-3.1-8B-Instruct on one "
    "H100 (TP=1, vLLM v0.8.4) plus a context term estimated from HBM bandwidth "
    "(src/switchyard/mock/engine/config.py; --mock-config replaces it); router decisions are "
    "instant and KV events immediate."
)
UNIFIED = "Unified workers only (no prefill:decode split)."
SPLIT = (
    "P/D pools: every request disaggregated (vLLM's flow, no decider), a prefill's blocks "
    "held until the decode leg's first token; KV pull {us:g} us per block."
)


@dataclass
class Objective:
    ttft_p90_ms: float
    tpot_p90_ms: float

    def met(self, run: PolicyRun) -> bool:
        ttft = run.summary.ttft_ms["p90"]
        tpot = run.summary.tpot_ms["p90"]
        return (
            run.summary.errors == 0
            and ttft is not None
            and ttft <= self.ttft_p90_ms
            and (tpot is None or tpot <= self.tpot_p90_ms)
        )

    def figures(self, run: PolicyRun) -> dict[str, Any]:
        """What a plan's tables show of one run, for ``--json``."""
        s = run.summary
        return {
            "ttft_p90_ms": _rounded(s.ttft_ms["p90"]),
            "tpot_p90_ms": _rounded(s.tpot_ms["p90"]),
            "hit_rate": round(s.hit_rate, 4),
            "goodput_rps": round(s.goodput_rps, 3),
            "errors": s.errors,
            "met": self.met(run),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _finite(value: float) -> float | None:
    """JSON has no infinity: a split that served no first token has no headroom figure."""
    return round(value, 4) if math.isfinite(value) else None


@dataclass
class Plan:
    objective: Objective
    policy: str
    probes: dict[int, PolicyRun] = field(default_factory=dict)
    engines: int | None = None  # the fewest that met the objective, None if none did
    compared: list[PolicyRun] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The answer and every probe, the one line ``plan --json`` ends with."""
        fig = self.objective.figures
        return {
            "objective": dataclasses.asdict(self.objective),
            "policy": self.policy,
            "engines": self.engines,
            "probes": [{"engines": n, **fig(run)} for n, run in sorted(self.probes.items())],
            "compared": [
                {"policy": run.policy, "engines": self.engines, **fig(run)} for run in self.compared
            ],
        }


def plan(
    base: SimConfig,
    objective: Objective,
    policy: str,
    compare: list[str],
    max_engines: int,
    on_probe: Callable[[int, PolicyRun], None] | None = None,
) -> Plan:
    """Search engine counts for ``policy``; compare ``compare`` at the size found."""
    if max_engines < 1:
        raise ValueError("max engines must be at least 1")
    result = Plan(objective, policy)

    def probe(n: int) -> bool:
        if n not in result.probes:
            cfg = dataclasses.replace(base, engines=n, policies=[policy])
            run = simulate(cfg).runs[0]
            result.probes[n] = run
            if on_probe is not None:
                on_probe(n, run)
        return objective.met(result.probes[n])

    low, high = 0, 1  # low fails (0 engines cannot serve), high is the candidate
    while not probe(high):
        if high >= max_engines:
            return result
        low, high = high, min(high * 2, max_engines)
    while high - low > 1:
        mid = (low + high) // 2
        if probe(mid):
            high = mid
        else:
            low = mid
    result.engines = high
    others = [p for p in compare if p != policy]
    if others:
        cfg = dataclasses.replace(base, engines=high, policies=others)
        result.compared = [result.probes[high], *simulate(cfg).runs]
    else:
        result.compared = [result.probes[high]]
    return result


@dataclass
class SplitPlan:
    objective: Objective
    policy: str
    engines: int
    runs: dict[int, PolicyRun] = field(default_factory=dict)  # prefill engines -> run
    best: int | None = None  # prefill engines of the best split, None if none met it

    def headroom(self, prefill: int) -> float:
        """The higher of TTFT p90 and TPOT p90 as shares of their objectives (<= 1 meets)."""
        s = self.runs[prefill].summary
        ttft = (s.ttft_ms["p90"] or float("inf")) / self.objective.ttft_p90_ms
        tpot = (s.tpot_ms["p90"] or 0.0) / self.objective.tpot_p90_ms
        return max(ttft, tpot)

    def as_json(self) -> dict[str, Any]:
        """Every split tried and the best, the one line ``plan --pd-engines --json`` ends
        with."""
        best = self.best
        return {
            "objective": dataclasses.asdict(self.objective),
            "policy": self.policy,
            "engines": self.engines,
            "splits": [
                {
                    "prefill": p,
                    "decode": self.engines - p,
                    **self.objective.figures(run),
                    "headroom": _finite(self.headroom(p)),
                }
                for p, run in sorted(self.runs.items())
            ],
            "best": None if best is None else {"prefill": best, "decode": self.engines - best},
        }


def splits(engines: int) -> list[int]:
    """Prefill engine counts tried for a fleet of ``engines``."""
    if engines <= 16:
        return list(range(1, engines))
    return sorted({max(1, min(engines - 1, round(engines * k / 16))) for k in range(1, 16)})


def plan_split(
    base: SimConfig,
    objective: Objective,
    policy: str,
    engines: int,
    on_probe: Callable[[int, PolicyRun], None] | None = None,
) -> SplitPlan:
    """Simulate each xPyD split of ``engines``; the best meets the objective with the most
    headroom."""
    if engines < 2:
        raise ValueError("a prefill:decode split needs at least 2 engines")
    result = SplitPlan(objective, policy, engines)
    for prefill in splits(engines):
        cfg = dataclasses.replace(base, engines=engines, prefill_engines=prefill, policies=[policy])
        run = simulate(cfg).runs[0]
        result.runs[prefill] = run
        if on_probe is not None:
            on_probe(prefill, run)
    met = [p for p, run in result.runs.items() if objective.met(run)]
    result.best = min(met, key=result.headroom) if met else None
    return result


def assumptions(cfg: SimConfig) -> str:
    """What the answer rests on, with the timing coefficients actually used."""
    e = cfg.engine_config()
    pools = SPLIT.format(us=e.kv_transfer_us_per_block) if cfg.prefill_engines else UNIFIED
    return (
        f"{ASSUMPTIONS} {pools} "
        f"Step = {e.step_base_us:g} us + {e.prefill_token_us:g} us/prefill token "
        f"+ {e.decode_token_us:g} us/decode seq + {e.context_token_us:g} us/context token; "
        f"{e.num_gpu_blocks} KV blocks of {e.block_size} tokens, max {e.max_num_seqs} seqs."
    )
