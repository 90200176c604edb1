"""The Mooncake conversation trace (FAST'25, Kimi traffic), replayed with real reuse.

Each trace line has ``hash_ids``: one id per 512-token block of the prompt, equal ids
meaning reusable KV. Every id becomes a fixed text block built from the id (the same
words wherever the id appears), so prompts that share leading ids share leading
tokens exactly and any router sees the trace's true reuse structure. A prompt's last
block is cut to the trace's ``input_length``; a shorter cut is a prefix of a longer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from switchyard.loadtest.text import WordBank, default_bank
from switchyard.loadtest.workload import Request, Workload

TRACE_BLOCK_TOKENS = 512
# Not shipped with the package: relative to the working directory, so run from the
# repository root this is its traces/ directory (see traces/README.md there).
DEFAULT_TRACE = Path("traces") / "mooncake_conversation_trace.jsonl"


@dataclass
class MooncakeParams:
    trace: str = str(DEFAULT_TRACE)
    # Arrival time = trace time / speedup.
    speedup: float = 1.0
    start: int = 0
    limit: int | None = None
    # Tokens per hash id: 512 is the trace's own; smaller shrinks every prompt by the
    # same factor (cheaper on a small machine) and keeps the reuse structure.
    block_tokens: int = TRACE_BLOCK_TOKENS
    # Output lengths above this are cut (decode streams dominate client CPU).
    max_output_tokens: int | None = None


def block_text(bank: WordBank, seed: int, hash_id: int, n_tokens: int) -> str:
    return bank.text(f"mooncake:{seed}:{hash_id}", n_tokens)


def mooncake(seed: int, p: MooncakeParams, bank: WordBank | None = None) -> Workload:
    bank = bank or default_bank()
    path = Path(p.trace)
    if not path.exists():
        raise ValueError(f"Mooncake trace not found at {path}: pass its path (trace=FILE)")
    lines = path.read_text().splitlines()
    end = None if p.limit is None else p.start + p.limit
    rows = [json.loads(line) for line in lines[p.start : end] if line.strip()]
    scale = p.block_tokens / TRACE_BLOCK_TOKENS
    t0 = rows[0]["timestamp"] if rows else 0
    requests = []
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        total = max(1, round(row["input_length"] * scale))
        parts = []
        for k, h in enumerate(ids):
            n = min(p.block_tokens, total - k * p.block_tokens)
            if n <= 0:
                break
            parts.append(block_text(bank, seed, h, n))
        out = max(1, int(row["output_length"]))
        if p.max_output_tokens is not None:
            out = min(out, p.max_output_tokens)
        arrival = (row["timestamp"] - t0) / 1000.0 / p.speedup
        messages = [{"role": "user", "content": "".join(parts)}]
        requests.append(Request(i, arrival, messages, out, f"m{p.start + i}", ""))
    return Workload("mooncake", seed, requests, dict(vars(p)))
