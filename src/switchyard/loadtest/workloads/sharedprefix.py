"""Generated shared prefix: G groups, each a long common prefix with many short suffixes.

The shape of few-shot prompts, RAG over a fixed document, or agents with a long tool
preamble: requests of one group share their first ``prefix_tokens`` tokens exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from switchyard.loadtest.text import WordBank, default_bank
from switchyard.loadtest.workload import Request, Workload, poisson_arrivals


@dataclass
class SharedPrefixParams:
    rate: float = 8.0
    duration_s: float = 20.0
    groups: int = 8
    prefix_tokens: int = 2000
    suffix_tokens: tuple[int, int] = (50, 200)
    max_tokens: int = 32


def shared_prefix(seed: int, p: SharedPrefixParams, bank: WordBank | None = None) -> Workload:
    bank = bank or default_bank()
    rng = random.Random(f"sharedprefix:{seed}")
    prefixes = [bank.text(f"prefix:{seed}:{g}", p.prefix_tokens) for g in range(p.groups)]
    count = max(1, int(p.rate * p.duration_s))
    requests = []
    for i, t in enumerate(poisson_arrivals(rng, p.rate, count)):
        g = rng.randrange(p.groups)
        suffix = bank.text(f"suffix:{seed}:{i}", rng.randint(*p.suffix_tokens))
        messages = [{"role": "user", "content": prefixes[g] + suffix}]
        requests.append(Request(i, t, messages, p.max_tokens, f"r{i}", f"g{g}"))
    return Workload("shared_prefix", seed, requests, dict(vars(p)))
