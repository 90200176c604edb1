"""Fault injection: what a flaky engine does to a router, by flag or ``POST /admin/faults``.

Kinds: ``error`` (answer ``error_rate`` of requests with one of ``error_codes``),
``latency`` (delay ``latency_rate`` of requests by ``latency_ms``), ``hang`` (accept
``hang_rate`` of requests and never answer), ``crash`` (the process exits when request
``crash_after + 1`` arrives), ``slow_stream`` (``slow_stream_ms`` between chunks),
``drop`` (with probability ``drop_rate``, cut the connection after ``drop_after_tokens``
streamed tokens), ``kv_gap`` (skip that many KV-event sequence numbers) and ``kv_drop``
(keep that many KV-event batches off the wire but in the replay buffer).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from starlette.types import Receive, Send

from switchyard.mock import openai_shapes as shapes
from switchyard.mock.asgi import JSON, respond
from switchyard.mock.metrics import EngineMetrics

FAULT_FIELDS = (
    "error_rate",
    "error_codes",
    "latency_rate",
    "latency_ms",
    "hang_rate",
    "crash_after",
    "slow_stream_ms",
    "drop_after_tokens",
    "drop_rate",
)


class DropConnection(Exception):
    """Raised mid-stream so the server aborts the connection without a clean end."""


@dataclass
class Faults:
    error_rate: float = 0.0
    error_codes: list[int] = field(default_factory=lambda: [500])
    latency_rate: float = 0.0
    latency_ms: float = 0.0
    hang_rate: float = 0.0
    crash_after: int = 0
    slow_stream_ms: float = 0.0
    drop_after_tokens: int = 0
    drop_rate: float = 1.0
    seed: int = 0
    served: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; unknown keys or bad types raise ValueError."""
        types = {f.name: f.type for f in fields(self)}
        for key, value in changes.items():
            if key not in FAULT_FIELDS:
                raise ValueError(f"unknown fault setting {key!r}")
            if key == "error_codes":
                if (
                    not isinstance(value, list)
                    or not value
                    or not all(isinstance(c, int) and 400 <= c <= 599 for c in value)
                ):
                    raise ValueError("error_codes must be a non-empty list of 4xx/5xx codes")
            elif not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be a non-negative number ({types[key]})")
            setattr(self, key, value)

    def describe(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: data[k] for k in (*FAULT_FIELDS, "served")}

    @property
    def active(self) -> bool:
        return bool(
            self.error_rate
            or self.latency_rate
            or self.hang_rate
            or self.crash_after
            or self.slow_stream_ms
            or self.drop_after_tokens
        )

    def should_crash(self) -> bool:
        """Count one arriving request; True once ``crash_after`` were already served."""
        self.served += 1
        return bool(self.crash_after) and self.served > self.crash_after

    def error_status(self) -> int | None:
        if self.error_rate and self._rng.random() < self.error_rate:
            return self._rng.choice(self.error_codes)
        return None

    def latency_s(self) -> float:
        if self.latency_rate and self._rng.random() < self.latency_rate:
            return self.latency_ms / 1000.0
        return 0.0

    def should_hang(self) -> bool:
        return bool(self.hang_rate) and self._rng.random() < self.hang_rate

    def drop_at(self) -> int:
        """Streamed-token count after which to cut this request's connection (0: never)."""
        if self.drop_after_tokens and self._rng.random() < self.drop_rate:
            return self.drop_after_tokens
        return 0


async def inject(
    faults: Faults,
    metrics: EngineMetrics,
    receive: Receive,
    send: Send,
    rid_header: tuple[bytes, bytes],
) -> bool:
    """Apply request-level faults; True when the request was answered (or swallowed)."""
    if faults.should_crash():
        sys.stderr.write(f"mock engine: crash fault after {faults.crash_after} requests\n")
        sys.stderr.flush()
        os._exit(3)
    status = faults.error_status()
    if status is not None:
        metrics.fault("error")
        body = shapes.error_body(status, f"injected fault: HTTP {status}")
        await respond(send, status, body, JSON, [rid_header])
        return True
    if faults.should_hang():
        metrics.fault("hang")
        while (await receive())["type"] != "http.disconnect":
            continue
        return True
    delay = faults.latency_s()
    if delay:
        metrics.fault("latency")
        await asyncio.sleep(delay)
    return False
