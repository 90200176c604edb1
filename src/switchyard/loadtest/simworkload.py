"""Workloads as token ids, for the simulator.

Every named loadtest workload is tokenized exactly as a mock engine tokenizes its chat
messages (so a simulated run and an HTTP run of the same workload see the same tokens).
The Mooncake trace is the exception: tokenizing its ~12k-token prompts would cost more
than simulating them, so its token ids are built from the trace's block ids directly,
one fixed run of ids per block id (equal ids share tokens exactly, a cut block is a
prefix of the whole), one request at a time as it arrives. Its parameters are
``MooncakeParams``' (``speedup`` scales the rate, ``block_tokens`` the prompt size).

A workload whose requests carry API keys names each request's tenant as the router would:
by the tenant its key is configured for (the workload's own key -> tenant pairs), else
``"default"``; the simulator's flow control queues and shares by it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchyard.loadtest.ceiling import workload_prompts
from switchyard.loadtest.workload import Request, Workload
from switchyard.loadtest.workloads import WORKLOADS, build_workload
from switchyard.loadtest.workloads.mooncake import TRACE_BLOCK_TOKENS, MooncakeParams
from switchyard.mock.settings import DEFAULT_TOKENIZER
from switchyard.mock.tokenizer import ModelTokenizer
from switchyard.router.flow.identity import DEFAULT_TENANT

# One arrival: (index, arrival seconds, prompt token ids, output tokens).
Arrival = tuple[int, float, list[int], int]


@dataclass
class _Row:
    arrival_s: float
    input_tokens: int
    max_tokens: int
    hash_ids: list[int]


@dataclass
class SimWorkload:
    """Timed requests whose prompts are token ids (built on demand for large traces)."""

    name: str
    seed: int
    params: dict[str, Any]
    arrivals_s: list[float]
    max_tokens: list[int]
    output_token_ids: list[int] | None
    prompts_list: list[list[int]] | None = None
    rows: list[_Row] = field(default_factory=list)
    block_tokens: int = TRACE_BLOCK_TOKENS
    # Per request: its tenant (None: every request is the default tenant's) and its
    # priority band (None: every request is normal, 0).
    tenants: list[str] | None = None
    priorities: list[int] | None = None

    def tenant(self, index: int) -> str:
        return DEFAULT_TENANT if self.tenants is None else self.tenants[index]

    def priority(self, index: int) -> int:
        return 0 if self.priorities is None else self.priorities[index]

    def __len__(self) -> int:
        return len(self.arrivals_s)

    def prompt(self, index: int) -> list[int]:
        if self.prompts_list is not None:
            return self.prompts_list[index]
        row = self.rows[index]
        bt = self.block_tokens
        ids: list[int] = []
        for k, h in enumerate(row.hash_ids):
            n = min(bt, row.input_tokens - k * bt)
            if n <= 0:
                break
            start = h * bt
            ids.extend(range(start, start + n))
        return ids

    def prompt_len(self, index: int) -> int:
        """The prompt's length without building it."""
        if self.prompts_list is not None:
            return len(self.prompts_list[index])
        row = self.rows[index]
        return min(row.input_tokens, len(row.hash_ids) * self.block_tokens)

    def prompts(self) -> Iterator[list[int]]:
        return (self.prompt(i) for i in range(len(self)))

    def requests(self) -> Iterator[Arrival]:
        for i, (t, out) in enumerate(zip(self.arrivals_s, self.max_tokens, strict=True)):
            yield i, t, self.prompt(i), out

    def output_lengths(self) -> list[int]:
        return list(self.max_tokens)

    def as_workload(self) -> Workload:
        """The loadtest description (no messages) for reports."""
        requests = [
            Request(i, t, [], out, tenant="" if self.tenants is None else self.tenants[i])
            for i, (t, out) in enumerate(zip(self.arrivals_s, self.max_tokens, strict=True))
        ]
        return Workload(self.name, self.seed, requests, dict(self.params))


def sim_workload(name: str, seed: int, params: dict[str, Any]) -> SimWorkload:
    if name == "mooncake":
        return mooncake_tokens(seed, _params(MooncakeParams, params))
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    workload = build_workload(name, seed, **params)
    filler = ModelTokenizer(DEFAULT_TOKENIZER).filler_token_id
    return SimWorkload(
        workload.name,
        seed,
        dict(workload.params),
        [r.arrival_s for r in workload.requests],
        [r.max_tokens for r in workload.requests],
        [filler],
        prompts_list=workload_prompts(workload),
        tenants=_tenants(workload),
    )


def _tenants(workload: Workload) -> list[str] | None:
    """Each request's tenant as the router names it: by the tenant its API key is configured
    for (the key -> tenant pairs the workload sends), ``"default"`` without a key; None when
    no request carries a key."""
    keys = {r.api_key: r.tenant or DEFAULT_TENANT for r in workload.requests if r.api_key}
    if not keys:
        return None
    return [keys.get(r.api_key, DEFAULT_TENANT) for r in workload.requests]


def _params(cls: type[MooncakeParams], given: dict[str, Any]) -> MooncakeParams:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"workload 'mooncake' has no parameter(s) {', '.join(unknown)}")
    return cls(**{k: v for k, v in given.items() if v is not None})


def mooncake_tokens(seed: int, p: MooncakeParams) -> SimWorkload:
    path = Path(p.trace)
    if not path.exists():
        raise ValueError(f"Mooncake trace not found at {path}: pass its path (--trace FILE)")
    if p.speedup <= 0 or p.block_tokens <= 0:
        raise ValueError("mooncake speedup and block_tokens must be positive")
    end = None if p.limit is None else p.start + p.limit
    rows: list[_Row] = []
    scale = p.block_tokens / TRACE_BLOCK_TOKENS
    t0: float | None = None
    with path.open() as lines:
        for k, line in enumerate(lines):
            if k < p.start or not line.strip():
                continue
            if end is not None and k >= end:
                break
            raw = json.loads(line)
            t0 = raw["timestamp"] if t0 is None else t0
            out = max(1, int(raw["output_length"]))
            if p.max_output_tokens is not None:
                out = min(out, p.max_output_tokens)
            rows.append(
                _Row(
                    (raw["timestamp"] - t0) / 1000.0 / p.speedup,
                    max(1, round(raw["input_length"] * scale)),
                    out,
                    list(raw["hash_ids"]),
                )
            )
    return SimWorkload(
        "mooncake",
        seed,
        dict(vars(p)),
        [r.arrival_s for r in rows],
        [r.max_tokens for r in rows],
        None,
        rows=rows,
        block_tokens=p.block_tokens,
    )
