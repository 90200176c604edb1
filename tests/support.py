"""Test support: the package's process launcher, the test tokenizer, metric reading."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from switchyard.loadtest.procs import Server, free_port, free_port_block, redis_server, wait_http
from switchyard.loadtest.prom import values
from switchyard.mock.settings import DEFAULT_TOKENIZER

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = Path(DEFAULT_TOKENIZER)

__all__ = [
    "REPO",
    "TOKENIZER_DIR",
    "Server",
    "free_port",
    "free_port_block",
    "metric",
    "one_process",
    "redis_server",
    "wait_http",
]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``; none is a failure."""
    found = values(text, name, **labels)
    assert found, f"{name}{labels} not in metrics"
    return sum(found)


def one_process(args: Sequence[str] = ()) -> list[str]:
    """``--processes 1`` unless ``args`` set the count: under the default (one router process
    per core) which process takes a connection, with its own counters, caps and round-robin
    turn, would be part of every test that starts a router."""
    return [] if "--processes" in args else ["--processes", "1"]
