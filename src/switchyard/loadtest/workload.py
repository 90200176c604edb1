"""What a workload is: a seeded, fully determined list of timed chat requests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]


@dataclass(frozen=True)
class Request:
    """One request of a replay: sent ``arrival_s`` after the start, whatever else happens."""

    index: int
    arrival_s: float
    messages: list[Message]
    max_tokens: int
    session: str = ""
    tenant: str = ""
    api_key: str = ""  # sent as ``Authorization: Bearer``: the router names the tenant by it
    headers: tuple[tuple[str, str], ...] = ()  # more request headers (``x-priority``, ...)

    def body(self, model: str) -> dict[str, Any]:
        return {
            "model": model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


@dataclass
class Workload:
    name: str
    seed: int
    requests: list[Request]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "requests": len(self.requests),
            "duration_s": round(self.duration_s, 3),
            **self.params,
        }


def poisson_arrivals(rng: random.Random, rate: float, count: int) -> list[float]:
    """``count`` open-loop arrival times of a Poisson process at ``rate`` per second."""
    t = 0.0
    out = []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out
