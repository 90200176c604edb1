"""``switchyard plan``: the fewest engines that meet a latency objective, found by simulation.

Each probe is one ``switchyard simulate`` run of the workload at the given size; sizes
double until the objective holds, then a bisection finds the smallest that does (the
objective is assumed to hold at every larger size). The policies are then compared at
that size. Prefill:decode ratios are not searched: the simulator runs unified workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.simulate import PolicyRun, SimConfig, simulate

ASSUMPTIONS = (
    "timing model: the mock engine's step time, BLIS fit for Llama-3.1-8B-Instruct on one "
    "H100 (TP=1, vLLM v0.8.4) plus a context term estimated from HBM bandwidth "
    "(mockengine/engine/config.py; --mock-config replaces it); router decisions are "
    "instant and KV events immediate; unified workers only (no prefill:decode search)."
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


@dataclass
class Plan:
    objective: Objective
    policy: str
    probes: dict[int, PolicyRun] = field(default_factory=dict)
    engines: int | None = None  # the fewest that met the objective, None if none did
    compared: list[PolicyRun] = field(default_factory=list)


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


def assumptions(cfg: SimConfig) -> str:
    """What the answer rests on, with the timing coefficients actually used."""
    e = cfg.engine_config()
    return (
        f"{ASSUMPTIONS} Step = {e.step_base_us:g} us + {e.prefill_token_us:g} us/prefill token "
        f"+ {e.decode_token_us:g} us/decode seq + {e.context_token_us:g} us/context token; "
        f"{e.num_gpu_blocks} KV blocks of {e.block_size} tokens, max {e.max_num_seqs} seqs."
    )
