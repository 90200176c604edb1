"""What a chat turn costs in router-added TTFT, by the length of the history before it.

One mock engine (fast: ``--speed``), and in front of it Switchyard (``kv_aware``, exact
tokenizer) and smg (``cache_aware``, given the same tokenizer directory). One conversation
per system-prompt size; each turn appends a user message (and, from the second on, the
previous assistant answer) and is sent streamed, on one kept connection per target, to
the engine directly and through each router, in an order that rotates every turn. The
router-added time of a turn is its TTFT through the router less its TTFT direct; the table
gives the median over the turns, so a cost that grows with the history shows as a figure
that grows with the system prompt. ``--against REV ...`` adds our router run from a
worktree of each git revision, in the same rotation, for a before/after pair on one engine
(``--only-against``: not from this checkout)::

    python -m bench.turn_cost [--words 500 3000 12000] [--turns 32]
        [--routers kv_aware@1 smg:cache_aware] [--against REV ...] [--only-against]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import orjson

from switchyard.loadtest.compare import MODEL
from switchyard.loadtest.fleet import Engine, MockFleet
from switchyard.loadtest.routers import RouterSpec, RunningRouter, Unavailable, start_router
from switchyard.loadtest.text import default_bank
from switchyard.mock.settings import DEFAULT_TOKENIZER
from switchyard.net.httpclient import ConnectionPool
from tools.worktree import worktree

ROUTERS = ("kv_aware@1", "smg:cache_aware")
USER_WORDS = 40
MAX_TOKENS = 8
_JSON = {"content-type": "application/json"}


class _SmgWithTokenizer(RouterSpec):
    """smg given the tokenizer directory our router reads (its ``--tokenizer-path``)."""

    def command(self, engines: list[Engine], port: int, tokenizer: str, *rest: Any) -> list[str]:
        return [*super().command(engines, port, tokenizer, *rest), "--tokenizer-path", tokenizer]


def _spec(text: str) -> RouterSpec:
    spec = RouterSpec.parse(text)
    if spec.kind == "smg":
        return _SmgWithTokenizer(spec.label, spec.kind, spec.policy)
    return spec


def prose(seed: str, words: int) -> str:
    """``words`` single-token words in sentences and paragraphs, as a system prompt reads."""
    bank = default_bank().words
    rng = random.Random(seed)
    out: list[str] = []
    left = words
    while left > 0:
        n = min(left, rng.randint(6, 18))
        sentence = " ".join(bank[rng.randrange(len(bank))] for _ in range(n))
        out.append(sentence[0].upper() + sentence[1:] + ".")
        out.append("\n\n" if rng.random() < 0.2 else " ")
        left -= n
    return "".join(out).rstrip()


@dataclass
class Target:
    label: str
    url: str
    ttft_ms: list[float] = field(default_factory=list)


async def one_turn(pool: ConnectionPool, url: str, body: bytes) -> tuple[float, str]:
    """TTFT of a streamed chat in ms, and the answer's text."""
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    r = await pool.post(url + "/v1/chat/completions", body, _JSON)
    try:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        rest = b""
        while chunk := await r.readany():
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                for choice in orjson.loads(line[5:]).get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        text.append(piece)
    finally:
        r.close()
    if ttft is None:
        raise RuntimeError(f"{url}: the stream ended without a token")
    return ttft * 1e3, "".join(text)


async def conversation(
    engine_url: str, targets: list[Target], words: int, turns: int, seed: int
) -> None:
    """One conversation of ``turns`` turns, each sent to every target in rotating order."""
    pools = {t.label: ConnectionPool(connect_timeout_s=10.0, max_per_origin=1) for t in targets}
    warm = ConnectionPool(connect_timeout_s=10.0, max_per_origin=1)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": prose(f"turn-cost:{seed}:{words}", words)}
    ]
    try:
        for turn in range(turns + 1):
            question = prose(f"turn-cost:{seed}:{words}:user:{turn}", USER_WORDS)
            messages.append({"role": "user", "content": question})
            body = orjson.dumps(
                {
                    "model": MODEL,
                    "messages": messages,
                    "max_tokens": MAX_TOKENS,
                    "stream": True,
                    "temperature": 0,
                }
            )
            # The engine sees the turn once before any measured request: whichever target
            # came first would otherwise pay the engine's own first look at the new text.
            _, answer = await one_turn(warm, engine_url, body)
            order = targets[turn % len(targets) :] + targets[: turn % len(targets)]
            for target in order:
                ttft, _ = await one_turn(pools[target.label], target.url, body)
                if turn > 0:  # the first turn tokenizes the system prompt: not a turn's cost
                    target.ttft_ms.append(ttft)
            messages.append({"role": "assistant", "content": answer})
    finally:
        for pool in (*pools.values(), warm):
            await pool.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, nargs="+", default=[500, 3000, 12000])
    ap.add_argument("--turns", type=int, default=32)
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS))
    ap.add_argument(
        "--against", nargs="+", default=[], help="also run our router from these git revisions"
    )
    ap.add_argument(
        "--only-against", action="store_true", help="run ours from --against revisions only"
    )
    ap.add_argument("--speed", type=float, default=1000.0, help="the mock engine's speed-up")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    specs = [_spec(r) for r in args.routers]
    rows: list[tuple[int, str, float, float]] = []
    with ExitStack() as stack:
        ours = [s for s in specs if s.kind == "switchyard"]
        if args.only_against:
            specs = [s for s in specs if s.kind != "switchyard"]
        for rev in args.against:
            code = worktree(stack, rev)
            specs += [s.run_from(code, rev) for s in ours]
        fleet = stack.enter_context(MockFleet(1, None, args.speed, args.seed))
        engine = fleet.engines[0]
        print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        for words in args.words:
            routers: list[RunningRouter] = []
            with ExitStack() as running:
                for spec in specs:
                    try:
                        routers.append(
                            running.enter_context(
                                start_router(spec, fleet.engines, DEFAULT_TOKENIZER)
                            )
                        )
                    except Unavailable as exc:
                        print(f"{spec.label}: not available ({exc})", file=sys.stderr)
                time.sleep(0.5)
                direct = Target("direct", engine.url)
                targets = [direct, *(Target(r.spec.label, r.url) for r in routers)]
                asyncio.run(conversation(engine.url, targets, words, args.turns, args.seed))
            base = statistics.median(direct.ttft_ms)
            for t in targets[1:]:
                added = [r - d for r, d in zip(t.ttft_ms, direct.ttft_ms, strict=True)]
                median = statistics.median
                rows.append((words, t.label, median(added), median(t.ttft_ms)))
            print(f"{words} words: direct TTFT median {base:.2f} ms", flush=True)
            for row in rows[-len(targets) + 1 :]:
                print(f"  {row[1]:>28}: adds {row[2]:6.2f} ms (TTFT {row[3]:.2f} ms)", flush=True)
    print(f"\nrouter-added TTFT, median of {args.turns} turns (ms); one connection")
    labels = list(dict.fromkeys(r[1] for r in rows))
    print(f"{'system prompt':>14} " + " ".join(f"{label:>24}" for label in labels))
    for words in args.words:
        cells = {r[1]: r[2] for r in rows if r[0] == words}
        line = " ".join(f"{cells[x]:>24.2f}" if x in cells else f"{'-':>24}" for x in labels)
        print(f"{f'{words:,} words':>14} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
