"""KV store benchmark: lookup latency, ingestion rate, memory per block, tokenization.

Run: python -m bench.kvstore [--redis-url redis://127.0.0.1:6379/0]
Without --redis-url a private redis-server is started on a free loopback port.
Targets the KV store was built to meet: memory lookup p99 < 1 ms and Redis p99 < 5 ms
for a 32k-token prompt (2,048 blocks, tokenization excluded), ingestion >= 200,000
blocks/s, <= 200 B/block.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc

import msgpack

from switchyard.kvstore.events import BlockStored, EventBatch
from switchyard.kvstore.feed import Feed
from switchyard.kvstore.index import Location
from switchyard.kvstore.ingest import Ingestor
from switchyard.kvstore.keys import block_keys
from switchyard.kvstore.memory import MemoryIndex
from switchyard.kvstore.redis_index import RedisIndex
from switchyard.kvstore.store import KVStore
from switchyard.kvstore.tokenize import RoutingTokenizer
from switchyard.loadtest.procs import redis_server
from switchyard.mock.settings import DEFAULT_TOKENIZER

BLOCK = 16
PROMPT_TOKENS = 32_768
ENGINES = 8


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def line(name: str, value: str) -> None:
    print(f"  {name:<58} {value}")


async def bench_lookup(index, label: str, n: int) -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(8000) for _ in range(PROMPT_TOKENS)]
    keys = block_keys(tokens, BLOCK)
    # Worst useful case: every engine holds a different-length part of this prompt,
    # the longest holds all 2,048 blocks, so the walk never stops early.
    for e in range(ENGINES):
        upto = len(keys) * (e + 1) // ENGINES
        await index.add(keys[:upto], Location(f"http://127.0.0.1:{8001 + e}"))
    single = block_keys([rng.randrange(8000) for _ in range(PROMPT_TOKENS)], BLOCK)
    await index.add(single, Location("http://127.0.0.1:9000"))
    for name, ks in (("8 engines share the prefix", keys), ("1 engine holds it", single)):
        for _ in range(20):
            await index.lookup(ks, block_size=BLOCK)
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            res = await index.lookup(ks, block_size=BLOCK)
            samples.append(time.perf_counter() - t0)
        assert res[0].matched_tokens == PROMPT_TOKENS
        line(
            f"{label} lookup, 2,048 blocks, {name}",
            f"p50 {pct(samples, 0.5) * 1e3:.3f} ms  p99 {pct(samples, 0.99) * 1e3:.3f} ms",
        )


def make_payloads(n_batches: int, blocks_per_event: int, events_per_batch: int) -> list[bytes]:
    """vLLM-style batches: chained BlockStored events with uint64 hashes (array encoding)."""
    rng = random.Random(2)
    payloads = []
    h = 1 << 63
    for _ in range(n_batches):
        events = []
        for _ in range(events_per_batch):
            tokens = [rng.randrange(8000) for _ in range(blocks_per_event * BLOCK)]
            hashes = list(range(h, h + blocks_per_event))
            h += blocks_per_event
            events.append(["BlockStored", hashes, None, tokens, BLOCK, None, "GPU"])
        payloads.append(msgpack.packb([time.time(), events, 0]))
    return payloads


async def bench_ingest(store: KVStore, label: str, payloads: list[bytes], blocks: int) -> None:
    feed = Feed(Ingestor("http://127.0.0.1:8001"), "bench", "tcp://bench")
    t0 = time.perf_counter()
    for seq, payload in enumerate(payloads):
        await store._on_frame(feed, seq, payload)
    dt = time.perf_counter() - t0
    line(
        f"{label} ingestion (msgpack decode + re-key + index)",
        f"{blocks / dt:,.0f} blocks/s  ({blocks:,} blocks in {dt:.2f} s)",
    )


def bench_memory_bytes(n_blocks: int) -> None:
    rng = random.Random(3)
    chunks = [[rng.randrange(8000) for _ in range(64 * BLOCK)] for _ in range(n_blocks // 64)]

    def index_only() -> MemoryIndex:
        idx = MemoryIndex(capacity_blocks=n_blocks * 2)
        for i, tokens in enumerate(chunks):
            idx.add_sync(block_keys(tokens, BLOCK), Location(f"http://127.0.0.1:{8001 + i % 16}"))
        return idx

    def via_events() -> tuple[MemoryIndex, list[Ingestor]]:
        idx = MemoryIndex(capacity_blocks=n_blocks * 2)
        ings = [Ingestor(f"http://127.0.0.1:{8001 + e}") for e in range(16)]
        h = 1 << 63
        for i, tokens in enumerate(chunks):
            ev = BlockStored(list(range(h, h + 64)), None, tokens, BLOCK)
            h += 64
            idx.apply_sync(ings[i % 16].ops(EventBatch(0.0, [ev])))
        return idx, ings

    for name, build in (("index only", index_only), ("index + engine-hash maps", via_events)):
        gc.collect()
        tracemalloc.start()
        kept = build()
        used, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        n = len(kept[0] if isinstance(kept, tuple) else kept)
        line(f"memory per indexed block, {name} ({n:,} blocks)", f"{used / n:.0f} B/block")
        del kept


def bench_tokenize() -> None:
    tok = RoutingTokenizer.from_dir(DEFAULT_TOKENIZER)
    rng = random.Random(4)
    words = "the router keeps a prefix index of every engine and each block key".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(2700)]
    system = "\n".join(lines)
    questions = [f"Question {i}: which engine should serve request {i}?" for i in range(6)]
    cold = []
    for q in questions[:3]:
        fresh = RoutingTokenizer.from_dir(DEFAULT_TOKENIZER)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        t0 = time.perf_counter()
        ids = fresh.encode_chat(msgs)
        cold.append(time.perf_counter() - t0)
    tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "warm"}])
    warm = []
    for q in questions[3:]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        t0 = time.perf_counter()
        tok.encode_chat(msgs)
        warm.append(time.perf_counter() - t0)
    line(
        f"tokenize a {len(ids):,}-token chat, cold",
        f"median {statistics.median(cold) * 1e3:.1f} ms",
    )
    line(
        "  same, shared system prompt already cached",
        f"median {statistics.median(warm) * 1e3:.1f} ms",
    )


async def main(redis_url: str) -> None:
    print("switchyard kvstore benchmark")
    print(f"  python {sys.version.split()[0]}, block size {BLOCK}, prompt {PROMPT_TOKENS:,} tokens")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"  {os.cpu_count()} CPUs, load average {load} (p99 is sensitive to other processes)")
    await bench_lookup(MemoryIndex(), "memory", 2000)
    ridx = RedisIndex(redis_url, prefix="bench:")
    await ridx._r.flushdb()
    await bench_lookup(ridx, "redis ", 300)
    await ridx.close()

    payloads = make_payloads(400, 16, 16)
    memory = KVStore(MemoryIndex(capacity_blocks=4_000_000), block_size=BLOCK)
    await bench_ingest(memory, "memory", payloads, 400 * 256)
    rstore = KVStore(RedisIndex(redis_url, prefix="bench2:"), block_size=BLOCK, update_timeout_s=10)
    await rstore.start()
    await bench_ingest(rstore, "redis ", payloads[:200], 200 * 256)
    await rstore.stop()

    bench_memory_bytes(500_000)
    bench_tokenize()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default=None)
    args = ap.parse_args()
    if args.redis_url:
        asyncio.run(main(args.redis_url))
    else:
        with redis_server() as (url, _):
            asyncio.run(main(url))
