"""Random prompts with no reuse: the control where cache-aware routing must not hurt.

Every prompt is fresh text of random length, so no policy can hit the cache beyond
the chat template's few leading tokens; a good router then simply balances load.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from switchyard.loadtest.text import WordBank, default_bank
from switchyard.loadtest.workload import Request, Workload, poisson_arrivals


@dataclass
class RandomParams:
    rate: float = 8.0
    duration_s: float = 20.0
    prompt_tokens: tuple[int, int] = (200, 2000)
    max_tokens: int = 32


def random_prompts(seed: int, p: RandomParams, bank: WordBank | None = None) -> Workload:
    bank = bank or default_bank()
    rng = random.Random(f"random:{seed}")
    count = max(1, int(p.rate * p.duration_s))
    requests = []
    for i, t in enumerate(poisson_arrivals(rng, p.rate, count)):
        text = bank.text(f"random:{seed}:{i}", rng.randint(*p.prompt_tokens))
        messages = [{"role": "user", "content": text}]
        requests.append(Request(i, t, messages, p.max_tokens, f"r{i}", ""))
    return Workload("random", seed, requests, dict(vars(p)))
